"""The engine core: the coordinator's round loop in the target group's rank 0, beside the
forward, so that a round costs no Ray call (docs/design.md, "The engine core").

An asyncio loop on its own thread runs :class:`~specray.engine_core.coordinator.Coordinator`;
the target is this process's :class:`~specray.actors.target_worker.TargetWorker`, its rounds
run one at a time on one thread (the GIL is released inside the forward, so the loop keeps
serving front ends and draft workers meanwhile); the draft workers are the streams of
:class:`~specray.engine_core.draft_streams.StreamDraftPool`; front ends are sessions on a port
of the loop's own (:mod:`specray.engine_core.sessions`). Ray places, starts, watches and
replaces the processes; it is not on the per-round path.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable

from specray.engine_core.async_scheduling import OpenRound, started
from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.draft_streams import StreamDraftPool
from specray.engine_core.sessions import SessionServer
from specray.protocol import RoundReport, VerifyRound


class _RoundThread:
    """One thread that runs the target's calls in order. Results come back to the loop as one
    ``call_soon_threadsafe`` each: no ``concurrent.futures`` future, lock and chaining per
    round (what ``run_in_executor`` costs the loop on every round)."""

    def __init__(self, thread_init: Callable[[], None] | None):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread_init = thread_init
        self._thread = threading.Thread(target=self._run, name="target-rounds", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            try:
                result = fn(*args)
            except BaseException as error:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    def submit(self, fn, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=30)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():  # its coroutine went away (the loop is stopping)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class LocalTarget:
    """A :class:`specray.engine_core.backends.TargetBackend` over the TargetWorker in this process:
    rounds and releases run in order on one thread."""

    def __init__(self, worker, pool: StreamDraftPool, thread_init=None):
        self.worker, self.pool = worker, pool
        self._ordered = _RoundThread(thread_init)

    async def verify(self, round_: VerifyRound | OpenRound) -> RoundReport:
        report = await self._ordered.submit(self._run_round, round_)
        # The round's verdicts wait for the commands the coordinator now gathers for the next
        # round (one message per draft worker), or go alone at the end of this turn.
        self.pool.schedule_flush()
        return report

    def _run_round(self, round_: VerifyRound | OpenRound) -> RoundReport:
        """(On the round thread: an open round closes when its turn comes.)"""
        return self.worker.verify_round(started(round_))

    async def release(self, request_ids: list[str]) -> None:
        await self._ordered.submit(self.worker.release, request_ids)

    async def ping(self) -> None:
        """Nothing to cross: the target is in this process."""

    async def held_requests(self) -> list[str]:
        return self.worker.held_requests()

    def close(self) -> None:
        self._ordered.close()


class EngineCoreHost:
    """Starts the coordinator on its own loop thread over ``worker`` (rank 0) and its pool."""

    def __init__(
        self,
        worker,
        config: CoordinatorConfig,
        *,
        with_drafts: bool,
        max_positions: int | None,
        model_name: str = "default",
        thread_init: Callable[[], None] | None = None,
        session_host: str = "127.0.0.1",
    ):
        """``thread_init`` runs first on the loop's and the target's threads (the worker marks
        them as its own round path, :mod:`specray.actors.ray_calls`). Front ends connect to
        ``address``, a free port on ``session_host``."""
        self._thread_init = thread_init
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="engine-core")
        self._thread.daemon = True
        self._thread.start()
        self.target = LocalTarget(worker, worker.pool, thread_init)
        self.pool = worker.pool if with_drafts else None

        async def start() -> Coordinator:
            coordinator = Coordinator(
                self.target,
                self.pool,
                config,
                vocab_size=worker.vocab_size,
                eos_token_ids=worker.eos_token_ids,
                max_positions=max_positions,
                tokenizer=None,  # text is the front ends' work
                model_name=model_name,
            )
            if self.pool is not None:
                self.pool.bind(self.loop, coordinator.draft_worker_lost)
            await coordinator.start()
            self.sessions = SessionServer(coordinator)
            self.address = await self.sessions.start(session_host)
            return coordinator

        self.sessions: SessionServer | None = None
        self.address = ""
        self.coordinator = self.call(start())
        self.started_s = time.monotonic()

    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        self.loop.run_forever()

    def call(self, awaitable, timeout_s: float | None = None):
        """Run a coroutine on the engine core's loop from another thread; wait for it."""

        async def wrapped():
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout_s)

    def stop(self, *, drain: bool = True) -> None:
        if not self.loop.is_running():
            return
        # No new sessions; the ones open see their requests drain, then their connection close.
        self.loop.call_soon_threadsafe(self.sessions.stop_accepting)
        self.call(self.coordinator.stop(drain=drain))
        self.loop.call_soon_threadsafe(self.sessions.close_all)
        if self.pool is not None:
            self.pool.unbind()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.target.close()
