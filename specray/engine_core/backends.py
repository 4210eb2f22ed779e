"""What the coordinator needs from the workers: two small async protocols.

The coordinator's scheduling code is the same in the engine core beside a real target (the
target worker in its own process and the draft workers' streams:
:mod:`specray.engine_core`) and over simulated workers on a discrete-event clock
(:mod:`specray.sim`). Calls and replies are the typed messages of :mod:`specray.protocol`.
A draft call returns an awaitable made at once (the engine core gathers one turn's calls into
one message per worker).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

from specray.engine_core.async_scheduling import OpenRound
from specray.protocol import (
    DraftItem,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    RoundReport,
    VerifyRound,
)


class TargetBackend(Protocol):
    async def verify(self, round_: VerifyRound | OpenRound) -> RoundReport:
        """Run a round after those sent before it; an open round (scheduled ahead) is started
        when its turn comes (:func:`~specray.engine_core.async_scheduling.started`)."""
        ...

    async def release(self, request_ids: list[str]) -> None: ...

    async def ping(self) -> None:
        """A no-op call that never queues behind verification: measures the round trip."""
        ...

    async def held_requests(self) -> list[str]:
        """Requests whose state (KV cache) the target holds: for tests and leak checks."""
        ...


class DraftBackend(Protocol):
    num_workers: int

    def available(self, worker: int) -> bool:
        """True when the worker can take work (False once it is gone, until replaced)."""
        ...

    def prefill(self, worker: int, items: Sequence[DraftItem]) -> Awaitable[PrefillReport]:
        """Take on new requests (state and KV cache); they run target-only until it is done."""
        ...

    def propose(self, worker: int, call: ProposeCall) -> Awaitable[ProposeReport]: ...

    def release(self, worker: int, request_ids: Sequence[str]) -> Awaitable[None]: ...

    async def replace(self, worker: int) -> None:
        """A failed worker is to be replaced (returns at once; see ``available``)."""
        ...
