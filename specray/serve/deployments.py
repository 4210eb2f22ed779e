"""The Ray Serve deployments: ``Ingress``, ``Coordinator``, ``TargetWorker``, ``DraftWorker``.

- ``TargetWorker`` (one replica per target group): its placement group holds the replica
  (bundle 0) and one bundle per TP rank on one target node (STRICT_PACK); it starts the ranks
  there and registers rank 0 in the application's registry.
- ``DraftWorker`` (the autoscaled pool): each replica runs one draft-worker actor on a draft
  node, connected to the target group the registry assigns, and reports its utilisation.
- ``Coordinator`` (one replica per target group): claims a group, reads its draft pool from
  the registry, and runs :class:`specray.cluster.Coordinator` on the replica's event loop
  behind :class:`specray.serve.service.CoordinatorService`.
- ``Ingress``: the OpenAI-compatible HTTP API (Serve's HTTP proxy) and the public gRPC API
  (its own server on ``grpc_port``, with health, reflection, TLS and token auth).

Every deployment has ``check_health``; shutdown drains (Serve stops routing, waits for the
ongoing requests, then ``__del__`` stops the coordinator with ``drain=True``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from ray import serve

from specray.distributed import prefill_remote, propose_remote
from specray.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    SpecrayError,
    UnavailableError,
    error_from_dict,
    error_to_dict,
)
from specray.protocol import DraftItem, PrefillReport, ProposeCall, ProposeReport
from specray.serve.config import AppArgs
from specray.serve.protocol import GenerateRequest
from specray.serve.registry import get_registry

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0  # replicas renew their registration this often
POOL_REFRESH_S = 1.0  # a coordinator re-reads its draft pool this often


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


def _app_name() -> str:
    return serve.get_replica_context().app_name


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# ---- target groups ---------------------------------------------------------------------
class TargetWorkerDeployment:
    async def __init__(self, args: dict):
        import ray

        from specray.distributed import TargetGroup, reads_target_features

        self.args = AppArgs(**args)
        self.group_id = _replica_id()
        self.registry = get_registry(_app_name())
        pg = ray.util.get_current_placement_group()
        self.group = await _in_thread(
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
        await self._register()
        self._heartbeat = asyncio.create_task(self._renew())

    async def _register(self) -> None:
        await self.registry.add_target.remote(
            self.group_id, self.group.leader, self.group.address, self.group.info[0]
        )

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            with contextlib.suppress(Exception):
                await self._register()

    async def check_health(self) -> None:
        if not await _in_thread(self.group.alive):
            raise RuntimeError(f"target group {self.group_id} lost a rank")

    async def status(self) -> dict:
        return {"group_id": self.group_id, "address": self.group.address}

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
        from specray.distributed import start_draft_actor

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
            await self.actor.connect.remote(assignment["address"])
            self.address = assignment["address"]
        await self.registry.add_draft.remote(self.worker_id, self.actor)
        return True

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._register()
                stats = await self.actor.stats.remote()
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
        await asyncio.wait_for(self.actor.stats.remote(), timeout=20)

    async def status(self) -> dict:
        return {"worker_id": self.worker_id, "address": self.address, "util": self.utilization}

    async def __del__(self):
        import ray

        self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await self.registry.remove_draft.remote(self.worker_id)
        ray.kill(self.actor)


class PoolDraftBackend:
    """A :class:`specray.cluster.backends.DraftBackend` over a pool that changes while serving:
    workers keep their index; one that left the pool is unavailable (its requests move)."""

    def __init__(self):
        self._index: dict[str, int] = {}
        self._handles: list = []
        self._live: set[int] = set()

    @property
    def num_workers(self) -> int:
        return len(self._handles)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def update(self, workers: dict) -> None:
        live = set()
        for worker_id, handle in workers.items():
            if worker_id not in self._index:
                self._index[worker_id] = len(self._handles)
                self._handles.append(handle)
            live.add(self._index[worker_id])
        self._live = live

    def available(self, worker: int) -> bool:
        return worker in self._live

    async def prefill(self, worker: int, items: Sequence[DraftItem]) -> PrefillReport:
        return await prefill_remote(self._handles[worker], items)

    async def propose(self, worker: int, call: ProposeCall) -> ProposeReport:
        return await propose_remote(self._handles[worker], call)

    async def release(self, worker: int, request_ids: list[str]) -> None:
        await self._handles[worker].release.remote(request_ids)

    async def replace(self, worker: int) -> None:
        # Serve restarts a dead replica (a new worker id joins); a live one is re-listed by
        # the next refresh and takes its requests anew.
        self._live.discard(worker)

    async def held_requests(self, worker: int) -> list[str]:
        return await self._handles[worker].held_requests.remote()


# ---- the coordinator -------------------------------------------------------------------
class CoordinatorDeployment:
    async def __init__(self, args: dict, *workers):
        # ``workers``: handles of TargetWorker / DraftWorker, bound so that Serve deploys them
        # with this graph; the coordinator reaches their actors through the registry.
        from specray.cluster.coordinator import Coordinator
        from specray.distributed import RayTargetBackend
        from specray.models.loading import load_model_info
        from specray.serve.service import CoordinatorService

        self.args = AppArgs(**args)
        self.coordinator_id = _replica_id()
        self.registry = get_registry(_app_name())
        info = await _in_thread(load_model_info, self.args.target)
        deadline = time.monotonic() + self.args.startup_timeout_s
        while (group := await self.registry.claim_target.remote(self.coordinator_id)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("no target group registered before startup_timeout_s")
            await asyncio.sleep(0.5)
        self.group_id = group["group_id"]
        self.drafts = PoolDraftBackend() if self.args.draft else None
        if self.drafts is not None:
            self.drafts.update(await self.registry.drafts_of.remote(self.group_id))
        await self._release_orphans(group["leader"])
        self.coordinator = Coordinator(
            RayTargetBackend(group["leader"]),
            self.drafts,
            self.args.coordinator_config(),
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            max_positions=info.max_positions,
            tokenizer=info.tokenizer,
            model_name=self.args.served_name,
            request_id_prefix=f"{self.coordinator_id}-",
        )
        await self.coordinator.start()
        self.service = CoordinatorService(
            self.coordinator,
            tokenizer=info.tokenizer,
            model_name=self.args.served_name,
            draft_name=self.args.draft,
            max_model_len=info.max_positions,
        )
        self._busy = (time.monotonic(), 0.0)  # (when, target compute seconds) last reported
        self._heartbeat = asyncio.create_task(self._renew())

    async def _release_orphans(self, leader) -> None:
        """Free what a previous coordinator of this group left on its workers: it died with
        requests in flight (their callers resume here), nothing else would release them, and
        this coordinator holds none yet."""
        handles = [leader, *(await self.registry.drafts_of.remote(self.group_id)).values()]
        for handle in handles:
            try:
                held = await asyncio.wait_for(handle.held_requests.remote(), timeout=20)
                if held:
                    log.warning("releasing %d requests a previous coordinator left", len(held))
                    await handle.release.remote(held)
            except Exception as error:  # a dead worker holds nothing anyone can free
                log.warning("could not check a worker for orphaned requests: %s", error)

    async def _renew(self) -> None:
        """Keep the group's claim and follow its draft pool as the autoscaler changes it."""
        last_claim = 0.0
        while True:
            await asyncio.sleep(POOL_REFRESH_S)
            try:
                if self.drafts is not None:
                    self.drafts.update(await self.registry.drafts_of.remote(self.group_id))
                if time.monotonic() - last_claim > HEARTBEAT_S:
                    await self.registry.claim_target.remote(self.coordinator_id)
                    await self.registry.put_metrics.remote(
                        self.coordinator_id, self.coordinator.metrics.render()
                    )
                    last_claim = time.monotonic()
            except Exception as error:
                log.warning("registry refresh failed: %s", error)

    async def generate(self, request: dict):
        """Events of one request; errors travel as ``{"kind": "error"}`` events (plain values
        rather than exceptions across Ray)."""
        try:
            try:
                generate_request = GenerateRequest.from_dict(request)
            except SpecrayError:
                raise  # invalid input, named by GenerateRequest's own checks
            except (TypeError, ValueError) as error:  # a malformed request record
                raise InvalidRequestError(str(error)) from None
            async for event in self.service.generate(generate_request):
                yield event
        except SpecrayError as error:
            yield {"kind": "error", "error": error_to_dict(error)}
        # Anything else is a bug: it reaches the ingress as Ray's error, logged there and
        # answered as a generic internal error (its message never reaches a client).

    async def abort(self, request_id: str) -> bool:
        return await self.service.abort(request_id)

    async def model_info(self) -> dict:
        return await self.service.model_info()

    async def metrics_text(self) -> bytes:
        return await self.service.metrics_text()

    async def healthy(self) -> bool:
        return await self.service.health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        from specray.cluster.scaling_rules import coordinator_stats

        # The target's busy fraction since the previous report (not since start).
        now, busy = time.monotonic(), self.coordinator.stats.target_compute_s
        then, busy_then = self._busy
        self._busy = (now, busy)
        fraction = min(max((busy - busy_then) / (now - then), 0.0), 1.0) if now > then else 0.0
        return coordinator_stats(**self.coordinator.load_signals(), target_busy_fraction=fraction)

    async def check_health(self) -> None:
        if not self.coordinator.healthy:
            raise RuntimeError("the coordinator's round loops stopped")
        await asyncio.wait_for(self.coordinator.target.ping(), timeout=20)

    async def __del__(self):
        self._heartbeat.cancel()
        await self.coordinator.stop(drain=True)
        with contextlib.suppress(Exception):
            await self.registry.release_claim.remote(self.coordinator_id)


