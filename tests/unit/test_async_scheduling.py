"""Async scheduling: which rounds may be queued before the verdict of the one running, how the
target answers an item for a request the round before ended, and what it gains on the
simulator's virtual clock (docs/design.md, section 4)."""

from __future__ import annotations

import asyncio
import random

import pytest

from specray.core import RequestState
from specray.engine_core.async_scheduling import (
    OpenRound,
    ahead_items,
    next_round_ahead,
    started,
)
from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.policy import AcceptanceEstimator, DraftCost, VerifyCost
from specray.engine_core.request import Request, TargetPhase
from specray.engine_core.streams import RequestStream
from specray.protocol import RequestSpec, VerifyItem, VerifyResult, VerifyRound
from specray.sampling import SamplingParams
from specray.sim import AcceptanceModel, LatencyModel, SimConfig, Workload, run_virtual, simulate
from specray.sim.workers import SimInbox, SimTargetBackend
from specray.target_rounds import TargetRounds

pytestmark = pytest.mark.unit
VOCAB = 64


def _request(name: str, *, max_tokens: int = 8, committed: int = 2, **fields) -> Request:
    state = RequestState.create(
        name, [1, 2, 3], SamplingParams(max_tokens=max_tokens), 0, VOCAB, frozenset()
    )
    state.commit([5] * committed)
    request = Request(
        state=state,
        stream=RequestStream(name),
        arrival_s=0.0,
        deadline_s=None,
        estimator=AcceptanceEstimator(),
        max_k=0,
        target_phase=TargetPhase.DECODING,
        step=committed,
    )
    for field, value in fields.items():
        setattr(request, field, value)
    return request


def test_a_batch_decoding_without_drafts_is_scheduled_ahead():
    running = [_request("a"), _request("b")]
    assert next_round_ahead(running, running, admitting=False, now=0.0) == running
    (item,) = ahead_items(running[:1])
    assert item == VerifyItem("a", 3, 3, expect_draft=False, scheduled_ahead=True)


def test_a_request_ending_by_its_length_in_the_running_round_is_left_out():
    last = _request("last", max_tokens=3, committed=2)  # the running round commits its third
    other = _request("other")
    assert next_round_ahead([last, other], [last, other], admitting=False, now=0.0) == [other]
    assert next_round_ahead([last], [last], admitting=False, now=0.0) == []


def test_requests_gone_from_the_batch_are_left_out():
    gone, kept = _request("gone"), _request("kept")
    assert next_round_ahead([gone, kept], [kept], admitting=False, now=0.0) == [kept]


@pytest.mark.parametrize(
    "change",
    [
        {"target_phase": TargetPhase.PREFILLING},  # the verdict says whether its prompt is in
        {"last_k": 2},  # it drafts: its next block comes from the verdict
        {"cancelled": True},
        {"finish_now": True},  # a front end matched a stop string
        {"deadline_s": 1.0},  # past it at now = 2
    ],
)
def test_a_round_depending_on_the_verdict_waits_for_it(change):
    running = [_request("a"), _request("b", **change)]
    assert next_round_ahead(running, running, admitting=False, now=2.0) == []
    control = [_request("a"), _request("b")]
    assert next_round_ahead(control, control, admitting=False, now=2.0) == control


def test_waiting_or_new_requests_are_not_held_back_a_round():
    running = [_request("a")]
    assert next_round_ahead(running, running, admitting=True, now=0.0) == []
    joined = [*running, _request("new")]  # admitted since the running round was sent
    assert next_round_ahead(running, joined, admitting=False, now=0.0) == []


def test_an_open_round_takes_joiners_until_the_target_starts_it():
    first = VerifyItem("a", 3, 2, False, scheduled_ahead=True)
    joiner = VerifyItem("new", 1, 0, False, spec=_spec("new"))
    open_round = OpenRound(VerifyRound((first,), 5.0))
    assert open_round.join([joiner])
    assert started(open_round) == VerifyRound((first, joiner), 5.0)
    assert not open_round.join([VerifyItem("late", 1, 0, False, spec=_spec("late"))])
    assert open_round.start() == VerifyRound((first, joiner), 5.0)  # nothing joined after
    plain = VerifyRound((first,), 5.0)
    assert started(plain) is plain


def _spec(name: str, committed: int = 0) -> RequestSpec:
    return RequestSpec(name, (1, 2, 3), SamplingParams(max_tokens=8), 0, (5,) * committed)


def test_the_target_sets_aside_items_of_requests_it_already_ended():
    rounds = TargetRounds(lambda spec: len(spec.output_token_ids), lambda committed: committed)
    rounds.open([VerifyItem("held", 1, 0, False, spec=_spec("held"))])
    items = [
        VerifyItem("ended", 5, 4, False, scheduled_ahead=True),
        VerifyItem("held", 2, 0, False, scheduled_ahead=True),
    ]
    live, ended = rounds.live(items)
    assert live == items[1:] and ended == {"ended"}
    answered = VerifyResult("held", (7,))
    assert rounds.ended(items, [answered], ended) == (
        VerifyResult("ended", (), ended=True),
        answered,
    )
    # An item not scheduled ahead for a request held nowhere is still a coordinator bug.
    plain = [VerifyItem("unknown", 1, 0, False)]
    assert rounds.live(plain) == (plain, set())
    with pytest.raises(ValueError, match="no state for request unknown"):
        rounds.open(plain)


