"""What a caller of the coordinator receives: committed tokens as they are committed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from specray.errors import SpecrayError
from specray.outputs import RequestOutput
from specray.sampling.logprobs import TokenLogprob


@dataclass
class StreamDelta:
    token_ids: list[int]  # newly committed tokens (may be empty on the final delta)
    output: RequestOutput | None = None  # set on the final delta
    logprobs: list[TokenLogprob] | None = None  # one per token (params.logprobs)
    # on the request's first delta with tokens (params.prompt_logprobs): one per prompt token,
    # None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def merge(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by ``later`` as one."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = [*(logprobs or ()), *later.logprobs]
        return StreamDelta(
            [*self.token_ids, *later.token_ids],
            later.output,
            logprobs,
            self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs,
        )


class StreamSink(Protocol):
    """Takes a request's events instead of its queue (a front-end session of the engine core
    batches every request's new tokens into one message per round)."""

    def on_tokens(self, request_id: str, delta: StreamDelta) -> None: ...

    def on_end(
        self, request_id: str, output: RequestOutput | None, error: SpecrayError | None
    ) -> None: ...


class RequestStream:
    """Committed tokens of one request as they are committed; ``result()`` waits for the end."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self._output: RequestOutput | None = None
        self._error: SpecrayError | None = None
        self._done = asyncio.Event()
        self._sink: StreamSink | None = None
        self._drained = False  # the final delta or an error was taken by ``async for``

    def attach(self, sink: StreamSink) -> None:
        """Send this request's events to ``sink`` from now on (those queued first)."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, SpecrayError):
                sink.on_end(self.request_id, None, item)
            elif item.output is not None:  # the final delta
                sink.on_end(self.request_id, item.output, None)
            else:
                sink.on_tokens(self.request_id, item)
        self._sink = sink

    def _push(self, token_ids: list[int], logprobs=None, prompt_logprobs=None) -> None:
        delta = StreamDelta(list(token_ids), None, logprobs, prompt_logprobs)
        if self._sink is not None:
            self._sink.on_tokens(self.request_id, delta)
        else:
            self._queue.put_nowait(delta)

    def _finish(self, output: RequestOutput | None, error: SpecrayError | None) -> None:
        self._output, self._error = output, error
        self._done.set()
        if self._sink is not None:
            self._sink.on_end(self.request_id, output, error)
        else:
            self._queue.put_nowait(StreamDelta([], output) if error is None else error)

    def next_ready(self) -> StreamDelta | None:
        """The next delta if one is already queued (no waiting), else None: a consumer slower
        than the rounds merges what piled up instead of forwarding it piece by piece."""
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, SpecrayError):
            raise item
        return item

    # An iterator object rather than an async generator: a consumer that stops at the final
    # delta would leave a generator suspended, which the loop then closes in a task of its
    # own (a wake-up from the garbage collector's thread-safe hook), once per request.
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._drained:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, SpecrayError):
            self._drained = True
            raise item
        self._drained = item.output is not None
        return item

    async def result(self) -> RequestOutput:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._output