# ---- the front door --------------------------------------------------------------------
RESUME_WINDOW_S = 120.0  # how long a failed request keeps trying to resume (no progress)
RESUME_BACKOFF_S = 0.25  # first wait before resuming; doubles, capped at 5 s


class _Resumable(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _replica_failures() -> tuple[type[BaseException], ...]:
    """What a dead or unreachable coordinator replica raises through a Serve handle."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (RayActorError, ActorDiedError, ActorUnavailableError)


class ServeBackend:
    """A :class:`specray.serve.protocol.GenerationBackend` over the Coordinator deployment."""

    def __init__(self, coordinator, registry=None):
        self.handle = coordinator
        self.registry = registry  # several coordinators: their metrics, merged
        self._info: dict | None = None
        self._live: dict[str, object] = {}  # request id -> its response stream (for Abort)
        self.resumes = 0  # requests resumed after a coordinator or target failure

    async def generate(self, request: GenerateRequest):
        """The request's events; if its coordinator or target group fails midway, it resumes
        on a (restarted) coordinator from the tokens already delivered, for up to
        ``RESUME_WINDOW_S`` — the caller sees one uninterrupted stream."""
        loop = asyncio.get_running_loop()
        deadline = None if request.timeout_s is None else loop.time() + request.timeout_s
        emitted: list[int] = []  # token ids the caller has
        delivered = 0  # characters of text the caller has
        failed_since = None
        attempt = request
        while True:
            stream = self.handle.options(stream=True).generate.remote(attempt.to_dict())
            if request.request_id is not None:
                self._live[request.request_id] = stream
            finished, offset = False, 0  # offset: where this stream's text starts
            try:
                async for event in stream:
                    kind = event["kind"]
                    if kind == "resumed":
                        offset = event["text_offset"]
                        continue
                    if kind == "error":
                        error = error_from_dict(event["error"])
                        if isinstance(error, UnavailableError):  # draining, target failed
                            raise _Resumable(error)
                        finished = True
                        raise error
                    if kind == "delta":
                        emitted += event["token_ids"]
                        start = offset
                        offset += len(event["text"])
                        if start < delivered:  # after a resume: part of it was delivered
                            event = {**event, "text": event["text"][delivered - start :]}
                        delivered = max(delivered, offset)
                    elif kind == "final":
                        finished = True
                    yield event
                    failed_since = None  # progress: a later failure gets a full window
                    if finished:
                        return
                raise _Resumable(UnavailableError("the coordinator's stream ended early"))
            except (_Resumable, *_replica_failures()) as failure:
                cause = failure.error if isinstance(failure, _Resumable) else failure
                now = loop.time()
                failed_since = failed_since or now
                if now - failed_since > RESUME_WINDOW_S:
                    raise UnavailableError(
                        f"the request failed and could not resume within {RESUME_WINDOW_S:.0f} s: "
                        f"{cause}"
                    ) from None
                if deadline is not None and now >= deadline:
                    raise DeadlineExceededError("the deadline passed while resuming") from None
                self.resumes += 1
                log.warning("resuming a request after %d tokens: %s", len(emitted), cause)
                await asyncio.sleep(min(RESUME_BACKOFF_S * 2 ** min(self.resumes, 4), 5.0))
                timeout = None if deadline is None else max(deadline - loop.time(), 0.001)
                attempt = replace(request, resume_token_ids=tuple(emitted), timeout_s=timeout)
            finally:
                if request.request_id is not None:
                    self._live.pop(request.request_id, None)
                if not finished:
                    stream.cancel()  # the coordinator's generator ends and aborts the request

    async def abort(self, request_id: str) -> bool:
        stream = self._live.get(request_id)
        if stream is not None:
            stream.cancel()
            return True
        return await self.handle.abort.remote(request_id)

    async def model_info(self) -> dict:
        if self._info is None:
            self._info = await self.handle.model_info.remote()
        return self._info

    async def health(self) -> bool:
        try:
            return await asyncio.wait_for(self.handle.healthy.remote(), timeout=5)
        except Exception:
            return False

    async def metrics_text(self) -> bytes:
        """One coordinator: its registry, live. Several: each one's latest exposition (at
        most a heartbeat old), merged with a ``replica`` label. Then this ingress's own."""
        text = None
        if self.registry is not None:
            snapshots = await self.registry.all_metrics.remote()
            if len(snapshots) > 1:
                from specray.cluster.metrics import merge_expositions

                text = merge_expositions(snapshots)
        if text is None:
            text = await self.handle.metrics_text.remote()
        return text + self._own_metrics()

    def _own_metrics(self) -> bytes:
        name = "specray:ingress_request_resumes_total"
        return (
            f"# HELP {name} Requests resumed after their coordinator or target group failed.\n"
            f"# TYPE {name} counter\n{name} {self.resumes}\n"
        ).encode()


class IngressDeployment:
    async def __init__(self, args: dict, coordinator):
        from specray.serve.grpc_api import TLSConfig, start_grpc_server

        self.args = AppArgs(**args)
        self.backend = ServeBackend(coordinator, get_registry(_app_name()))
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
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=5)
