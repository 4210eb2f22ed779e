"""A coordinator on its own event-loop thread, with a blocking API for scripts, benchmarks and
the offline :class:`specray.engine.Engine` (the serving layer drives it with asyncio directly).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence

from specray.cluster.coordinator import Coordinator
from specray.cluster.streams import RequestStream, StreamDelta
from specray.outputs import RequestOutput
from specray.sampling import SamplingParams


class SyncStream:
    """Iterate the committed-token deltas of one request from a plain thread."""

    def __init__(self, runner: CoordinatorThread, stream: RequestStream):
        self._runner, self._stream = runner, stream
        self.request_id = stream.request_id

    def __iter__(self) -> Iterator[StreamDelta]:
        iterator = aiter(self._stream)
        while True:
            try:
                delta = self._runner.call(anext(iterator))
            except StopAsyncIteration:
                return
            yield delta
            if delta.output is not None:
                return

    def result(self, timeout_s: float | None = None) -> RequestOutput:
        return self._runner.call(self._stream.result(), timeout_s)


class CoordinatorThread:
    def __init__(self, make_coordinator: Callable[[], Coordinator]):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def create() -> Coordinator:
            coordinator = make_coordinator()
            await coordinator.start()
            return coordinator

        self.coordinator = self.call(create())

    def call(self, awaitable, timeout_s: float | None = None):
        """Run a coroutine on the coordinator's loop and wait for its result."""

        async def wrapped():
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout_s)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None, **kwargs):
        stream = self.call(self.coordinator.submit(prompt_token_ids, params, **kwargs))
        return SyncStream(self, stream)

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Submit every prompt at once and wait for all outputs (in order)."""
        streams = [
            self.submit(ids, request_params)
            for ids, request_params in zip(prompts, params, strict=True)
        ]
        return [stream.result() for stream in streams]

    def abort(self, request_id: str) -> bool:
        return self.loop.call_soon_threadsafe(self.coordinator.abort, request_id) is not None

    def stop(self, *, drain: bool = True) -> None:
        if not self.loop.is_running():
            return
        self.call(self.coordinator.stop(drain=drain))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
