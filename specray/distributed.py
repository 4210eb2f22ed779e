"""The distributed workers: one target group (TP ranks on one target node) and a pool of draft
workers on draft nodes, as Ray actors; plus the async adapters the coordinator drives them by.

Draft workers stream blocks with their q straight to the target group's rank 0 over gRPC; the
coordinator only tells each side which requests to work on (:mod:`specray.cluster.coordinator`).
A failed draft worker is replaced in the background while its requests run target-only.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence

from specray.cluster.placement import PlacementConfig
from specray.protocol import (
    DraftItem,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    RoundReport,
    VerifyRound,
    decode,
    encode,
)

log = logging.getLogger(__name__)
DEFAULT_DRAFT_DEADLINE_S = 5.0  # how long the target waits for a block before going alone
LOCAL_NODE_RESOURCES = 8.0  # draft / target units an embedded one-node cluster advertises
DRAFT_WORKER_CONCURRENCY = 4  # a waiting call must be able to arrive to stop a draft-ahead


def connect(cluster: str, placement: PlacementConfig) -> None:
    """``"auto"``: an embedded local Ray (both node types on this machine); else an address."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cluster == "auto":
        ray.init(
            include_dashboard=False,
            resources={
                placement.draft_resource: LOCAL_NODE_RESOURCES,
                placement.target_resource: LOCAL_NODE_RESOURCES,
            },
            log_to_driver=False,
        )
    else:
        ray.init(address=cluster, log_to_driver=False)


