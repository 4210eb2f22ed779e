"""A discrete-event clock for asyncio: an event loop whose time is virtual and which never sleeps.

Whenever the loop would block in its selector for ``timeout`` seconds (nothing is ready, the
next timer is ``timeout`` away), it jumps its clock to that timer instead. Everything built on
``loop.time()`` and timers (``asyncio.sleep``, ``wait_for``, ``timeout``, ``Event``, ``Lock``,
``Queue``) therefore runs on virtual time, in the same order as it would in real time, as fast
as the callbacks themselves run. Unmodified asyncio code (the coordinator) runs on it as is.

If the loop would block forever (no callback ready, no timer scheduled) every task is waiting
on something that can never happen in a closed simulation: that is a deadlock, and the loop
raises :class:`SimulationDeadlock` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task waits and nothing is scheduled: the simulation can never progress."""


class _VirtualSelector(selectors.BaseSelector):
    """A real selector (the loop's self-pipe stays functional) that never blocks: a wait of
    ``timeout`` seconds advances the owning loop's virtual clock instead."""

    def __init__(self) -> None:
        self._inner = selectors.DefaultSelector()
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj, events, data=None):
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._inner.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._inner.modify(fileobj, events, data)

    def get_key(self, fileobj):
        return self._inner.get_key(fileobj)

    def get_map(self):
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()

    def select(self, timeout=None):
        ready = self._inner.select(0)  # e.g. call_soon_threadsafe wake-ups: never wait for them
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationDeadlock(self.loop._deadlock_message())
        self.loop._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on virtual time, starting at ``start_s`` (0.0 by default)."""

    def __init__(self, start_s: float = 0.0) -> None:
        selector = _VirtualSelector()
        self._now = float(start_s)
        super().__init__(selector=selector)
        selector.loop = self

    def time(self) -> float:
        return self._now

    def _advance(self, timeout: float) -> None:
        target = self._now + timeout
        # Land exactly on the next timer (``now + (when - now)`` can miss it by an ulp).
        scheduled = self._scheduled
        if scheduled and self._now <= scheduled[0]._when <= target + self._clock_resolution:
            target = scheduled[0]._when
        self._now = max(self._now, target)

    def _deadlock_message(self) -> str:
        tasks = [task for task in asyncio.all_tasks(self) if not task.done()]
        names = ", ".join(sorted(task.get_name() for task in tasks)[:10])
        more = f" (+{len(tasks) - 10} more)" if len(tasks) > 10 else ""
        return (
            f"simulation deadlock at virtual t={self._now:.6f}s: no callback is ready and no "
            f"timer is scheduled, yet {len(tasks)} task(s) wait: {names}{more}"
        )


def run_virtual(coro: Coroutine[Any, Any, T], *, start_s: float = 0.0) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop` and close the loop
    (like :func:`asyncio.run`: tasks left running are cancelled, async generators closed)."""
    loop = VirtualTimeLoop(start_s)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_all_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
