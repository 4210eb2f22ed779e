"""Starting the distributed workers as Ray actors: one target group (TP ranks on one target
node; rank 0 hosts the engine core, :mod:`specray.engine_core.host`) and a pool of draft
workers on draft nodes, each connected to the engine core over its own stream (or one draft
colocated in rank 0's process, linked to the engine core in memory).

Ray places, starts and replaces these processes; it carries no per-round traffic. A draft
worker that dies is replaced by the backend's supervisor while its requests run target-only.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from specray.cluster.placement import PlacementConfig, resolve_draft_placement
from specray.cluster.serve_env import apply_serve_env

if TYPE_CHECKING:
    from specray.engine_core.policy import VerifyCost

log = logging.getLogger(__name__)
LOCAL_NODE_RESOURCES = 8.0  # draft / target units an embedded one-node cluster advertises
DRAFT_WORKER_CONCURRENCY = 4  # a waiting call must be able to arrive to stop a draft-ahead


def connect(
    cluster: str, placement: PlacementConfig, *, env: Mapping[str, str] | None = None
) -> None:
    """``"auto"``: an embedded local Ray of its own (both node types on this machine), even
    when another Ray runs here or ``RAY_ADDRESS`` names one; else the cluster at an address.
    ``env``: variables for the embedded Ray's processes (:mod:`specray.cluster.serve_env`);
    a cluster at an address was started with its own."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cluster == "auto":
        apply_serve_env(env or {})
        ray.init(
            # "local": start one. Without it Ray joins the last cluster `ray start` made on
            # this machine (its pointer outlives the cluster), which takes no resources.
            address="local",
            include_dashboard=False,
            resources={
                placement.draft_resource: LOCAL_NODE_RESOURCES,
                placement.target_resource: LOCAL_NODE_RESOURCES,
            },
            log_to_driver=False,
        )
    else:
        ray.init(address=cluster, log_to_driver=False)


# The forwards the served engine core times at start: few enough to take seconds on a CPU.
START_CALIBRATION_GRID = tuple((batch, tokens) for batch in (1, 4, 16) for tokens in (1, 3, 5))


