"""The Ray Serve deployments: ``Ingress``, ``Coordinator``, ``TargetWorker``, ``DraftWorker``.

- ``TargetWorker`` (one replica per target group): its placement group holds the replica
  (bundle 0) and one bundle per TP rank on one target node (STRICT_PACK); it starts the ranks
  there, starts the engine core (the round loop) on rank 0 and registers the group in the
  application's registry.
- ``DraftWorker`` (the autoscaled pool): each replica runs one draft-worker actor on a draft
  node, connected to the engine core of the group the registry assigns, and reports its
  utilisation.
- ``Coordinator`` (one replica per target group): claims a group and follows its engine core's
  load (autoscaling signals), metrics and health.
- ``Ingress``: the OpenAI-compatible HTTP API (Serve's HTTP proxy) and the public gRPC API
  (its own server on ``grpc_port``, with health, reflection, TLS and token auth), over one
  session with every group's engine core (:mod:`specray.serve.groups`).

Every deployment has ``check_health``; shutdown drains (Serve stops routing and waits for the
ongoing requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from ray import serve

from specray.serve.config import AppArgs
from specray.serve.registry import get_registry

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0  # replicas renew their registration this often
POOL_REFRESH_S = 1.0  # a coordinator re-reads its engine core's load this often


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


def _app_name() -> str:
    return serve.get_replica_context().app_name


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class Repair:
    """A replica restarting its own target group: healthy to Serve while that is under way,
    for up to ``timeout_s`` from the first attempt (a model may take minutes to load; three failed
    health checks, 30 s, would have Serve replace the replica mid-repair)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.since: float | None = None  # the first attempt of the repair under way

    def begin(self) -> None:
        if self.since is None:  # a retry keeps the first attempt's clock
            self.since = time.monotonic()

    def end(self) -> None:
        self.since = None

    def under_way(self) -> bool:
        return self.since is not None and time.monotonic() - self.since < self.timeout_s


# ---- target groups ---------------------------------------------------------------------
class TargetWorkerDeployment:
    async def __init__(self, args: dict):
        self.args = AppArgs(**args)
        self.group_id = _replica_id()
        self.registry = get_registry(_app_name())
        self.group_restarts = 0
        self.repair = Repair(self.args.startup_timeout_s)
        self.group = await self._start_group()
        await self._register()
        self._heartbeat = asyncio.create_task(self._renew())

    async def _start_group(self):
        """The TP ranks in this replica's placement group, rank 0 running the engine core."""
        import ray

        from specray.cluster.distributed import (
            START_CALIBRATION_GRID,
            TargetGroup,
            reads_target_features,
            verify_cost_table,
        )
        from specray.models.loading import load_model_info

        pg = ray.util.get_current_placement_group()
        group = await _in_thread(
            lambda: TargetGroup(
                self.args.target,
                self.args.tp_size,
                self.args.placement(),
                group=pg,
                first_bundle=1,
                # A feature-conditioned draft reads the target's hidden states with each verdict.
                keep_features=reads_target_features(self.args.draft),
            )
        )
        try:
            info = await _in_thread(load_model_info, self.args.target)
            config = self.args.coordinator_config()
            if self.args.calibrate and self.args.adaptive_k and self.args.draft is not None:
                grid = list(START_CALIBRATION_GRID)
                measured = await group.leader.calibrate.remote(grid)
                config = replace(config, verify_prior=verify_cost_table(measured))
            if self.args.draft is not None and self.args.resolved_draft_placement == "colocated":
                await group.leader.colocate_draft.remote(
                    self.args.draft, self.args.draft_probs_encoding
                )
            # The round loop runs beside rank 0's forward: front ends open sessions on it.
            self.session_address = await group.leader.start_engine_core.remote(
                config,
                with_drafts=self.args.draft is not None,
                max_positions=info.max_positions,
                model_name=self.args.served_name,
            )
        except BaseException:
            await _in_thread(group.stop)  # its ranks would hold the placement group's bundles
            raise
        return group

    async def _restart_group(self) -> None:
        """A rank died: the group restarts as a unit in this replica's placement group, under
        the same group id (front ends and drafts follow its new address; front ends resume
        the requests it held). Left to Serve, the failing health check would take three
        periods (30 s) before the replica were replaced."""
        self.repair.begin()
        await _in_thread(self.group.stop)
        self.group = await self._start_group()
        self.group_restarts += 1
        await self._register()
        self.repair.end()
        log.warning("target group %s lost a rank and restarted", self.group_id)

    async def _register(self) -> None:
        await self.registry.add_target.remote(
            self.group_id,
            self.group.leader,
            self.group.address,
            self.group.info[0],
            self.session_address,
        )

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            with contextlib.suppress(Exception):  # failing: the next heartbeat tries again
                if await _in_thread(self.group.lost_a_rank):
                    await self._restart_group()
                else:
                    await self._register()

    async def check_health(self) -> None:
        if self.repair.under_way():
            return
        if not await _in_thread(self.group.alive):
            raise RuntimeError(f"target group {self.group_id} lost a rank")

    async def status(self) -> dict:
        return {
            "group_id": self.group_id,
            "address": self.group.address,
            "restarts": self.group_restarts,
        }

    async def __del__(self):
        if hasattr(self, "_heartbeat"):  # __init__ may have failed before it
            self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await self.registry.remove_target.remote(self.group_id)
        if hasattr(self, "group"):
            await _in_thread(self.group.stop)


