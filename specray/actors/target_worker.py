"""TargetWorker: one Ray actor per tensor-parallel rank of a target group.

All ranks load the target and shard it (``apply_tp``); rank 0 serves the gRPC Verifier that
draft workers stream blocks to, keeps the requests' mirrored state, and runs each round with
the same :class:`specray.core.TargetCore` as the in-process engine. Other ranks follow rank 0's
forwards in lockstep (:mod:`specray.actors.tp_group`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import socket
import time
from typing import ClassVar

import ray
import torch

from specray.actors.ray_calls import mark_round_path_thread
from specray.actors.tp_group import command_group
from specray.core import RequestState, TargetCore, eos_token_ids
from specray.engine_core.coordinator import CoordinatorConfig
from specray.engine_core.draft_streams import PoolCounters, StreamDraftPool
from specray.engine_core.host import EngineCoreHost
from specray.models.device import default_dtype, worker_device
from specray.models.loading import load_model
from specray.models.runner import ModelRunner
from specray.models.tp import init_process_group_cpu
from specray.models.tp_loading import load_model_shard
from specray.protocol import RoundReport, VerifyResult, VerifyRound
from specray.rpc.inbox import BlockInbox
from specray.rpc.messages import features_to_pb
from specray.rpc.server import VerifierServicer, start_server
from specray.sampling.grammar import lazy_grammars
from specray.target_rounds import TargetRounds
from specray.v1 import speculation_pb2 as pb

log = logging.getLogger(__name__)


def node_ip() -> str:
    """This node's address on the cluster network (loopback on a one-machine cluster)."""

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return socket.gethostbyname(socket.gethostname())


