"""What the coordinator needs from the workers: two small async protocols.

The coordinator's scheduling code is the same whether the workers are Ray actors exchanging
blocks over gRPC (:mod:`specray.distributed`), workers in this process
(:mod:`specray.cluster.inprocess`) or simulated workers on a discrete-event clock
(:mod:`specray.sim`). Calls and replies are the typed messages of :mod:`specray.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from specray.protocol import (
    DraftItem,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    RoundReport,
    VerifyRound,
)


class TargetBackend(Protocol):
    async def verify(self, round_: VerifyRound) -> RoundReport: ...

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
        """True when the worker can take work (False while a replacement starts)."""
        ...

    async def prefill(self, worker: int, items: Sequence[DraftItem]) -> PrefillReport:
        """Take on new requests (state and KV cache); they run target-only until it is done."""
        ...

    async def propose(self, worker: int, call: ProposeCall) -> ProposeReport: ...

    async def release(self, worker: int, request_ids: list[str]) -> None: ...

    async def replace(self, worker: int) -> None:
        """Start a replacement for a failed worker (returns at once; see ``available``)."""
        ...

    async def held_requests(self, worker: int) -> list[str]: ...