# ---- the draft pool --------------------------------------------------------------------
class DraftWorkerDeployment:
    async def __init__(self, args: dict):
        from specray.cluster.distributed import start_draft_actor

        self.args = AppArgs(**args)
        self.worker_id = _replica_id()
        self.registry = get_registry(_app_name())
        self.actor = start_draft_actor(
            self.args.target, self.args.draft, self.args.draft_probs_encoding, self.args.placement()
        )
        await self.actor.stats.remote()  # the model is loaded
        self.address: str | None = None
        self._busy = (time.monotonic(), 0.0)  # (when, busy seconds) at the last stats report
        self.utilization = 0.0
        # Wait for the initial target groups: a worker joins the group with the fewest drafts
        # and stays there, so joining while only the first group is up would pile the whole
        # pool onto it. After startup_timeout_s any group will do.
        deadline = time.monotonic() + self.args.startup_timeout_s
        while True:
            summary = await self.registry.summary.remote()
            all_up = len(summary["targets"]) >= self.args.num_target_groups
            if (all_up or time.monotonic() > deadline) and await self._register():
                break
            if time.monotonic() > deadline:
                raise RuntimeError("no target group registered before startup_timeout_s")
            await asyncio.sleep(0.5)
        self._heartbeat = asyncio.create_task(self._renew())

    async def _register(self) -> bool:
        """Join (or stay in) a group's pool; reconnect when the group changed."""
        assignment = await self.registry.add_draft.remote(self.worker_id, None)
        if assignment is None:
            return False
        if assignment["address"] != self.address:
            await self.actor.connect.remote(assignment["address"], self.worker_id)
            self.address = assignment["address"]
        await self.registry.add_draft.remote(self.worker_id, self.actor)
        return True

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._register()
                stats = await self.actor.stats.options(enable_task_events=False).remote()
            except Exception as error:
                log.warning("draft worker heartbeat failed: %s", error)
                continue
            now = time.monotonic()
            then, busy_then = self._busy
            if now > then:
                self.utilization = min(max((stats["busy_s"] - busy_then) / (now - then), 0), 1)
            self._busy = (now, stats["busy_s"])

    def record_autoscaling_stats(self) -> dict[str, float]:
        from specray.cluster.scaling_rules import draft_worker_stats

        return draft_worker_stats(draft_utilization=self.utilization)

    async def check_health(self) -> None:
        # A dead draft actor fails this with its actor error, which Serve reads as this
        # replica's crash: it replaces the replica (and so the actor) at the next check.
        await asyncio.wait_for(
            self.actor.stats.options(enable_task_events=False).remote(), timeout=20
        )

    async def status(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "address": self.address,
            "util": self.utilization,
        }

    async def __del__(self):
        import ray

        if hasattr(self, "_heartbeat"):  # __init__ may have failed before it
            self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await self.registry.remove_draft.remote(self.worker_id)
        if hasattr(self, "actor"):
            ray.kill(self.actor)


