"""Simulated target group and draft workers for the coordinator, on virtual time.

They implement :class:`specray.engine_core.backends.TargetBackend` / ``DraftBackend`` with the same
items and reply fields as the real workers (:mod:`specray.actors`), but instead of running
models they spend virtual time from a :class:`~specray.sim.model.LatencyModel` and draw the
number of accepted drafts from an :class:`~specray.sim.model.AcceptanceModel`. Every committed
token is token id 1 (the simulated coordinator has no stop tokens), so a request ends exactly
when it reaches its ``max_tokens``.

Timing, as in the real system:
* a coordinator -> worker call reaches the worker ``rtt_s / 2 + coordinator_overhead_s`` after
  it is made and its reply takes ``rtt_s / 2`` back;
* each worker runs its calls one at a time, in arrival order (the target's verify and release
  calls share one queue, as the engine core's round thread does; calls made at the same
  instant, as a round and the one scheduled ahead behind it, run in the order made);
* a draft block reaches the target's :class:`SimInbox` ``rtt_s / 2`` after the draft worker
  finished drafting its call's blocks; the verdict reaches the draft ``rtt_s / 2`` after the
  verification;
* the target waits for the expected blocks until ``draft_deadline_s`` (``wait_s``), then spends
  ``verify.seconds(batch, 1 + longest block)`` (``compute_s``, plus any prefill).

Draft-ahead: after sending its blocks the draft worker keeps drafting, one step for all open
requests at a time, while no other call is waiting for it and, per request, the verdict has not
arrived and fewer than k + 1 tokens are ahead. A fully accepted block whose bonus token matches
the draft's own guess (probability ``bonus_match``, drawn by the target) makes the tokens
drafted after the guess valid: the next call reuses them (``reused_tokens``) and drafts only the
rest. Any other verdict, once it arrives, is folded in: the worker drafts the next block (up to
k tokens) from the history it committed, and the next call reuses those (with nothing left to
draft, the worker idles until the verdict comes). Any call, ``release`` too, ends a draft-ahead
at its next step, as on the real worker.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

from specray.engine_core.async_scheduling import OpenRound, started
from specray.protocol import (
    DraftItem,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    RequestSpec,
    RoundReport,
    VerifyResult,
    VerifyRound,
)
from specray.sim.model import AcceptanceModel, LatencyModel
from specray.target_rounds import TargetRounds, prefill_span

SIM_TOKEN_ID = 1  # every committed token; never a stop token in the simulation
VERDICT_WAIT_S = 2.0  # as the real draft worker's


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


@dataclass
class _Block:
    num_tokens: int
    num_committed: int  # committed tokens the block was drafted from
    arrive_s: float  # when it reaches the target


@dataclass
class _Verdict:
    step: int
    arrive_s: float  # when it reaches the draft worker
    ahead_valid: bool  # all drafts accepted and the bonus token was the draft's own guess
    finished: bool = False  # the request ended in this round: nothing more to draft


class SimInbox:
    """The target's block inbox, keyed by (request_id, step), and the verdicts sent back."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, int], _Block] = {}
        self._verified_step: dict[str, int] = {}  # blocks for older steps are dropped on arrival
        self._verdicts: dict[str, _Verdict] = {}
        self._waiters: list[asyncio.Future] = []
        self._verdict_waiters: list[asyncio.Future] = []

    def deposit(self, request_id: str, step: int, block: _Block) -> None:
        if step <= self._verified_step.get(request_id, 0):
            return  # the target went without it
        self._blocks[(request_id, step)] = block
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def take(self, keys: list[tuple[str, int]], deadline_s: float) -> dict:
        """The blocks for ``keys`` that reach the target by ``deadline_s``; waits for them."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if all(key in self._blocks for key in keys):
                last = max(self._blocks[key].arrive_s for key in keys)
                await _sleep(min(last, deadline_s) - now)
                break
            if now >= deadline_s:
                break
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, deadline_s - now)
            except TimeoutError:
                break
        now = loop.time()
        taken = {}
        for key in keys:
            block = self._blocks.get(key)
            if block is not None and block.arrive_s <= now:
                taken[key] = self._blocks.pop(key)
        for request_id, step in keys:
            self._verified_step[request_id] = max(self._verified_step.get(request_id, 0), step)
            self._blocks.pop((request_id, step), None)  # late: dropped
        return taken

    def post_verdict(self, request_id: str, verdict: _Verdict) -> None:
        self._verdicts[request_id] = verdict
        for waiter in self._verdict_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._verdict_waiters.clear()

    def watch_verdicts(self, waiter: asyncio.Future) -> None:
        """Resolve ``waiter`` when the next verdict is posted."""
        self._verdict_waiters.append(waiter)

    def verdict(self, request_id: str) -> _Verdict | None:
        return self._verdicts.get(request_id)

    def forget(self, request_id: str) -> None:
        self._verified_step.pop(request_id, None)
        self._verdicts.pop(request_id, None)
        for key in [key for key in self._blocks if key[0] == request_id]:
            del self._blocks[key]

    def __len__(self) -> int:
        """Entries held (blocks, steps, verdicts): 0 once every request was released."""
        return len(self._blocks) + len(self._verified_step) + len(self._verdicts)


class _InOrder:
    """One call at a time, in the order the calls were made: a call takes its ticket before its
    first await, and its turn comes when every earlier ticket's call is done (two calls made at
    the same virtual instant would otherwise wake from their network delay in either order)."""

    def __init__(self) -> None:
        self._issued = 0
        self._serving = 0
        self._waiting: dict[int, asyncio.Future] = {}

    def ticket(self) -> int:
        self._issued += 1
        return self._issued - 1

    async def wait_turn(self, ticket: int) -> None:
        if ticket != self._serving:
            self._waiting[ticket] = asyncio.get_running_loop().create_future()
            await self._waiting[ticket]

    def done(self) -> None:
        self._serving += 1
        turn = self._waiting.pop(self._serving, None)
        if turn is not None and not turn.done():
            turn.set_result(None)


@dataclass
class _TargetRequest:
    committed: int
    max_tokens: int
    context: int  # tokens cached before decoding: prompt and committed output, less one
    trace: tuple[int, ...] | None = None  # replayed acceptance (AcceptanceModel.traces)
    prefilled: int = 0  # of context (chunked prefill)


class SimTargetBackend:
    """One simulated target group (TargetBackend)."""

    def __init__(
        self,
        latency: LatencyModel,
        acceptance: AcceptanceModel,
        inbox: SimInbox,
        rng: random.Random,
    ):
        self.latency, self.acceptance, self.inbox, self.rng = latency, acceptance, inbox, rng
        self.rounds = TargetRounds(self._new_request, lambda state: state.committed)
        self._trace_index: dict[str, int] = {}  # request id -> workload index
        self._queue = _InOrder()  # calls run one at a time, in the order made
        self.calls = 0

    def assign_trace(self, request_id: str, index: int) -> None:
        """Request ``request_id`` is the workload's request ``index``: with traces, it
        replays ``acceptance.trace(index)``."""
        self._trace_index[request_id] = index

    async def verify(self, round_: VerifyRound | OpenRound) -> RoundReport:
        latency = self.latency
        ticket = self._queue.ticket()
        await _sleep(latency.rtt_s / 2 + latency.coordinator_overhead_s)
        await self._queue.wait_turn(ticket)
        try:
            reply = await self._verify(started(round_))
        finally:
            self._queue.done()
        await _sleep(latency.rtt_s / 2)
        return reply

    def _new_request(self, spec: RequestSpec) -> _TargetRequest:
        committed = len(spec.output_token_ids)
        index = self._trace_index.pop(spec.request_id, None)
        return _TargetRequest(
            committed,
            spec.params.max_tokens,
            len(spec.prompt_token_ids) + committed - 1,
            None if index is None else self.acceptance.trace(index),
        )

    async def _verify(self, round_: VerifyRound) -> RoundReport:
        self.calls += 1
        entered = _now()
        items, ended = self.rounds.live(round_.items)
        states, _ = self.rounds.open(items)
        prefill_tokens = 0
        prefilling = set()
        for item, state in zip(items, states, strict=True):  # as the real target's prefill
            end, short = prefill_span(state.prefilled, state.context, item.prefill_until)
            prefill_tokens += max(end - state.prefilled, 0)
            state.prefilled = max(end, state.prefilled)
            if short:
                prefilling.add(item.request_id)
        prefill_s = prefill_tokens * self.latency.prefill_per_token_s
        await _sleep(prefill_s)
        keys = self.rounds.expected(items, prefilling)
        waited = _now()
        arrived = await self.inbox.take(keys, waited + round_.draft_deadline_s) if keys else {}
        wait_s = _now() - waited
        blocks, dropped = self.rounds.sort(keys, arrived)
        widest = 1 + max((block.num_tokens for block in blocks.values()), default=0)
        verifying = len(items) - len(prefilling)
        if verifying:
            await _sleep(self.latency.verify.seconds(verifying, widest))
        verdict_s = _now() + self.latency.rtt_s / 2
        results = []
        for item, state in zip(items, states, strict=True):
            request_id = item.request_id
            if request_id in prefilling:
                results.append(VerifyResult.chunk(request_id))
                continue
            num_draft = blocks[request_id].num_tokens if request_id in blocks else 0
            if state.trace is not None:  # replayed: the draft's run from here, its bonus guess
                run = state.trace[state.committed] if state.committed < len(state.trace) else 0
                accepted, ahead_valid = min(run, num_draft), bool(num_draft) and run > num_draft
            else:
                accepted = self.acceptance.sample_accepted(self.rng, num_draft)
                ahead_valid = bool(num_draft) and accepted == num_draft
                ahead_valid = ahead_valid and self.rng.random() < self.acceptance.bonus_match
            count = min(accepted + 1, state.max_tokens - state.committed)
            state.committed += count
            finished = state.committed >= state.max_tokens
            if (request_id, item.step) in arrived:  # the draft streamed it: it gets a verdict
                verdict = _Verdict(item.step, verdict_s, ahead_valid and not finished, finished)
                self.inbox.post_verdict(request_id, verdict)
            finish_reason = "length" if finished else None
            tokens = [SIM_TOKEN_ID] * count
            results.append(
                self.rounds.result(item, tokens, num_draft, accepted, finish_reason, dropped)
            )
            if finished:
                self._forget(request_id)
        service_s = _now() - entered
        return RoundReport(
            self.rounds.ended(round_.items, results, ended),
            wait_s=wait_s,
            compute_s=service_s - wait_s,
            prefill_s=prefill_s,  # as the real target: part of compute_s, not of a round
            service_s=service_s,
            num_tokens=prefill_tokens + sum(r.num_draft_tokens + 1 for r in results if r.token_ids),
        )

    def _forget(self, request_id: str) -> None:
        self.rounds.forget(request_id)

    async def release(self, request_ids: list[str]) -> None:
        ticket = self._queue.ticket()
        await _sleep(self.latency.rtt_s / 2 + self.latency.coordinator_overhead_s)
        await self._queue.wait_turn(ticket)
        for request_id in request_ids:
            self._forget(request_id)
        self._queue.done()
        await _sleep(self.latency.rtt_s / 2)

    async def ping(self) -> None:
        """A control call: never queues behind verification."""
        await _sleep(self.latency.rtt_s + self.latency.coordinator_overhead_s)

    async def held_requests(self) -> list[str]:
        return sorted(self.rounds.requests)


@dataclass
class _DraftRequest:
    committed: int
    last_step: int | None = None  # step of the last block drafted
    ahead: int = 0  # tokens drafted past the last block (the first is the bonus guess)
    folded_step: int | None = None  # the step whose verdict it drafts the next block from
    next_block: int = 0  # tokens drafted from that verdict's committed history


class _SimDraftWorker:
    def __init__(self, latency: LatencyModel, inbox: SimInbox):
        self.latency, self.inbox = latency, inbox
        self.requests: dict[str, _DraftRequest] = {}
        self._lock = asyncio.Lock()  # one call at a time, FIFO
        self._calls_waiting = 0  # proposes queued behind the running call: draft-ahead yields
        self._wakers: list[asyncio.Future] = []  # a draft-ahead waiting for a verdict
        self._idle_s = 0.0  # of the current propose: waiting for verdicts, not drafting

    async def propose(self, call: ProposeCall) -> ProposeReport:
        latency = self.latency
        await _sleep(latency.rtt_s / 2 + latency.coordinator_overhead_s)
        self._arrive()
        async with self._lock:
            self._calls_waiting -= 1
            reply = await self._propose(call.items, call.draft_ahead)
        await _sleep(latency.rtt_s / 2)
        return reply

    async def prefill(self, items: Sequence[DraftItem]) -> PrefillReport:
        """Take on new requests (their state; prefill time for their committed tokens)."""
        latency = self.latency
        await _sleep(latency.rtt_s / 2 + latency.coordinator_overhead_s)
        self._arrive()
        async with self._lock:
            self._calls_waiting -= 1
            started = _now()
            await self._sync(items)
            draft_s = _now() - started
        await _sleep(latency.rtt_s / 2)
        return PrefillReport(len(items), draft_s)

    def _arrive(self) -> None:
        """A call queues for the worker: a draft-ahead yields, and stops waiting for verdicts."""
        self._calls_waiting += 1
        for waker in self._wakers:
            if not waker.done():
                waker.set_result(None)
        self._wakers.clear()

    async def _await_verdict(self, items: Sequence[DraftItem], deadline_s: float) -> bool:
        """Idle until a verdict due for these blocks arrives (True), or a call comes, none is
        due or the deadline passes (False): as the real worker, which drafts from it."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await self._wait_for_verdict(items, deadline_s)
        finally:
            self._idle_s += loop.time() - started

    async def _wait_for_verdict(self, items: Sequence[DraftItem], deadline_s: float) -> bool:
        loop = asyncio.get_running_loop()
        while not self._calls_waiting:
            now = loop.time()
            posted, unposted = [], False
            for item in items:
                verdict = self.inbox.verdict(item.request_id)
                if verdict is None or verdict.step < item.step:
                    unposted = True
                elif verdict.arrive_s > now:
                    posted.append(verdict.arrive_s)
            if not (posted or unposted) or now >= deadline_s:
                return False
            if posted:
                await _sleep(min(posted) - now)
                return True
            waker = loop.create_future()
            self._wakers.append(waker)
            self.inbox.watch_verdicts(waker)
            try:
                await asyncio.wait_for(waker, deadline_s - now)
            except TimeoutError:
                return False
        return False

    async def _sync(self, items: Sequence[DraftItem]) -> list[_DraftRequest]:
        """The requests' states, created on first sight (after a prefill's time)."""
        prefill_tokens = 0
        states = []
        for item in items:
            state = self.requests.get(item.request_id)
            if state is None:
                if item.spec is None:
                    raise ValueError(f"draft worker has no state for request {item.request_id}")
                state = self.requests[item.request_id] = _DraftRequest(committed=0)
                prefill_tokens += len(item.spec.prompt_token_ids) + len(item.new_token_ids)
            state.committed += len(item.new_token_ids)
            if state.committed != item.num_committed:
                raise ValueError(
                    f"request {item.request_id}: the draft has {state.committed} committed "
                    f"tokens, the coordinator says {item.num_committed}"
                )
            states.append(state)
        await _sleep(prefill_tokens * self.latency.draft_prefill_per_token_s)
        return states

    async def _propose(self, items: Sequence[DraftItem], draft_ahead: bool) -> ProposeReport:
        latency = self.latency
        started = _now()
        states = await self._sync(items)
        reused = [self._reusable(s, item) for s, item in zip(states, items, strict=True)]
        needs = [item.k - r for item, r in zip(items, reused, strict=True)]
        steps = max(needs, default=0)
        for step in range(1, steps + 1):
            batch = sum(need >= step for need in needs)
            await _sleep(latency.draft_step.seconds(batch))
        arrive_s = _now() + latency.rtt_s / 2
        for item, state in zip(items, states, strict=True):
            block = _Block(item.k, item.num_committed, arrive_s)
            self.inbox.deposit(item.request_id, item.step, block)
            state.last_step = item.step
        ahead, self._idle_s = 0, 0.0
        if draft_ahead:
            ahead, ahead_steps = await self._draft_ahead(items, states)
            steps += ahead_steps
        return ProposeReport(
            num_requests=len(items),
            bytes=latency.bytes_per_token * sum(item.k for item in items),
            draft_s=_now() - started - self._idle_s,  # drafting only, as the real worker
            steps=steps,
            reused_tokens=sum(reused),
            ahead_tokens=ahead,
        )

    def _reusable(self, state: _DraftRequest, item: DraftItem) -> int:
        """Tokens drafted ahead that the committed tokens confirmed; the rest are dropped.
        Leaves ``state.ahead`` at the valid tokens past this call's block."""
        verdict = self.inbox.verdict(item.request_id)
        valid = 0
        if (
            state.last_step is not None
            and item.step == state.last_step + 1
            and verdict is not None
            and verdict.step == state.last_step
            and verdict.ahead_valid
        ):
            valid = max(state.ahead - 1, 0)  # the first token ahead was the bonus guess
        elif (
            state.last_step is not None
            and item.step == state.last_step + 1
            and state.folded_step == state.last_step
        ):
            valid = state.next_block  # drafted from the verdict's committed tokens
        reused = min(valid, item.k)
        state.ahead = valid - reused
        state.folded_step, state.next_block = None, 0
        return reused

    async def _draft_ahead(self, items: Sequence[DraftItem], states: list[_DraftRequest]):
        drafted = steps = 0
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + VERDICT_WAIT_S
        while not self._calls_waiting:
            now = loop.time()
            open_ = []
            for item, state in zip(items, states, strict=True):
                verdict = self.inbox.verdict(item.request_id)
                heard = verdict is not None and verdict.step >= item.step
                if heard and verdict.arrive_s <= now:
                    # As the real worker: a verdict that did not confirm the drafts ahead is
                    # folded in and the next block drafted from what it committed.
                    if verdict.step != item.step or verdict.ahead_valid or verdict.finished:
                        continue
                    if state.folded_step != item.step:
                        state.folded_step, state.next_block, state.ahead = item.step, 0, 0
                    if state.next_block < item.k:
                        open_.append(state)
                elif state.ahead < item.k + 1 and item.ahead:
                    open_.append(state)
            if not open_:
                if await self._await_verdict(items, deadline_s):
                    continue
                break
            await _sleep(self.latency.draft_step.seconds(len(open_)))
            for state in open_:
                if state.folded_step is not None:
                    state.next_block += 1
                else:
                    state.ahead += 1
            drafted += len(open_)
            steps += 1
        return drafted, steps

    async def release(self, request_ids: list[str]) -> None:
        latency = self.latency
        await _sleep(latency.rtt_s / 2 + latency.coordinator_overhead_s)
        self._arrive()
        async with self._lock:
            self._calls_waiting -= 1
            for request_id in request_ids:
                self.requests.pop(request_id, None)
                self.inbox.forget(request_id)
        await _sleep(latency.rtt_s / 2)


class SimDraftBackend:
    """A pool of simulated draft workers (DraftBackend)."""

    def __init__(self, num_workers: int, latency: LatencyModel, inbox: SimInbox):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self.num_workers = num_workers
        self._workers = [_SimDraftWorker(latency, inbox) for _ in range(num_workers)]

    def available(self, worker: int) -> bool:
        return True

    async def prefill(self, worker: int, items: Sequence[DraftItem]) -> PrefillReport:
        return await self._workers[worker].prefill(items)

    async def propose(self, worker: int, call: ProposeCall) -> ProposeReport:
        return await self._workers[worker].propose(call)

    async def release(self, worker: int, request_ids: list[str]) -> None:
        await self._workers[worker].release(request_ids)

    async def replace(self, worker: int) -> None:
        return None

    async def held_requests(self, worker: int) -> list[str]:
        return sorted(self._workers[worker].requests)