def _latency(overhead_s: float) -> LatencyModel:
    """A 20 ms round whatever the batch, a 2 ms round trip, ``overhead_s`` of coordinator."""
    return LatencyModel(
        verify=VerifyCost(fixed_s=0.02, per_request_s=0.0, per_token_s=0.0),
        draft_step=DraftCost(fixed_s=0.005, per_request_s=0.0),
        rtt_s=0.002,
        coordinator_overhead_s=overhead_s,
    )


def _target_only(async_scheduling: bool, overhead_s: float) -> dict:
    (row,) = simulate(
        SimConfig(
            name="async",
            latency=_latency(overhead_s),
            acceptance=AcceptanceModel((0.5,)),
            workload=Workload(concurrency=4, num_requests=8, prompt_tokens=16, max_tokens=24),
            coordinator={"num_speculative_tokens": 0, "async_scheduling": async_scheduling},
        )
    )
    return row


def test_target_only_rounds_hide_the_coordinators_turn_on_the_virtual_clock():
    """A 20 ms round, 2 ms of round trip and 3 ms of coordinator per call: queued ahead, the
    target never waits for them (24 tokens a request, 8 requests, 4 at a time)."""
    fast, slow = _target_only(True, 0.003), _target_only(False, 0.003)
    assert fast["target_busy_fraction"] > 0.95 > slow["target_busy_fraction"]
    assert fast["tokens_per_s"] > 1.15 * slow["tokens_per_s"]
    # Control: with only the round trip between two forwards, there is less to hide.
    free_fast, free_slow = _target_only(True, 0.0), _target_only(False, 0.0)
    assert free_fast["tokens_per_s"] < 1.12 * free_slow["tokens_per_s"]


def _sim_coordinator(*, async_scheduling: bool) -> tuple[SimTargetBackend, Coordinator]:
    """A target-only coordinator over a simulated target (20 ms rounds, 1 ms of turn)."""
    latency = _latency(0.001)
    target = SimTargetBackend(latency, AcceptanceModel((0.5,)), SimInbox(), random.Random(0))
    config = CoordinatorConfig(num_speculative_tokens=0, async_scheduling=async_scheduling)
    return target, Coordinator(target, None, config, vocab_size=VOCAB)


def test_requests_the_queued_round_outlives_end_exactly_with_their_lengths():
    """On the simulator: every request gets exactly its max_tokens, rounds were queued ahead,
    and the target holds nothing at the end."""

    async def main():
        target, coordinator = _sim_coordinator(async_scheduling=True)
        await coordinator.start()
        lengths = [1, 2, 5, 9, 17]
        streams = [
            await coordinator.submit([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=n))
            for n in lengths
        ]
        outputs = [await stream.result() for stream in streams]
        stats = coordinator.stats
        await coordinator.stop()
        return lengths, outputs, stats, await target.held_requests()

    lengths, outputs, stats, held = run_virtual(main())
    assert [len(o.token_ids) for o in outputs] == lengths
    assert stats.rounds_ahead > 0
    assert held == []


def test_a_request_submitted_mid_round_joins_the_round_queued_behind_it():
    """Two requests decode (20 ms rounds, queued ahead); a third submitted 10 ms into a round
    joins the round queued behind it (before the target starts it) and gets its tokens; its
    first token comes one round after its submission, as without async scheduling."""

    async def main(async_scheduling: bool):
        loop = asyncio.get_running_loop()
        _, coordinator = _sim_coordinator(async_scheduling=async_scheduling)
        await coordinator.start()
        params = SamplingParams(temperature=0.0, max_tokens=12)
        first = [await coordinator.submit([5, 6, 7], params) for _ in range(2)]
        await asyncio.sleep(0.1)  # a few rounds in: rounds are being queued ahead
        await asyncio.sleep(0.01 - loop.time() % 0.023)  # (somewhere inside a round)
        late = await coordinator.submit([7, 6, 5], params)
        output = await late.result()
        for stream in first:
            await stream.result()
        stats = coordinator.stats
        await coordinator.stop()
        return output, stats

    output, stats = run_virtual(main(True))
    assert len(output.token_ids) == 12
    assert stats.joined_ahead == 1 and stats.rounds_ahead > 0
    sync_output, sync_stats = run_virtual(main(False))
    assert sync_stats.joined_ahead == 0 and sync_stats.rounds_ahead == 0
    assert output.time_to_first_token_s <= sync_output.time_to_first_token_s + 1e-9