# ---- the coordinator: a target group's autoscaling signals and metrics ------------------
class CoordinatorDeployment:
    """Claims one target group and follows its engine core (which runs the round loop beside
    the group's rank 0): its load for the autoscaling policy, its metrics for the registry,
    its health. Requests do not pass through here: the ingress holds a session with every
    group's engine core."""

    async def __init__(self, args: dict, *workers):
        # ``workers``: handles of TargetWorker / DraftWorker, bound so that Serve deploys them
        # with this graph; this replica reaches its group through the registry.
        self.args = AppArgs(**args)
        self.coordinator_id = _replica_id()
        self.registry = get_registry(_app_name())
        self.engine: dict = {}  # the engine core's latest stats (heartbeat)
        self._busy = (time.monotonic(), 0.0)  # (when, target compute seconds) last reported
        deadline = time.monotonic() + self.args.startup_timeout_s
        while (group := await self.registry.claim_target.remote(self.coordinator_id)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("no target group registered before startup_timeout_s")
            await asyncio.sleep(0.5)
        self.group_id, self.leader = group["group_id"], group["leader"]
        self._heartbeat = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        """Keep the group's claim (a restarted group is claimed anew) and follow its engine
        core's load and metrics."""
        last_claim = 0.0
        while True:
            await asyncio.sleep(POOL_REFRESH_S)
            try:
                if time.monotonic() - last_claim > HEARTBEAT_S:
                    group = await self.registry.claim_target.remote(self.coordinator_id)
                    if group is not None:
                        self.group_id, self.leader = group["group_id"], group["leader"]
                    last_claim = time.monotonic()
                self.engine = await self.leader.engine_core_stats.remote()
                await self.registry.put_metrics.remote(
                    self.coordinator_id, self.engine.get("metrics", b"")
                )
            except Exception as error:
                log.warning("engine core refresh failed: %s", error)

    def record_autoscaling_stats(self) -> dict[str, float]:
        from specray.cluster.scaling_rules import coordinator_stats

        if not self.engine:
            return coordinator_stats(
                queue_depth=0.0,
                running=0.0,
                acceptance_rate=0.0,
                speculating_fraction=0.0,
                target_busy_fraction=0.0,
            )
        # The target's busy fraction since the previous report (not since start).
        now, busy = time.monotonic(), self.engine["stats"]["target_compute_s"]
        then, busy_then = self._busy
        self._busy = (now, busy)
        fraction = min(max((busy - busy_then) / (now - then), 0.0), 1.0) if now > then else 0.0
        return coordinator_stats(**self.engine["load"], target_busy_fraction=fraction)

    async def check_health(self) -> None:
        import ray

        try:
            await asyncio.wait_for(self.leader.ping.remote(), timeout=20)
        except ray.exceptions.RayActorError as error:
            # Its group is down (it restarts in place, and the next claim reads its new rank
            # 0): not this replica's crash, which is what Serve reads an actor error as.
            raise RuntimeError(f"target group {self.group_id} is down: {error}") from None

    async def __del__(self):
        if hasattr(self, "_heartbeat"):  # __init__ may have failed before it
            self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await self.registry.release_claim.remote(self.coordinator_id)


# ---- the front door --------------------------------------------------------------------
class IngressDeployment:
    async def __init__(self, args: dict, *deployments):
        # ``deployments``: bound so that Serve deploys them with the ingress; requests reach
        # the target groups' engine cores over sessions (:mod:`specray.serve.groups`).
        from specray.serve.groups import GroupsBackend
        from specray.serve.grpc_api import TLSConfig, start_grpc_server

        self.args = AppArgs(**args)
        self.backend = GroupsBackend(self.args, get_registry(_app_name()))
        await self.backend.start()
        self.grpc_server = None
        if self.args.grpc_port is not None:
            tls = None
            if self.args.tls_cert:
                tls = TLSConfig(self.args.tls_cert, self.args.tls_key, self.args.tls_client_ca)
            self.grpc_server, self.grpc_port = await start_grpc_server(
                self.backend,
                port=self.args.grpc_port,
                tls=tls,
                auth_token=self.args.resolved_auth_token(),
            )

    def __serve_build_asgi_app__(self):
        from specray.serve.openai_api import build_http_app

        return build_http_app(self.backend, auth_token=self.args.resolved_auth_token())

    async def check_health(self) -> None:
        # Only this replica's own parts: a coordinator that is down is reported by /health
        # and the gRPC health service, and restarting the front door would not fix it.
        if self.args.grpc_port is not None and self.grpc_server is None:
            raise RuntimeError("the gRPC server is not running")

    async def __del__(self):
        if getattr(self, "grpc_server", None) is not None:
            await self.grpc_server.stop(grace=5)
        if hasattr(self, "backend"):
            await self.backend.close()
