"""What an idle round loop of the coordinator waits for: work (a submission, an abort, or the
next waiting request's deadline), then, after a round that ended several requests, the
submissions a closed loop of clients is about to send (``admission.arrival_hold_s``), so that
they enter one round together. All timing on the event loop's clock (the simulator's too)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from specray.engine_core import admission
from specray.engine_core.coordinator_config import CoordinatorConfig
from specray.engine_core.request import Request


async def wait_for_work(wakeup: asyncio.Event, waiting: Sequence[Request]) -> None:
    """Sleep until ``wakeup`` is set (a submit, an abort) or the next waiting request's
    deadline passes."""
    loop = asyncio.get_running_loop()
    deadlines = [r.deadline_s for r in waiting if r.deadline_s is not None]
    timeout = max(min(deadlines) - loop.time(), 0) if deadlines else None
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wakeup.wait(), timeout)


async def hold_for_arrivals(
    wakeup: asyncio.Event,
    waiting: Sequence[Request],
    expected: int,
    round_s: float,
    config: CoordinatorConfig,
) -> None:
    """Wait while fewer than ``expected`` requests are ``waiting``, for at most
    ``admission.arrival_hold_s`` (``round_s``: the last round's time)."""
    loop = asyncio.get_running_loop()
    cap_s = config.arrival_hold_s
    deadline = loop.time() + admission.arrival_hold_s(expected, len(waiting), round_s, cap_s)
    while len(waiting) < expected and (left := deadline - loop.time()) > 0:
        wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wakeup.wait(), left)