class TargetGroup:
    """One target group: a TP rank per bundle of a STRICT_PACK placement group (rank 0 serves
    the drafts' gRPC streams), started and stopped as one unit.

    ``group`` / ``first_bundle``: place the ranks in an existing placement group (a Serve
    replica's own, whose bundle 0 holds the replica), else one is created and owned here.
    ``keep_features``: rank 0 keeps the target's hidden states and sends them with each
    verdict (the drafts are feature-conditioned).
    """

    def __init__(
        self,
        target: str,
        tp_size: int,
        placement: PlacementConfig,
        *,
        group=None,
        first_bundle: int = 0,
        keep_features: bool = False,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specray.actors.target_worker import TargetWorker

        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
        self._owns_group = group is None
        if group is None:
            group = placement_group(placement.target_bundles(tp_size), "STRICT_PACK")
            ray.get(group.ready(), timeout=120)
        self.group = group
        init_method = f"file:///tmp/specray-tp-{uuid.uuid4().hex}"
        worker = ray.remote(concurrency_groups=TargetWorker.CONCURRENCY_GROUPS)(TargetWorker)
        self.ranks = [
            worker.options(
                **placement.target_rank_options(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, first_bundle + rank),
            ).remote(
                target,
                rank,
                tp_size,
                init_method,
                placement.num_threads,
                keep_features=keep_features,
            )
            for rank in range(tp_size)
        ]
        self.info = ray.get([rank.info.remote() for rank in self.ranks])
        self._followers = [rank.follow.remote() for rank in self.ranks[1:]]
        self.leader = self.ranks[0]
        self.address = self.info[0]["address"]

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Rank 0 answers and no follower loop has ended (a dead rank ends the group)."""
        import ray

        done, _ = ray.wait(self._followers, timeout=0) if self._followers else ([], [])
        if done:
            return False
        try:
            ray.get(self.leader.ping.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return False
        return True

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.leader.stop.remote(), timeout=30)
            ray.get(self._followers, timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        for actor in self.ranks:
            ray.kill(actor)
        if self._owns_group:
            remove_placement_group(self.group)


def reads_target_features(draft: str | None) -> bool:
    """A feature-conditioned draft (alone or after ``ngram+``): its target group keeps h."""
    from specray.distill.student import is_feature_conditioned_draft

    return draft is not None and is_feature_conditioned_draft(draft.removeprefix("ngram+"))


def start_draft_actor(target: str, draft: str, encoding: str, placement: PlacementConfig):
    """A DraftWorker actor on a draft node (not yet connected to a target group)."""
    import ray

    from specray.actors.draft_worker import DraftWorker

    options = placement.draft_options() | {"max_concurrency": DRAFT_WORKER_CONCURRENCY}
    return (
        ray.remote(DraftWorker)
        .options(**options)
        .remote(target, draft, encoding, placement.num_threads)
    )


class DistributedBackend:
    """Starts and owns the actors: ``target_ranks`` (rank 0 = ``leader``) and ``drafts``."""

    def __init__(
        self,
        target: str,
        draft: str | None,
        *,
        tp_size: int = 1,
        num_draft_workers: int = 1,
        draft_probs_encoding: str = "fp32",
        placement: PlacementConfig | None = None,
    ):
        import ray

        if isinstance(num_draft_workers, bool) or not isinstance(num_draft_workers, int):
            raise ValueError(f"num_draft_workers must be an integer, got {num_draft_workers!r}")
        if num_draft_workers < 1:
            raise ValueError(f"num_draft_workers must be >= 1, got {num_draft_workers}")
        self.placement = placement or PlacementConfig()
        self._target_spec, self._draft_spec = target, draft
        self._encoding = draft_probs_encoding
        self.feature_conditioned = reads_target_features(draft)
        self.target_group = TargetGroup(
            target, tp_size, self.placement, keep_features=self.feature_conditioned
        )
        self.target_ranks = self.target_group.ranks
        self.target_info = self.target_group.info
        self.leader = self.target_group.leader
        self.address = self.target_group.address
        self.drafts: list = []
        self._ready: list = []  # per worker: a pending start, or None once ready
        self.draft_restarts = 0
        if draft is not None:
            for _ in range(num_draft_workers):
                self.drafts.append(None)
                self._ready.append(None)
                self._start_draft(len(self.drafts) - 1)
            ray.get(self._ready)  # the first workers are waited for; replacements are not
            self._ready = [None] * num_draft_workers

    def _start_draft(self, index: int) -> None:
        actor = start_draft_actor(
            self._target_spec, self._draft_spec, self._encoding, self.placement
        )
        self.drafts[index] = actor
        self._ready[index] = actor.connect.remote(self.address)

    def draft_available(self, index: int) -> bool:
        """True when the worker can take work; finishes a pending replacement start."""
        import ray

        pending = self._ready[index]
        if pending is None:
            return True
        done, _ = ray.wait([pending], timeout=0)
        if not done:
            return False
        try:
            ray.get(pending)
        except ray.exceptions.RayError as error:
            log.warning("replacement draft worker failed to start: %s", error)
            self._start_draft(index)
            return False
        self._ready[index] = None
        return True

    def replace_draft(self, index: int) -> None:
        import ray

        self.draft_restarts += 1
        ray.kill(self.drafts[index], no_restart=True)
        self._start_draft(index)

    def calibrate(self, batches=(1, 2, 4, 8, 16), tokens=(1, 2, 3, 5, 9)):
        """Measured costs as tables: target forwards over (batch, tokens) and draft steps over
        batch sizes. Returns ``(VerifyCost, DraftCost | None)``: the coordinator's cost model
        (its priors) and the latency model of ``specray simulate``."""
        import ray

        from specray.cluster.policy import DraftCost, VerifyCost, tabulate

        grid = [(batch, count) for batch in batches for count in tokens]
        measured = ray.get(self.leader.calibrate.remote(grid))
        verify = VerifyCost(0.0, 0.0, 0.0, tabulate([(b * n, s) for b, n, s in measured]))
        if not self.drafts:
            return verify, None
        steps = ray.get(self.drafts[0].calibrate.remote(list(batches)))
        return verify, DraftCost(0.0, 0.0, tabulate(steps))

    def shutdown(self) -> None:
        import ray

        self.target_group.stop()
        for actor in self.drafts:
            ray.kill(actor)

    def placement_report(self) -> dict:
        import ray

        report = {"target": [info["node_id"] for info in self.target_info]}
        if self.drafts:
            report["draft"] = ray.get(self.drafts[0].node_id.remote())
        return report


class RayTargetBackend:
    """The coordinator's view of a target group: rank 0's calls, awaited on the event loop."""

    def __init__(self, leader):
        self.leader = leader  # rank 0's actor handle

    async def verify(self, round_: VerifyRound) -> RoundReport:
        return decode(await self.leader.verify_wire.remote(encode(round_)), RoundReport)

    async def release(self, request_ids: list[str]) -> None:
        await self.leader.release.remote(request_ids)

    async def ping(self) -> None:
        await self.leader.ping.remote()

    async def held_requests(self) -> list[str]:
        return await self.leader.held_requests.remote()


async def prefill_remote(actor, items: Sequence[DraftItem]) -> PrefillReport:
    """A DraftWorker actor's prefill, over the protocol's wire form."""
    call = ProposeCall(tuple(items), draft_ahead=False)
    return decode(await actor.prefill_wire.remote(encode(call)), PrefillReport)


async def propose_remote(actor, call: ProposeCall) -> ProposeReport:
    """A DraftWorker actor's propose, over the protocol's wire form."""
    return decode(await actor.propose_wire.remote(encode(call)), ProposeReport)


class RayDraftBackend:
    """The coordinator's view of the draft pool."""

    def __init__(self, backend: DistributedBackend):
        self.backend = backend
        self.num_workers = len(backend.drafts)

    def available(self, worker: int) -> bool:
        return self.backend.draft_available(worker)

    async def prefill(self, worker: int, items: Sequence[DraftItem]) -> PrefillReport:
        return await prefill_remote(self.backend.drafts[worker], items)

    async def propose(self, worker: int, call: ProposeCall) -> ProposeReport:
        return await propose_remote(self.backend.drafts[worker], call)

    async def release(self, worker: int, request_ids: list[str]) -> None:
        await self.backend.drafts[worker].release.remote(request_ids)

    async def replace(self, worker: int) -> None:
        self.backend.replace_draft(worker)

    async def held_requests(self, worker: int) -> list[str]:
        return await self.backend.drafts[worker].held_requests.remote()
