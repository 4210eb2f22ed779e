"""One error taxonomy: Python exception <-> gRPC status code <-> HTTP status <-> ``error.type``.

Defined once here; the serving layers map exceptions through these attributes and never
send stack traces or internal paths to clients.
"""

from __future__ import annotations


class SpecrayError(Exception):
    """Base of every error a client may see."""

    grpc_code = "INTERNAL"  # name of a grpc.StatusCode member
    http_status = 500
    error_type = "internal_error"  # OpenAI-style ``error.type``
    retriable = False

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the offending parameter, when there is one


class InvalidRequestError(SpecrayError, ValueError):
    """Invalid input; the message names the parameter and the value."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class OverloadedError(SpecrayError):
    """The admission queue is full: retry later (RESOURCE_EXHAUSTED / HTTP 503)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 503
    error_type = "overloaded_error"
    retriable = True


class UnavailableError(SpecrayError):
    """Draining or not ready: retry elsewhere or later (UNAVAILABLE / HTTP 503)."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    error_type = "unavailable_error"
    retriable = True


class DeadlineExceededError(SpecrayError):
    """The request's deadline passed; its resources were released."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    error_type = "timeout_error"


class RequestCancelledError(SpecrayError):
    """The request was cancelled by its caller; its resources were released."""

    grpc_code = "CANCELLED"
    http_status = 499
    error_type = "cancelled_error"


_BY_TYPE = {
    cls.error_type: cls
    for cls in (
        SpecrayError,
        InvalidRequestError,
        OverloadedError,
        UnavailableError,
        DeadlineExceededError,
        RequestCancelledError,
    )
}


def error_to_dict(error: SpecrayError) -> dict:
    """Plain values (crosses Ray and the wire): type, message, param, grpc code, HTTP status."""
    return {
        "type": error.error_type,
        "message": error.message,
        "param": error.param,
        "code": error.grpc_code,
        "http_status": error.http_status,
    }


def error_from_dict(values: dict) -> SpecrayError:
    """The exception :func:`error_to_dict` described (unknown types become internal errors)."""
    cls = _BY_TYPE.get(values.get("type"), SpecrayError)
    return cls(str(values.get("message", "internal error")), param=values.get("param"))