class TargetWorker:
    """Calls in the default group (verify_round, release, stop) run one at a time, in the order
    they were sent: rounds of different micro-batches queue here while the draft works.
    Read-only calls and a follower's loop run in the ``control`` group."""

    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {"control": 2}

    def __init__(
        self,
        target: str,
        rank: int,
        world_size: int,
        init_method: str,
        num_threads: int = 1,
        verifier_host: str | None = None,  # where drafts connect; None: this node's address
        keep_features: bool = False,  # a feature-conditioned draft: verdicts carry h rows
        device: str = "auto",  # specray/models/device.py; the GPU is the one Ray gave
        batch_invariant: bool = False,  # specray/models/batch_invariant.py
    ):
        torch.set_num_threads(num_threads)
        self.target = target
        self.colocated_draft = None  # rank 0: a draft run in this process (colocate_draft)
        self.rank, self.world_size = rank, world_size
        self.device = worker_device(device)
        if world_size > 1:
            # On CUDA the all-reduces go over NCCL; per-round commands are CPU tensors (gloo).
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            init_process_group_cpu(rank, world_size, init_method, backend)
            self.commands = command_group()  # every rank, right after joining
            # Only this rank's shard is ever read into memory.
            dtype = default_dtype(self.device)
            loaded = load_model_shard(target, rank, world_size, device=self.device, dtype=dtype)
        else:
            loaded = load_model(target, param="target", device=self.device)
        self.runner = ModelRunner(loaded.model, batch_invariant=batch_invariant)
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(loaded.model, loaded.tokenizer)
        self.address = None
        if rank == 0:
            from specray.actors.tp_group import LeaderRunner

            runner = LeaderRunner(self.runner, self.commands) if world_size > 1 else self.runner
            # Only the leader keeps features: followers run the same forwards, compute no
            # logits and send nothing, so they are unaffected.
            self.core = TargetCore(runner, keep_features=keep_features)
            self.feature_rows_sent = 0
            self.feature_bytes_sent = 0
            grammars = lazy_grammars(loaded.tokenizer, self.vocab_size, self.eos_token_ids)
            self.rounds = TargetRounds(
                lambda spec: RequestState.from_spec(
                    spec, self.vocab_size, self.eos_token_ids, grammars
                ),
                lambda state: len(state.output_token_ids),
            )
            self.inbox = BlockInbox()
            self.pool = StreamDraftPool()
            self.engine_core: EngineCoreHost | None = None
            # Plaintext and unauthenticated (internal ports, the draft workers' and the front
            # ends' sessions): bound to the cluster network address only, never to every
            # interface.
            self._bind_host = verifier_host or node_ip()
            self.verifier = VerifierServicer(self.inbox, self.vocab_size, self.pool)
            self._server, self.address = start_server(self.verifier, host=self._bind_host)

    # ---- the engine core (rank 0) --------------------------------------------------------
    def start_engine_core(
        self,
        config: CoordinatorConfig,
        *,
        with_drafts: bool,
        max_positions: int | None = None,
        model_name: str = "default",
    ) -> str:
        """Run the coordinator here (stopping one already running); returns the address front
        ends open their sessions on."""
        self.stop_engine_core()
        self.pool.counters = PoolCounters()  # counted per engine core, as its stats are
        self.engine_core = EngineCoreHost(
            self,
            config,
            with_drafts=with_drafts,
            max_positions=max_positions,
            model_name=model_name,
            thread_init=mark_round_path_thread,
            session_host=self._bind_host,
        )
        return self.engine_core.address

    def stop_engine_core(self, drain: bool = False) -> None:
        if self.engine_core is not None:
            self.engine_core.stop(drain=drain)
            self.engine_core = None

    def colocate_draft(self, draft: str, draft_probs_encoding: str = "fp32") -> None:
        """Run a draft worker in this process, beside the engine core, linked to it in memory
        (:class:`~specray.actors.draft_link.LocalDraftLink`): no hop per round each way, and a
        feature-conditioned draft reads the target's rows without a network. It drafts on
        this process's device and threads, and lives and dies with the group."""
        from specray.actors.draft_worker import DraftWorker

        if self.colocated_draft is not None:
            raise RuntimeError("a draft is already colocated with this target")
        self.colocated_draft = DraftWorker(
            self.target,
            draft,
            draft_probs_encoding,
            num_threads=torch.get_num_threads(),
            device=str(self.device),
        )
        self.colocated_draft.connect_local(self.verifier)

    @ray.method(concurrency_group="control")
    def draft_stats(self) -> dict:
        """The colocated draft's counters (:meth:`DraftWorker.stats`)."""
        if self.colocated_draft is None:
            raise RuntimeError("no draft is colocated with this target")
        return self.colocated_draft.stats()

    def calibrate_draft(self, batches: list[int]) -> list[tuple[int, float]]:
        """The colocated draft's step times per batch size (:meth:`DraftWorker.calibrate`)."""
        if self.colocated_draft is None:
            raise RuntimeError("no draft is colocated with this target")
        return self.colocated_draft.calibrate(batches)

    @ray.method(concurrency_group="control")
    def wait_for_drafts(self, count: int, timeout_s: float = 120.0) -> int:
        """Block until ``count`` draft workers have connected; returns how many are."""
        self.pool.wait_for_workers(count, timeout_s)
        return self.pool.num_live

    @ray.method(concurrency_group="control")
    def engine_core_metrics(self) -> bytes:
        """The engine core's Prometheus text (empty when none runs)."""
        core = self.engine_core
        return core.coordinator.metrics.render() if core is not None else b""

    @ray.method(concurrency_group="control")
    def reset_engine_stats(self) -> None:
        """Zero the engine core's totals (benchmarks start their clock here)."""
        core = self.engine_core

        async def reset() -> None:
            core.coordinator.reset_stats()

        core.call(reset(), timeout_s=30)

    @ray.method(concurrency_group="control", enable_task_events=False)  # polled: no events
    def engine_core_stats(self) -> dict:
        """The coordinator's totals and the per-round message counters (benchmarks, tests)."""
        core = self.engine_core
        if core is None:
            return {}
        coordinator = core.coordinator

        async def read() -> dict:  # on the loop: its state does not move meanwhile
            return {
                "stats": dict(coordinator.stats.__dict__),
                "costs": copy.deepcopy(coordinator.costs),
                "load": coordinator.load_signals(),
                "pool": dict(self.pool.counters.__dict__),
                "sessions": sum(session.batches_sent for session in core.sessions.sessions),
                "metrics": coordinator.metrics.render(),
                "num_draft_workers": self.pool.num_live,
                "ray_calls": dict(getattr(self, "ray_calls", {})),
            }

        return core.call(read(), timeout_s=30)

    @ray.method(concurrency_group="control")
    def info(self) -> dict:

        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": self.address,
            "vocab_size": self.vocab_size,
            "num_kv_heads": self.runner.model.config.num_key_value_heads // self.world_size,
        }

    # ---- followers (rank > 0) ----------------------------------------------------------
    @ray.method(concurrency_group="control")
    def follow(self) -> int:
        from specray.actors.tp_group import follow

        return follow(self.runner, self.commands)

    # ---- leader (rank 0) ---------------------------------------------------------------
    def verify_round(self, round_: VerifyRound) -> RoundReport:
        """Run one round for the given requests; wait up to the deadline for their blocks.

        A request new here is rebuilt from its spec and prefilled (its output too, after a
        resume), at most up to ``prefill_until`` under chunked prefill: one still short of its
        context is not verified (its result is a chunk). Verdicts go back to the draft workers
        over their streams; the report carries the results and the round's timing.
        """
        entered = time.perf_counter()
        fed_before, shared_before = self.runner.tokens_fed, self.runner.tokens_shared
        items, ended = self.rounds.live(round_.items)
        if not items:  # scheduled ahead for requests the round before ended: nothing to run
            return RoundReport(
                self.rounds.ended(round_.items, [], ended),
                wait_s=0.0,
                compute_s=0.0,
                kv_cache_usage=self.runner.kv_cache_usage,
            )
        states, fresh = self.rounds.open(items)
        self.inbox.open(fresh)
        prefill_started = time.perf_counter()
        # (a request new here goes through prefill even with nothing to cache)
        unready = [
            s for s in states if s.request_id in fresh or s.request_id in self.core.prefilling
        ]
        prefilling = set()  # cached short of their context after this round's prefill
        scored = {s.request_id: len(s.prompt_logprobs) for s in states}  # before this round
        fused = {}  # request -> context tokens the verification forward caches first
        if unready:
            until = {item.request_id: item.prefill_until for item in items}
            fused = self.core.fusable(unready, until)
            rest = [self._replay_view(s) for s in unready if s.request_id not in fused]
            if rest:
                prefilling = self.core.prefill(rest, until)
        keys = self.rounds.expected(items, prefilling)
        waited = time.perf_counter()
        prefill_s = waited - prefill_started
        deadline = time.monotonic() + round_.draft_deadline_s
        arrived = self.inbox.take(keys, deadline) if keys else {}
        wait_s = time.perf_counter() - waited
        checked, dropped = self.rounds.sort(keys, arrived)
        blocks = {rid: (block.token_ids, block.draft_probs) for rid, block in checked.items()}
        forward_before = self.core.forward_s
        ready = [state for state in states if state.request_id not in prefilling]
        logprobs_before = {s.request_id: len(s.logprobs) for s in ready}
        committed = dict(
            zip(
                [state.request_id for state in ready],
                self.core.verify_round(ready, blocks, fused) if ready else [],
                strict=True,
            )
        )
        forward_s = self.core.forward_s - forward_before
        results, finished = [], []
        for item, state in zip(items, states, strict=True):
            start = scored[state.request_id]
            prompt_logprobs = tuple(state.prompt_logprobs[start:])
            if state.request_id in prefilling:  # a chunk of its prompt only: nothing to commit
                results.append(VerifyResult.chunk(state.request_id, prompt_logprobs, start))
                continue
            tokens = committed[state.request_id]
            accepted = max(len(tokens) - 1, 0)  # none when a grammar's dead end kept no token
            block = checked.get(state.request_id)
            reply = self.inbox.reply_to((state.request_id, item.step))
            if reply is not None:
                verdict = pb.Verdict(
                    request_id=state.request_id,
                    step=item.step,
                    num_accepted=accepted,
                    token_ids=tokens,
                )
                if self.core.keep_features and not state.finish_reason:
                    held = block.num_target_features if block is not None else 0
                    self._attach_features(verdict, held)
                reply(verdict)
            num_draft = len(block.token_ids) if block is not None else 0
            result = self.rounds.result(
                item, tokens, num_draft, accepted, state.finish_reason, dropped, state.error
            )
            if state.logprobs or prompt_logprobs:
                result = dataclasses.replace(
                    result,
                    logprobs=tuple(state.logprobs[logprobs_before[state.request_id] :]),
                    prompt_logprobs=prompt_logprobs,
                    prompt_logprobs_from=start,
                )
            results.append(result)
            if state.finish_reason:
                finished.append(state.request_id)
        # One release for the round: one reorder of the cache's rows for every request it
        # ended (models/row_blocks.py), not one per request.
        self.release(finished)
        service_s = time.perf_counter() - entered
        return RoundReport(
            self.rounds.ended(round_.items, results, ended),
            wait_s=wait_s,
            compute_s=service_s - wait_s,
            prefill_s=prefill_s,
            fused_prefill_tokens=sum(len(tokens) for tokens in fused.values()),
            forward_s=forward_s,
            service_s=service_s,
            num_tokens=self.runner.tokens_fed - fed_before,
            shared_tokens=self.runner.tokens_shared - shared_before,
            kv_cache_usage=self.runner.kv_cache_usage,
        )

    def _attach_features(self, verdict: pb.Verdict, held: int) -> None:
        """The rows the draft lacks: after the ``held`` it says it has (stateless here, so a
        restarted draft or target, or a lost verdict, is repaired by the next block)."""
        features = self.core.target_features(verdict.request_id)  # [T - 1, hidden]
        start = min(held, len(features))
        if start < len(features):
            features_to_pb(verdict, features[start:], start)
            self.feature_rows_sent += len(features) - start
            self.feature_bytes_sent += len(verdict.target_features.data)

    @staticmethod
    def _replay_view(state: RequestState) -> RequestState:
        """Prefill view: the prompt plus already committed output (replay after a restart)."""
        if not state.output_token_ids:
            return state
        view = RequestState(**{**state.__dict__})
        view.prompt_token_ids = [*state.prompt_token_ids, *state.output_token_ids]
        return view

    def calibrate(self, grid: list[tuple[int, int]]) -> list[tuple[int, int, float]]:
        """Time target forwards for each (batch, tokens per request): the verify cost model."""
        return [
            (batch, tokens, self.core.runner.time_forward(batch, tokens)) for batch, tokens in grid
        ]

    def release(self, request_ids: list[str]) -> None:
        """Free finished or cancelled requests (KV cache, state, pending blocks)."""
        known = [request_id for request_id in request_ids if request_id in self.rounds.requests]
        if known:
            self.core.release(known)
        for request_id in known:
            self.rounds.forget(request_id)
            self.inbox.forget(request_id)

    @ray.method(concurrency_group="control", enable_task_events=False)  # polled: no events
    def ping(self) -> None:
        """Answers at once (control group): the coordinator times it as the network RTT."""

    @ray.method(concurrency_group="control")
    def held_requests(self) -> list[str]:
        """Requests with state here (KV cache rows and mirrored state): for leak checks."""
        held = set(self.rounds.requests) | {str(seq_id) for seq_id in self.runner.seq_ids}
        return sorted(held)

    @ray.method(concurrency_group="control")
    def inbox_stats(self) -> dict:
        return dict(self.inbox.stats.__dict__) | {
            "held": self.inbox.num_held,
            "feature_rows_sent": self.feature_rows_sent,
            "feature_bytes_sent": self.feature_bytes_sent,
        }

    def stop(self) -> None:
        """Stop the engine core, the followers' loops (rank 0) and the gRPC server."""
        self.stop_engine_core()
        if self.colocated_draft is not None:
            self.colocated_draft.stop()
        if self.world_size > 1:
            self.core.runner.stop()
        self._server.stop(grace=1)
