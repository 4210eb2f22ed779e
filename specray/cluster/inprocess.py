"""The same target and draft workers as the Ray actors, hosted in this process.

For a single-machine server without Ray (``specray serve --no-ray``-style tests and the front
ends' tests): the worker classes are the actors' own classes, called on threads that give the
same ordering as the actors' concurrency groups — rounds and releases one at a time in order
on the target, read-only calls beside them; a few calls at once on a draft worker so a waiting
call can stop a draft-ahead. Blocks still travel draft -> target over gRPC on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from specray.distributed import DRAFT_WORKER_CONCURRENCY
from specray.protocol import (
    DraftItem,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    RoundReport,
    VerifyRound,
)


class InProcessTarget:
    """A :class:`specray.cluster.backends.TargetBackend` over a TargetWorker in this process."""

    def __init__(self, target: str, *, num_threads: int = 1):
        from specray.actors.target_worker import TargetWorker

        self.worker = TargetWorker(target, 0, 1, "", num_threads, verifier_host="127.0.0.1")
        self.address = self.worker.address
        self._ordered = ThreadPoolExecutor(1, thread_name_prefix="target")
        self._control = ThreadPoolExecutor(2, thread_name_prefix="target-control")

    async def _call(self, executor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def verify(self, round_: VerifyRound) -> RoundReport:
        return await self._call(self._ordered, self.worker.verify_round, round_)

    async def release(self, request_ids: list[str]) -> None:
        await self._call(self._ordered, self.worker.release, request_ids)

    async def ping(self) -> None:
        await self._call(self._control, self.worker.ping)

    async def held_requests(self) -> list[str]:
        return await self._call(self._control, self.worker.held_requests)

    def close(self) -> None:
        self._ordered.shutdown(wait=True)
        self._control.shutdown(wait=True)
        self.worker.stop()


class InProcessDrafts:
    """A :class:`specray.cluster.backends.DraftBackend` over DraftWorkers in this process."""

    def __init__(
        self,
        target: str,
        draft: str,
        target_address: str,
        *,
        num_workers: int = 1,
        draft_probs_encoding: str = "fp32",
        num_threads: int = 1,
    ):
        self._spec = (target, draft, draft_probs_encoding, num_threads)
        self._address = target_address
        self.workers = [self._start() for _ in range(num_workers)]
        self.num_workers = num_workers
        self._pools = [
            ThreadPoolExecutor(DRAFT_WORKER_CONCURRENCY, thread_name_prefix=f"draft-{index}")
            for index in range(num_workers)
        ]

    def _start(self):
        from specray.actors.draft_worker import DraftWorker

        worker = DraftWorker(*self._spec)
        worker.connect(self._address)
        return worker

    async def _call(self, index: int, method: str, *args):
        fn = getattr(self.workers[index], method)
        return await asyncio.get_running_loop().run_in_executor(self._pools[index], fn, *args)

    def available(self, worker: int) -> bool:
        return True

    async def prefill(self, worker: int, items: Sequence[DraftItem]) -> PrefillReport:
        return await self._call(worker, "prefill", items)

    async def propose(self, worker: int, call: ProposeCall) -> ProposeReport:
        return await self._call(worker, "propose", call)

    async def release(self, worker: int, request_ids: list[str]) -> None:
        await self._call(worker, "release", request_ids)

    async def replace(self, worker: int) -> None:
        self.workers[worker] = await asyncio.get_running_loop().run_in_executor(
            self._pools[worker], self._start
        )

    async def held_requests(self, worker: int) -> list[str]:
        return await self._call(worker, "held_requests")

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
