"""The coordinator: admission, continuous batching, block length and pipelining for one target
group. It holds every request's committed tokens (the source of truth) and streams them out.

Pipelining. Running requests are split into ``num_micro_batches`` micro-batches, each driven by
its own round loop: ask the draft workers for blocks (they stream them to the target over gRPC)
and, at the same time, ask the target to verify (it waits for the blocks, then verifies).
Worker calls execute in order, one at a time, so with two micro-batches the draft drafts one
while the target verifies the other. With one micro-batch the draft would idle during
verification; ``draft_ahead`` lets it keep drafting past its block (assuming every token and
its own guess of the bonus token are accepted). Drafts made ahead are kept only when the
committed tokens agree with what they assumed, so they are exactly the drafts a fresh call
would make (keyed randomness): every path stays exact.

Block length. Per micro-batch and round, one K for all its requests, chosen from their measured
acceptance and the group's measured costs (:mod:`specray.engine_core.block_length`); K = 0 runs
the batch target-only, and it is probed again after ``probe_every_rounds`` rounds.

This module holds the round loops: what a round sends, commits and ends. Beside it: the config
(:mod:`~specray.engine_core.coordinator_config`), admission checks and micro-batch membership
(:mod:`~specray.engine_core.admission`), the draft workers' bookkeeping
(:mod:`~specray.engine_core.draft_pool`), a request's lifecycle on the workers
(:mod:`~specray.engine_core.request`) and what is recorded from the replies
(:mod:`~specray.engine_core.recording`).

The same code runs on real workers (:mod:`specray.cluster.ray_backends`) and on simulated ones
(:mod:`specray.sim`, a discrete-event clock): all timing uses the event loop's clock.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Sequence

from specray.core import RequestState
from specray.engine_core import admission
from specray.engine_core.async_scheduling import (
    IssuedRound,
    join_ahead,
    next_round_ahead,
    schedule_ahead,
)
from specray.engine_core.backends import DraftBackend, TargetBackend
from specray.engine_core.block_length import (
    Measurements,
    choose_ks,
    split_pays,
)
from specray.engine_core.coordinator_config import (
    DEFAULT_DRAFT_PRIOR,
    DEFAULT_VERIFY_PRIOR,
    CoordinatorConfig,
)
from specray.engine_core.costs import Costs, probe_rtt
from specray.engine_core.draft_pool import DraftPool
from specray.engine_core.idle import hold_for_arrivals, wait_for_work
from specray.engine_core.metrics import CoordinatorMetrics
from specray.engine_core.policy import AcceptanceEstimator, new_request_estimator
from specray.engine_core.recording import (
    CoordinatorStats,
    record_draft_failure,
    record_draft_prefill,
    record_emission,
    record_end,
    record_proposal,
    record_round,
    record_verdict,
)
from specray.engine_core.request import DraftPhase, Request, TargetPhase
from specray.engine_core.streams import RequestStream
from specray.errors import OverloadedError, RequestCancelledError, SpecrayError, UnavailableError
from specray.outputs import RequestOutput
from specray.protocol import VerifyItem, VerifyResult, VerifyRound
from specray.sampling import SamplingParams
from specray.sampling.rng import random_seed

__all__ = [  # the config, its priors and the stats are defined beside; import them from here
    "DEFAULT_DRAFT_PRIOR",
    "DEFAULT_VERIFY_PRIOR",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorStats",
]

log = logging.getLogger(__name__)
GROUP_ACCEPTANCE_DECAY = 0.99  # the group's running acceptance: new requests start from it
STOP_GRACE_S = 5.0  # how long stop() waits for releases still under way before cancelling


class Coordinator:
    """Admission, continuous batching, adaptive k and pipelining over one target group.

    Use from asyncio: ``await start()``, ``stream = await submit(prompt_token_ids, params)``,
    ``async for delta in stream``, ``abort(request_id)``, ``await stop()``.
    """

    def __init__(
        self,
        target: TargetBackend,
        drafts: DraftBackend | None,
        config: CoordinatorConfig,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        max_positions: int | None = None,
        tokenizer=None,
        model_name: str = "default",
        request_id_prefix: str = "req-",
    ):
        self._prefix = request_id_prefix
        self.target, self.drafts, self.config = target, drafts, config
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.max_positions, self.tokenizer = max_positions, tokenizer
        self.metrics = CoordinatorMetrics(model_name)
        self.costs = Costs(config.verify_prior, config.draft_prior, config.rtt_prior_s)
        self.stats = CoordinatorStats()
        self._ids = itertools.count()
        self._group_acceptance = AcceptanceEstimator(decay=GROUP_ACCEPTANCE_DECAY)
        self._waiting: list[Request] = []
        self._batches: list[list[Request]] = [[] for _ in range(config.num_micro_batches)]
        self._requests: dict[str, Request] = {}
        # One event per round loop, each cleared only by its own loop before it looks for
        # work: a shared one cleared by one loop could swallow a submit another loop needed.
        self._wakeups: list[asyncio.Event] = []
        self._tasks: list[asyncio.Task] = []
        # What the draft calls report is recorded in this coordinator's stats and metrics of
        # the moment (reset_stats replaces the stats).
        self._pool = None if drafts is None else DraftPool(
            drafts,
            config,
            self._requests,
            on_prefill=lambda report, requests: record_draft_prefill(self.stats, report, requests),
            on_proposal=lambda reply: record_proposal(
                self.stats, self.metrics, self.costs, reply, draft_prior=config.draft_prior
            ),
            on_failure=lambda: record_draft_failure(self.stats, self.metrics),
        )  # fmt: skip
        self._speculating = [False] * config.num_micro_batches  # last round, per micro-batch
        self._round_s = [0.0] * len(self._batches)  # its last round's time
        self._ended_last = [0] * len(self._batches)  # requests its last round ended (idle.py)
        # per micro-batch: its next round, queued at the target before the verdict of the one
        # running (async scheduling), or None
        self._ahead: list[IssuedRound | None] = [None] * config.num_micro_batches
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeups = [asyncio.Event() for _ in range(self.config.num_micro_batches)]
        self.stats.started_s = self._loop.time()
        self._tasks = [
            asyncio.create_task(self._run_micro_batch(index), name=f"micro-batch-{index}")
            for index in range(self.config.num_micro_batches)
        ]
        self._rtt_probe = asyncio.create_task(
            probe_rtt(self.target, self.costs, self.metrics, lambda: self.num_running > 0),
            name="rtt-probe",
        )

    async def stop(self, *, drain: bool = True) -> None:
        """Stop taking requests; finish the running ones (``drain``) or cancel them."""
        self._draining = True
        if not drain:
            for request in list(self._requests.values()):
                request.cancelled = True
        self._notify()
        await asyncio.gather(*self._tasks)
        self._rtt_probe.cancel()
        if self._pool is not None:
            await self._pool.settle(STOP_GRACE_S)

    def reset_stats(self) -> None:
        self.stats = CoordinatorStats(started_s=self._loop.time())

    @property
    def num_running(self) -> int:
        return sum(len(batch) for batch in self._batches)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- requests ----------------------------------------------------------------------
    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
        num_speculative_tokens: int | None = None,
        fixed_k: bool = False,
        committed_token_ids: Sequence[int] = (),
    ) -> RequestStream:
        """Admit a request or fail at once: invalid input, queue full, or draining.

        ``num_speculative_tokens`` caps this request's k below the group's (0: speculation off
        for it; None: the group's largest k); ``fixed_k`` (speculation "on"): it drafts that k
        every round, whatever the policy would choose. ``committed_token_ids``: output tokens
        already committed (a request resumed after a failure): they count toward
        ``max_tokens``, are not streamed again, and generation continues after them — exact,
        since each token is drawn from the target conditioned on all before it."""
        params = params or SamplingParams()
        if self._draining:
            raise UnavailableError("the coordinator is draining; retry on another replica")
        committed, max_k = admission.check_submission(
            prompt_token_ids,
            params,
            request_id,
            timeout_s,
            num_speculative_tokens,
            committed_token_ids,
            vocab_size=self.vocab_size,
            max_positions=self.max_positions,
            in_flight=self._requests,
            eos_token_ids=self.eos_token_ids,
            group_max_k=self.config.num_speculative_tokens,
        )
        if admission.queue_full(len(self._waiting), self.num_running, self.config):
            self.metrics.labels(self.metrics.request_rejected).inc()
            raise OverloadedError(
                f"admission queue is full ({self.config.max_queue} waiting); retry later"
            )
        request_id = request_id or f"{self._prefix}{next(self._ids)}"
        seed = params.seed if params.seed is not None else random_seed()
        state = RequestState.create(
            request_id,
            list(prompt_token_ids),
            params,
            seed,
            self.vocab_size,
            self.eos_token_ids,
        )
        state.commit(committed)  # a resumed request: what it had already committed
        now = self._loop.time()
        request = Request(
            state=state,
            stream=RequestStream(request_id),
            arrival_s=now,
            deadline_s=now + timeout_s if timeout_s is not None else None,
            estimator=new_request_estimator(self._group_acceptance),
            max_k=max_k,
            fixed_k=max_k > 0
            and (fixed_k or (self.config.reproducible_seeds and params.seed is not None)),
        )
        self._requests[request_id] = request
        if state.finish_reason is not None:  # resumed after its last token: only the end left
            self._end(request, None)
            return request.stream
        self._waiting.append(request)
        self.metrics.labels(self.metrics.prompt_tokens).inc(len(prompt_token_ids))
        self._join_ahead()
        self._update_gauges()
        self._notify()
        return request.stream

    @property
    def healthy(self) -> bool:
        """Taking requests, and every round loop alive."""
        return not self._draining and all(not task.done() for task in self._tasks)

    def load_signals(self) -> dict[str, float]:
        """What autoscaling reads: queue depth, running requests, the group's acceptance and
        the share of running requests that speculated in their latest round."""
        running = [r for batch in self._batches for r in batch]
        speculating = sum(r.last_k > 0 for r in running)
        return {
            "queue_depth": float(len(self._waiting)),
            "running": float(len(running)),
            "acceptance_rate": float(self._group_acceptance.acceptance(1)[0]),
            "speculating_fraction": speculating / len(running) if running else 0.0,
        }

    def output_so_far(self, request_id: str) -> RequestOutput | None:
        """What a request in flight has committed (None once it ended): a front end that
        ends a request early (a stop string) reports this."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return request.output(self.tokenizer, self._loop.time())

    def finish(self, request_id: str) -> bool:
        """End a request now as finished (``stop``): its front end matched a stop string. It
        ends at its next block boundary with what it committed by then, and its output."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.finish_now = True
        if request in self._waiting:
            self._waiting.remove(request)
            request.state.finish_reason = "stop"
            self._end(request, None)
        self._notify()
        return True

    def draft_worker_lost(self, worker: int, error: BaseException) -> None:
        """A draft worker's stream closed (the engine core's pool says so at once): its
        requests go target-only and its process is replaced."""
        self._pool.lost(worker, error)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its worker state is freed at its next round boundary."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.cancelled = True
        if request in self._waiting:
            self._waiting.remove(request)
            self._end(request, RequestCancelledError(f"request {request_id} was cancelled"))
        self._notify()
        return True

    # ---- the round loops ---------------------------------------------------------------
    async def _run_micro_batch(self, index: int) -> None:
        batch = self._batches[index]
        while True:
            self._wakeups[index].clear()  # before looking: a later submit sets it again
            try:
                self._expire_waiting()
                self._admit(index)
                if self._ahead[index] is None:  # (its requests are in a queued round)
                    self._merge_unless_split_pays(index)
                await self._reap(batch)
            except Exception:  # never let the loop die: its requests would wait forever
                log.exception("admission or release failed")
            if not batch and self._ahead[index] is None:
                if self._draining and not self._waiting:
                    return
                if self._pool is not None:
                    await self._pool.release_stale()  # idle: nothing else would free them
                await wait_for_work(self._wakeups[index], self._waiting)
                last = (self._ended_last[index], self._round_s[index])
                self._ended_last[index] = 0
                await hold_for_arrivals(self._wakeups[index], self._waiting, *last, self.config)
                continue
            try:
                await self._round(index)
            except Exception as error:  # a target failure: fail the batch, stay up
                log.exception("round failed")
                ahead, self._ahead[index] = self._ahead[index], None
                if ahead is not None:  # it fails too: nothing will await it
                    ahead.reply.add_done_callback(_retrieve)
                for request in list(batch):
                    batch.remove(request)
                    self._end(request, UnavailableError(f"target group failed: {error}"))
            self._update_gauges()

    def _notify(self) -> None:
        for wakeup in self._wakeups:
            wakeup.set()

    def _expire_waiting(self) -> None:
        for request in admission.expired(self._waiting, self._loop.time()):
            self._waiting.remove(request)
            self._end(request, request.deadline_error())

    def _admit(self, index: int) -> list[Request]:
        joined = admission.admit(
            self._waiting,
            self._batches,
            index,
            max_running=self.config.max_running,
            split_pays=self._split_pays,
        )
        for request in joined:
            request.admitted_s = self._loop.time()
            if self._pool is not None:
                self._pool.assign(request)
        return joined

    def _merge_unless_split_pays(self, index: int) -> None:
        total = min(self.num_running + len(self._waiting), self.config.max_running)
        if admission.merge_unless_split_pays(
            self._batches, index, total=total, split_pays=self._split_pays
        ):
            self._wakeups[0].set()

    async def _reap(self, batch: list[Request]) -> None:
        """Remove cancelled, finished-early and expired requests; free them on the workers."""
        now = self._loop.time()
        gone = [r for r in batch if r.leaving(now)]
        if not gone:
            return
        for request in gone:
            batch.remove(request)
        await self._release(gone)
        for request in gone:
            if request.finish_now and not request.cancelled:
                request.state.finish_reason = "stop"
                self._end(request, None)
                continue
            self._end(request, request.removal_error())

    async def _release(self, requests: list[Request]) -> None:
        held = [r for r in requests if r.target_holds]
        if held:
            await self.target.release([r.state.request_id for r in held])
            for request in held:
                request.target_released()
        if self._pool is not None:
            await self._pool.release(requests)

    # ---- block length ------------------------------------------------------------------
    def _measured(self) -> Measurements:
        return Measurements(
            verify=self.costs.verify,
            draft=self.costs.draft,
            rtt_s=self.costs.rtt_s,
            group_acceptance=tuple(
                self._group_acceptance.acceptance(self.config.num_speculative_tokens)
            ),
            pipelined=sum(1 for batch in self._batches if batch) > 1,
        )

    def _split_pays(self, total: int) -> bool:
        return split_pays(total, self._measured(), self.config, has_drafts=self._pool is not None)

    def _cap(self, request: Request) -> int:
        """The largest k this request can take this round (0: it cannot speculate)."""
        cap = min(request.max_k, request.state.remaining - 1)
        # Not before the target holds its whole context (its first round prefills it: k = 0);
        # a fixed-k request is taken on by the draft worker in its first propose call.
        drafter_has_it = request.draft_phase is DraftPhase.READY or request.fixed_k
        decoding = request.target_phase is TargetPhase.DECODING
        if cap <= 0 or self.drafts is None or not decoding or not drafter_has_it:
            return 0
        return cap if self.drafts.available(request.draft_worker) else 0

    def _choose_ks(self, index: int, requests: list[Request]) -> list[int]:
        caps = [self._cap(request) for request in requests]
        max_k = self.config.num_speculative_tokens
        ks, probes, self._speculating[index] = choose_ks(
            caps,
            [r.estimator.acceptance(max_k) for r in requests],
            [r.fixed_k for r in requests],
            [r.probe for r in requests],
            [r.last_drafted_step for r in requests],
            self._speculating[index],
            self._measured(),
            self.config,
            has_drafts=self._pool is not None,
        )
        for request, probe in zip(requests, probes, strict=True):
            request.probe = probe
        return ks

    # ---- a round -----------------------------------------------------------------------
    async def _round(self, index: int) -> None:
        """Complete the micro-batch's round in flight (issued now unless it was scheduled
        ahead), after queueing the next one behind it when that can go before the verdict."""
        started = self._loop.time()
        issued = self._ahead[index] or self._issue(index)
        self._ahead[index] = self._issue_ahead(index, issued)
        reply = await issued.reply
        self._round_s[index] = self._loop.time() - started
        if issued.proposals:
            self._pool.watch(issued.proposals)  # replies arrive in the background
        # Recorded at the loop's next wait, once the next round is on its way: its command
        # waits only for the commits (the policy reads costs refitted every few rounds).
        prior, now = self.config.verify_prior, self._loop.time()
        stats = (self.stats, self.metrics, self.costs, reply)
        self._loop.call_soon(functools.partial(record_round, *stats, verify_prior=prior, now=now))
        batch, finished = self._batches[index], []
        for request, result in zip(issued.requests, reply.results, strict=True):
            if self._requests.get(request.state.request_id) is not request:
                self.stats.rows_ended += result.ended
                continue  # it ended while this round was queued (released, or finished)
            if result.ended:
                raise RuntimeError(f"the target ended {request.state.request_id} early")
            request.take_prompt_logprobs(result)
            if result.prefilling:  # a chunk of its prompt: nothing committed yet
                request.target_cached(issued.grants[request.state.request_id])
                self.stats.prefill_chunks += 1
                continue
            request.target_decoding()
            self._commit(request, result)
            if request.state.finish_reason:
                finished.append(request)
        self._ended_last[index] = len(finished)
        for request in finished:
            batch.remove(request)
            request.target_released()  # the target released it when it finished
        if finished:
            await self._release(finished)
        for request in finished:
            self._end(request, request.failure())

    def _issue(self, index: int) -> IssuedRound:
        """Build the micro-batch's round from its requests now and send it."""
        batch = self._batches[index]
        if self._pool is not None:
            self._pool.start_wanted_prefills(batch, self._measured)
        grants = admission.prefill_grants(batch, self.config.max_prefill_tokens_per_round)
        requests = [
            r
            for r in batch
            if r.target_phase is TargetPhase.DECODING or r.state.request_id in grants
        ]
        ks = self._choose_ks(index, requests)
        target_items, blocks = [], []
        for request, k in zip(requests, ks, strict=True):
            request.step += 1
            request.last_k = k
            if k > 0:
                request.last_drafted_step = request.step
                blocks.append((request, k))
            state = request.state
            until = grants.get(state.request_id)
            if until is not None:
                self.stats.target_prefill_tokens += until - request.target_prefilled
            target_items.append(
                VerifyItem(
                    state.request_id,
                    request.step,
                    len(state.output_token_ids),
                    expect_draft=k > 0,
                    spec=state.to_spec() if request.target_phase is TargetPhase.NEW else None,
                    prefill_until=until,
                )
            )
            request.sent_to_target()
        proposals = self._pool.propose(blocks) if blocks else {}
        # Awaited at once (:meth:`_round`): the round is sent when awaited, and its verdicts
        # wait for the commands of the next turn (one message per draft worker).
        reply = self.target.verify(VerifyRound(tuple(target_items), self.config.draft_deadline_s))
        return IssuedRound(requests, reply, grants, proposals)

    def _issue_ahead(self, index: int, running: IssuedRound) -> IssuedRound | None:
        """The next round, queued behind ``running`` before its verdict, when it does not
        depend on it (:mod:`specray.engine_core.async_scheduling`): in a group without drafts
        (its rounds never wait for blocks), when no other micro-batch runs; None otherwise."""
        if not self.config.async_scheduling:  # (the default: nothing more to look at)
            return None
        drafts = self._pool is not None and self.config.num_speculative_tokens > 0
        if drafts or any(batch for i, batch in enumerate(self._batches) if i != index):
            return None
        admitting = bool(self._waiting) and self.num_running < self.config.max_running
        requests = next_round_ahead(
            running.requests, self._batches[index], admitting=admitting, now=self._loop.time()
        )
        if not requests:
            return None
        self.stats.rounds_ahead += 1
        return schedule_ahead(requests, self.target, self.config.draft_deadline_s)

    def _join_ahead(self) -> None:
        """Admit waiting requests into rounds scheduled ahead and not started (on submit), as
        without async scheduling; not where a chunked-prefill budget or a split into
        micro-batches is decided (the round loops do that at their boundaries)."""
        if not any(self._ahead) or self.config.max_prefill_tokens_per_round:
            return
        if self._split_pays(min(self.num_running + len(self._waiting), self.config.max_running)):
            return
        for index, ahead in enumerate(self._ahead):
            if ahead is None or not self._waiting:
                continue
            joined = self._admit(index)  # (if the round has started: for the batch's next)
            if joined and join_ahead(ahead, joined):
                self.stats.target_prefill_tokens += sum(r.target_context for r in joined)
                self.stats.joined_ahead += len(joined)

    # ---- commit and end ----------------------------------------------------------------
    def _commit(self, request: Request, result: VerifyResult) -> None:
        state = request.state
        record_verdict(self.stats, self.metrics, request, result, self._group_acceptance)
        before = len(state.output_token_ids)
        state.commit(result.token_ids, error=result.error)
        if state.finish_reason != result.finish_reason:
            raise RuntimeError(f"coordinator and target disagree on {state.request_id}'s end")
        new = state.output_token_ids[before:]
        self.stats.committed_tokens += len(new)
        record_emission(self.metrics, request, new, self._loop.time())
        request.stream._push(new, *request.take_logprobs(result, first=before == 0))

    def _end(self, request: Request, error: SpecrayError | None) -> None:
        self._requests.pop(request.state.request_id, None)
        output, reason = None, "abort"
        if error is None:
            output = request.output(self.tokenizer, self._loop.time())
            reason = output.finish_reason
            record_end(self.metrics, request, self._loop.time())
        self.metrics.labels(self.metrics.request_success, finished_reason=reason).inc()
        request.stream._finish(output, error)
        self._update_gauges()
        self._notify()  # a slot is free: a loop asleep with an empty batch may admit now

    def _update_gauges(self) -> None:
        self.metrics.labels(self.metrics.num_requests_running).set(self.num_running)
        self.metrics.labels(self.metrics.num_requests_waiting).set(len(self._waiting))


def _retrieve(future: asyncio.Future) -> None:
    """Mark a dropped round's failure as seen (asyncio logs those never retrieved)."""
    if not future.cancelled():
        future.exception()
