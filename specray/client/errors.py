"""The one exception the client raises: a gRPC status code and the server's message."""

from __future__ import annotations

import grpc

# Worth trying again later (or on another replica): the server is draining, restarting or
# overloaded. Only UNAVAILABLE is retried automatically, and only for unary calls.
RETRIABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class SpecrayClientError(Exception):
    """A failed call. ``code`` is a :class:`grpc.StatusCode`; ``message`` is the server's text
    (for invalid input it names the parameter and the value), or the client's own for errors
    found before anything was sent (then the code is INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE_CODES

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SpecrayClientError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(code))


def invalid_argument(message: str) -> SpecrayClientError:
    return SpecrayClientError(grpc.StatusCode.INVALID_ARGUMENT, message)


def no_final_error() -> SpecrayClientError:
    return SpecrayClientError(grpc.StatusCode.INTERNAL, "the stream ended without a final message")
