"""The asyncio client: :class:`specray.client.Client`'s methods, awaitable."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specray.client.config import Metadata, config_from_options
from specray.client.errors import SpecrayClientError, no_final_error
from specray.client.requests import build_request
from specray.client.results import Chunk, Completion, ModelInfo
from specray.client.retry import Deadline, RetryPolicy, call_with_retries_async
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc


class AsyncClient:
    """As :class:`specray.client.Client`, for asyncio. The channel opens on first use, on the
    running loop: use one client per event loop.

    Example::

        async with AsyncClient("localhost:50051") as client:
            async for chunk in client.stream("Hello", max_tokens=32):
                print(chunk.text, end="")
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
        self._channel: grpc.aio.Channel | None = None

    def _stubs(self):
        """(generation stub, health stub), opening the channel on the running loop."""
        if self._channel is None:
            credentials = self.config.credentials()
            options = self.config.channel_options()
            self._channel = (
                grpc.aio.secure_channel(self.config.target, credentials, options)
                if credentials is not None
                else grpc.aio.insecure_channel(self.config.target, options)
            )
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub, self._health

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
    ) -> AsyncIterator[Chunk]:
        """Chunks as tokens are committed; the last carries the :class:`Completion`. Closing
        the iterator early (or cancelling its task) cancels the call and the request."""
        request = build_request(prompt, messages, prompt_token_ids, sampling)
        return self._chunks(request, timeout, self.config.call_metadata(metadata))

    async def _chunks(self, request, timeout, metadata) -> AsyncIterator[Chunk]:
        stub, _ = self._stubs()
        deadline = Deadline(timeout)
        retry = 0
        while True:
            call = stub.Generate(request, timeout=deadline.remaining_s(), metadata=metadata)
            received = False
            try:
                final_seen = False
                async for response in call:
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
            await asyncio.sleep(delay_s)
            retry += 1

    async def generate(
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
            complete = self._stubs()[0].Complete
            try:
                final = await self._unary(complete, request, timeout, metadata, self._count_retry)
                return Completion.from_proto(final)
            except SpecrayClientError as error:
                if error.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._without_complete = True
        request.final_only = True
        completion = None
        async for chunk in self._chunks(request, timeout, self.config.call_metadata(metadata)):
            completion = chunk.completion or completion
        return completion  # the stream raised if it ended without one

    def _count_retry(self) -> None:
        self.generate_retries += 1

    # ---- unary calls (retried on UNAVAILABLE) ---------------------------------------------
    async def _unary(self, method, request, timeout, metadata, on_retry=None):
        call_metadata = self.config.call_metadata(metadata)
        return await call_with_retries_async(
            lambda timeout_s: method(request, timeout=timeout_s, metadata=call_metadata),
            self.config.retry,
            timeout,
            on_retry,
        )

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        request = pb.GetModelInfoRequest()
        info = await self._unary(self._stubs()[0].GetModelInfo, request, timeout, metadata)
        return ModelInfo.from_proto(info)

    async def health(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """True when the server reports SERVING (grpc.health.v1 Check of the whole server)."""
        request = health_pb2.HealthCheckRequest(service="")
        response = await self._unary(self._stubs()[1].Check, request, timeout, metadata)
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Cancel a request by id; False when no such request was in flight."""
        request = pb.AbortRequest(request_id=request_id)
        return (await self._unary(self._stubs()[0].Abort, request, timeout, metadata)).aborted

    # ---- lifetime --------------------------------------------------------------------------
    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
