"""The blocking client."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specray.client.config import Metadata, config_from_options
from specray.client.errors import SpecrayClientError, no_final_error
from specray.client.requests import build_request
from specray.client.results import Chunk, Completion, ModelInfo
from specray.client.retry import Deadline, RetryPolicy, call_with_retries
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc


class Client:
    """``specray.v1.Generation`` over one channel.

    Example::

        with Client("localhost:50051", token="...") as client:
            completion = client.generate("Hello", max_tokens=32, temperature=0)
            for chunk in client.stream("Hello", max_tokens=32):
                print(chunk.text, end="")

    Sampling keywords are :class:`specray.SamplingParams` fields, plus ``stop``,
    ``num_speculative_tokens`` (0: speculation off) and ``request_id``. ``timeout`` (seconds)
    and ``metadata`` apply per call. Every call failure is a :class:`SpecrayClientError`.
    Unary calls retry UNAVAILABLE (see :mod:`specray.client.retry`); generations never do.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates=None,
        client_cert=None,
        client_key=None,
        server_name: str | None = None,
        max_retries: int | None = None,
        retry: RetryPolicy | None = None,
        max_message_bytes: int | None = None,
    ):
        self.config = config_from_options(
            target, max_retries, token=token, tls=tls, root_certificates=root_certificates,
            client_cert=client_cert, client_key=client_key, server_name=server_name,
            retry=retry, max_message_bytes=max_message_bytes,
        )  # fmt: skip
        self.generate_retries = 0  # generation calls retried before any output reached us
        self._without_complete = False  # the server answered Complete with UNIMPLEMENTED
        credentials = self.config.credentials()
        options = self.config.channel_options()
        self._channel = (
            grpc.secure_channel(self.config.target, credentials, options)
            if credentials is not None
            else grpc.insecure_channel(self.config.target, options)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # ---- generation (retried on UNAVAILABLE only before its first chunk) -----------------
    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling,
    ) -> Iterator[Chunk]:
        """Chunks as tokens are committed; the last carries the :class:`Completion`. Closing
        the iterator early cancels the call, and the server aborts the request."""
        request = build_request(prompt, messages, prompt_token_ids, sampling)  # checked now
        return self._chunks(request, timeout, self.config.call_metadata(metadata))

    def _chunks(self, request, timeout, metadata) -> Iterator[Chunk]:
        deadline = Deadline(timeout)
        retry = 0
        while True:
            call = self._stub.Generate(request, timeout=deadline.remaining_s(), metadata=metadata)
            received = False
            try:
                final_seen = False
                for response in call:
                    received = True
                    chunk = Chunk.from_proto(response)
                    final_seen = chunk.completion is not None
                    yield chunk
                if not final_seen:
                    raise no_final_error()
                return
            except grpc.RpcError as error:
                # Nothing delivered yet: a retry cannot duplicate output (see retry.py).
                delay_s = None
                if not received:
                    delay_s = self.config.retry.next_delay_s(
                        retry, error.code(), deadline.remaining_s(), random.random()
                    )
                if delay_s is None:
                    raise SpecrayClientError.from_rpc_error(error) from error
            finally:
                call.cancel()  # no-op once the call ended; otherwise the server aborts it
            self.generate_retries += 1
            time.sleep(delay_s)
            retry += 1

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling,
    ) -> Completion:
        """The whole generation, by the unary ``Complete`` call (a server from before it:
        ``Generate`` with ``final_only``). Retried on UNAVAILABLE: no output reached the
        caller before the call ended."""
        request = build_request(prompt, messages, prompt_token_ids, sampling)
        if not self._without_complete:
            try:
                final = self._unary(
                    self._stub.Complete, request, timeout, metadata, self._count_retry
                )
                return Completion.from_proto(final)
            except SpecrayClientError as error:
                if error.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._without_complete = True
        request.final_only = True
        completion = None
        for chunk in self._chunks(request, timeout, self.config.call_metadata(metadata)):
            completion = chunk.completion or completion
        return completion  # the stream raised if it ended without one

    def _count_retry(self) -> None:
        self.generate_retries += 1

    # ---- unary calls (retried on UNAVAILABLE) ---------------------------------------------
    def _unary(
        self, method, request, timeout: float | None, metadata: Metadata | None, on_retry=None
    ):
        call_metadata = self.config.call_metadata(metadata)
        return call_with_retries(
            lambda timeout_s: method(request, timeout=timeout_s, metadata=call_metadata),
            self.config.retry,
            timeout,
            on_retry,
        )

    def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        info = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata)
        return ModelInfo.from_proto(info)

    def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> bool:
        """True when the server reports SERVING (grpc.health.v1 Check of the whole server)."""
        request = health_pb2.HealthCheckRequest(service="")
        response = self._unary(self._health.Check, request, timeout, metadata)
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Cancel a request by id; False when no such request was in flight."""
        request = pb.AbortRequest(request_id=request_id)
        return self._unary(self._stub.Abort, request, timeout, metadata).aborted

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
