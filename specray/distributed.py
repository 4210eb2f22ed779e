"""The distributed backend: the same rounds as the in-process engine, across Ray actors.

The driver (the Engine in the caller's process) holds every request's committed tokens — the
source of truth. Each round it asks the draft worker to draft (blocks with their q go straight
to the target over gRPC) and asks the target group's rank 0 to verify (it waits for the blocks
up to a deadline, then verifies whatever arrived; a missing, late or invalid block makes that
request's round target-only). A dead draft worker never blocks a request: the driver continues
target-only and resumes speculation once a replacement worker is ready.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from specray.cluster.placement import PlacementConfig
from specray.core import RequestState

log = logging.getLogger(__name__)
DEFAULT_DRAFT_DEADLINE_S = 5.0  # how long the target waits for a block before going alone
DRAFT_RETURN_WAIT_S = 1.0  # after its blocks arrived, the propose call returns within this
LOCAL_NODE_RESOURCES = 8.0  # draft / target units an embedded one-node cluster advertises


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


@dataclass
class RoundStats:
    rounds: int = 0
    draft_bytes: int = 0
    dropped_blocks: int = 0
    draft_failures: int = 0
    draft_restarts: int = 0


class DistributedBackend:
    def __init__(
        self,
        target: str,
        draft: str | None,
        *,
        tp_size: int = 1,
        draft_probs_encoding: str = "fp32",
        placement: PlacementConfig | None = None,
        draft_deadline_s: float = DEFAULT_DRAFT_DEADLINE_S,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specray.actors.draft_worker import DraftWorker
        from specray.actors.target_worker import TargetWorker

        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
        if not draft_deadline_s > 0:
            raise ValueError(f"draft_deadline_s must be > 0, got {draft_deadline_s!r}")
        self.placement = placement or PlacementConfig()
        self.draft_deadline_s = draft_deadline_s
        self.stats = RoundStats()
        self._target_spec, self._draft_spec = target, draft
        self._encoding = draft_probs_encoding
        self._group = placement_group(self.placement.target_bundles(tp_size), "STRICT_PACK")
        ray.get(self._group.ready(), timeout=120)
        init_method = f"file:///tmp/specray-tp-{uuid.uuid4().hex}"
        worker = ray.remote(TargetWorker)
        self.target_ranks = [
            worker.options(
                num_cpus=self.placement.target_num_cpus,
                resources={self.placement.target_resource: 1.0},
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, rank),
            ).remote(target, rank, tp_size, init_method, self.placement.num_threads)
            for rank in range(tp_size)
        ]
        self.target_info = ray.get([rank.info.remote() for rank in self.target_ranks])
        self._followers = [rank.follow.remote() for rank in self.target_ranks[1:]]
        self.leader = self.target_ranks[0]
        self.address = self.target_info[0]["address"]
        self._draft_class = ray.remote(DraftWorker)
        self.draft = None
        self._draft_ready = None  # a pending start of a (replacement) draft worker
        self._draft_inflight = None
        if draft is not None:
            self._start_draft()
            ray.get(self._draft_ready)  # the first worker is waited for; replacements are not
            self._draft_ready = None

    def _start_draft(self) -> None:
        self.draft = self._draft_class.options(**self.placement.draft_options()).remote(
            self._target_spec, self._draft_spec, self._encoding, self.placement.num_threads
        )
        self._draft_ready = self.draft.connect.remote(self.address)

    def _draft_available(self) -> bool:
        """True when a draft worker can take work; finishes a pending replacement start."""
        import ray

        if self.draft is None:
            return False
        if self._draft_ready is not None:
            done, _ = ray.wait([self._draft_ready], timeout=0)
            if not done:
                return False
            try:
                ray.get(self._draft_ready)
            except ray.exceptions.RayError as error:
                log.warning("replacement draft worker failed to start: %s", error)
                self._start_draft()
                return False
            self._draft_ready = None
        return True

    def _draft_failed(self, error: Exception) -> None:
        import ray

        log.warning("draft worker failed (%s); continuing target-only", type(error).__name__)
        self.stats.draft_failures += 1
        self.stats.draft_restarts += 1
        ray.kill(self.draft, no_restart=True)
        self._start_draft()

    def run_round(self, requests: Sequence[RequestState], num_speculative_tokens: int) -> None:
        """One round for ``requests``: commit tokens and record metrics in place."""
        import ray

        self.stats.rounds += 1
        step = self.stats.rounds
        self._collect_draft_result(timeout_s=0)
        use_draft = num_speculative_tokens > 0 and self._draft_inflight is None
        use_draft = use_draft and self._draft_available()
        target_spec, draft_spec = [], []
        for request in requests:
            k = min(num_speculative_tokens, request.remaining - 1) if use_draft else 0
            base = request.to_spec() | {"step": step}
            target_spec.append(
                base | {"num_committed": len(request.output_token_ids), "expect_draft": k > 0}
            )
            if k > 0:
                draft_spec.append(base | {"k": k})
        if draft_spec:
            self._draft_inflight = self.draft.propose.remote(draft_spec)
        results = ray.get(self.leader.verify_round.remote(target_spec, self.draft_deadline_s))
        # Blocks all arrived: the propose call is returning now, wait for it briefly. A block
        # missed the deadline: the draft is slow or gone, do not wait for it.
        late = any(result["dropped_reason"].startswith("deadline") for result in results)
        self._collect_draft_result(timeout_s=0 if late else DRAFT_RETURN_WAIT_S)
        finished = []
        for request, result in zip(requests, results, strict=True):
            request.metrics.record(result["num_draft_tokens"], result["num_accepted"])
            request.commit(result["token_ids"])
            if result["dropped_reason"]:
                self.stats.dropped_blocks += 1
            if request.finish_reason != result["finish_reason"]:
                raise RuntimeError(f"driver and target disagree on {request.request_id}'s end")
            if request.finish_reason:
                finished.append(request.request_id)
        if finished and self.draft is not None and self._draft_ready is None:
            self.draft.release.remote(finished)

    def _collect_draft_result(self, timeout_s: float) -> None:
        import ray

        if self._draft_inflight is None:
            return
        done, _ = ray.wait([self._draft_inflight], timeout=timeout_s)
        if not done:
            return
        reference, self._draft_inflight = self._draft_inflight, None
        try:
            self.stats.draft_bytes += ray.get(reference)["bytes"]
        except ray.exceptions.RayError as error:
            self._draft_failed(error)

    def release(self, request_ids: list[str]) -> None:
        """Free requests that ended without finishing (errors, cancellation)."""
        if request_ids:
            self.leader.release.remote(request_ids)
            if self.draft is not None:
                self.draft.release.remote(request_ids)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.leader.stop.remote(), timeout=30)
            ray.get(self._followers, timeout=30)
        except ray.exceptions.RayError:
            pass
        for actor in [*self.target_ranks, *([self.draft] if self.draft else [])]:
            ray.kill(actor)
        remove_placement_group(self._group)

    def placement_report(self) -> dict:
        import ray

        report = {"target": [info["node_id"] for info in self.target_info]}
        if self.draft is not None:
            report["draft"] = ray.get(self.draft.node_id.remote())
        return report