def verify_cost_table(measured) -> VerifyCost:
    """A target's timed forwards ``[(batch, tokens per request, seconds)]`` as the
    coordinator's verify cost: a table over the tokens in a forward."""
    from specray.engine_core.policy import VerifyCost, tabulate

    return VerifyCost(0.0, 0.0, 0.0, tabulate([(b * n, s) for b, n, s in measured]))


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

        from specray.actors.ray_calls import counted
        from specray.actors.target_worker import TargetWorker

        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
        self._owns_group = group is None
        if group is None:
            group = placement_group(placement.target_bundles(tp_size), "STRICT_PACK")
            ray.get(group.ready(), timeout=120)
        self.group = group
        init_method = f"file:///tmp/specray-tp-{uuid.uuid4().hex}"
        worker = ray.remote(concurrency_groups=TargetWorker.CONCURRENCY_GROUPS)(
            counted(TargetWorker)
        )
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
                device=placement.device,
                batch_invariant=placement.batch_invariant,
            )
            for rank in range(tp_size)
        ]
        self.info = ray.get([rank.info.remote() for rank in self.ranks])
        self._followers = [rank.follow.remote() for rank in self.ranks[1:]]
        self.leader = self.ranks[0]
        self.address = self.info[0]["address"]

    def _a_follower_ended(self) -> bool:
        import ray

        done, _ = ray.wait(self._followers, timeout=0) if self._followers else ([], [])
        return bool(done)

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Rank 0 answers and no follower loop has ended (a dead rank ends the group)."""
        import ray

        if self._a_follower_ended():
            return False
        try:
            ray.get(self.leader.ping.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return False
        return True

    def lost_a_rank(self) -> bool:
        """A rank is certainly gone: a follower's loop ended, or rank 0 is dead (a slow
        answer is not a death: :meth:`alive` times out on those)."""
        import ray

        if self._a_follower_ended():
            return True
        try:
            ray.get(self.leader.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        except (ray.exceptions.RayError, TimeoutError):
            pass
        return False

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
    from specray.actors.ray_calls import counted

    options = placement.draft_options() | {"max_concurrency": DRAFT_WORKER_CONCURRENCY}
    return (
        ray.remote(counted(DraftWorker))
        .options(**options)
        .remote(target, draft, encoding, placement.num_threads, placement.device)
    )


class DistributedBackend:
    """Starts and owns the actors: ``target_ranks`` (rank 0 = ``leader``) and ``drafts``
    (none when the draft is ``colocated`` in the leader's process: ``draft_placement``,
    :func:`~specray.cluster.placement.resolve_draft_placement`)."""

    def __init__(
        self,
        target: str,
        draft: str | None,
        *,
        tp_size: int = 1,
        num_draft_workers: int = 1,
        draft_probs_encoding: str = "fp32",
        placement: PlacementConfig | None = None,
        draft_placement: str = "auto",
    ):
        import ray

        if isinstance(num_draft_workers, bool) or not isinstance(num_draft_workers, int):
            raise ValueError(f"num_draft_workers must be an integer, got {num_draft_workers!r}")
        if num_draft_workers < 1:
            raise ValueError(f"num_draft_workers must be >= 1, got {num_draft_workers}")
        # (a ValueError naming the parameter before any actor starts)
        draft_placement = resolve_draft_placement(
            draft_placement, draft, target, pool_sized=num_draft_workers != 1
        )
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
        self.address = self.target_group.address  # the draft workers' (gRPC)
        self.session_address: str | None = None  # the engine core's, once started
        self.drafts: list = []
        self.draft_restarts = 0
        self._lifelines: dict = {}  # a never-returning call per draft actor -> its index
        self._stopping = threading.Event()
        # A draft inside rank 0's process, beside the engine core (no draft actors to watch).
        self.colocated = draft is not None and draft_placement == "colocated"
        if self.colocated:
            ray.get(self.leader.colocate_draft.remote(draft, draft_probs_encoding))
        elif draft is not None:
            self.drafts = [self._new_draft() for _ in range(num_draft_workers)]
            ray.get([actor.connect.remote(self.address) for actor in self.drafts])
            self._lifelines = {actor.lifeline.remote(): i for i, actor in enumerate(self.drafts)}
            threading.Thread(target=self._supervise, name="draft-supervisor", daemon=True).start()

    def _new_draft(self):
        return start_draft_actor(
            self._target_spec, self._draft_spec, self._encoding, self.placement
        )

    def _supervise(self) -> None:
        """Replace a draft worker whose process died: Ray places the new one, which connects
        to the engine core by itself; meanwhile its requests run target-only."""
        import ray

        while not self._stopping.is_set():
            ready, _ = ray.wait(list(self._lifelines), num_returns=1, timeout=0.5)
            for ref in ready:
                index = self._lifelines.pop(ref)
                if self._stopping.is_set():
                    return
                log.warning("draft worker %d died; starting a replacement", index)
                self.draft_restarts += 1
                actor = self.drafts[index] = self._new_draft()
                actor.connect.remote(self.address)
                self._lifelines[actor.lifeline.remote()] = index

    def start_engine(
        self,
        config,
        *,
        max_positions: int | None = None,
        model_name: str = "default",
        with_drafts: bool = True,
        timeout_s: float = 120.0,
    ) -> str:
        """Start the engine core on rank 0 with ``config`` (a CoordinatorConfig) once every
        draft worker has connected (``with_drafts=False``: target-only, drafts or not);
        returns the address front ends open sessions on."""
        import ray

        with_drafts = with_drafts and (bool(self.drafts) or self.colocated)
        self.session_address = address = ray.get(
            self.leader.start_engine_core.remote(
                config,
                with_drafts=with_drafts,
                max_positions=max_positions,
                model_name=model_name,
            )
        )
        if with_drafts:
            count = 1 if self.colocated else len(self.drafts)
            ray.get(self.leader.wait_for_drafts.remote(count, timeout_s))
        return address

    def engine_stats(self) -> dict:
        """The engine core's totals, message counters and Prometheus text."""
        import ray

        return ray.get(self.leader.engine_core_stats.remote())

    def calibrate(self, batches=(1, 2, 4, 8, 16), tokens=(1, 2, 3, 5, 9)):
        """Measured costs as tables: target forwards over (batch, tokens) and draft steps over
        batch sizes. Returns ``(VerifyCost, DraftCost | None)``: the coordinator's cost model
        (its priors) and the latency model of ``specray simulate``."""
        import ray

        from specray.engine_core.policy import DraftCost, tabulate

        grid = [(batch, count) for batch in batches for count in tokens]
        verify = verify_cost_table(ray.get(self.leader.calibrate.remote(grid)))
        if self.colocated:
            steps = ray.get(self.leader.calibrate_draft.remote(list(batches)))
        elif self.drafts:
            steps = ray.get(self.drafts[0].calibrate.remote(list(batches)))
        else:
            return verify, None
        return verify, DraftCost(0.0, 0.0, tabulate(steps))

    def shutdown(self) -> None:
        import ray

        self._stopping.set()
        self.target_group.stop()
        for actor in self.drafts:
            ray.kill(actor)

    def placement_report(self) -> dict:
        import ray

        report = {"target": [info["node_id"] for info in self.target_info]}
        if self.colocated:
            report["draft"] = report["target"][0]
        elif self.drafts:
            report["draft"] = ray.get(self.drafts[0].node_id.remote())
        return report
