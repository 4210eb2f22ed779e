"""An idle micro-batch holding its next round for the submissions of a closed loop of clients
(``admission.arrival_hold_s``, ``engine_core/idle.py``): the rule, and the coordinator on
simulated workers in virtual time, with clients whose next requests arrive a front end's
turnaround apart."""

from __future__ import annotations

import asyncio
import random

import pytest

from specray.engine_core.admission import arrival_hold_s
from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.policy import DraftCost, VerifyCost
from specray.sampling import SamplingParams
from specray.sim import AcceptanceModel, LatencyModel, run_virtual
from specray.sim.workers import SimInbox, SimTargetBackend

LATENCY = LatencyModel(
    verify=VerifyCost(0.02, 0.0005, 0.0002),
    draft_step=DraftCost(0.002, 0.0001),
    rtt_s=0.0,
    coordinator_overhead_s=0.0,
)
CLIENTS, REQUESTS_PER_CLIENT, MAX_TOKENS = 16, 3, 8
TURNAROUND_S = 0.0001  # client n sends its next request n x this after its last one ended


def test_the_rule():
    assert arrival_hold_s(16, 1, 0.04, 0.005) == 0.005  # the cap
    assert arrival_hold_s(16, 1, 0.003, 0.005) == 0.003  # one round's time
    assert arrival_hold_s(16, 16, 0.04, 0.005) == 0.0  # all here
    assert arrival_hold_s(1, 0, 0.04, 0.005) == 0.0  # a lone client never waits
    assert arrival_hold_s(0, 0, 0.04, 0.005) == 0.0  # (woken by an abort)
    assert arrival_hold_s(16, 1, 0.04, 0.0) == 0.0  # off


def test_a_bad_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="arrival_hold_s"):
        CoordinatorConfig(arrival_hold_s=-0.001)


def _closed_loop(hold_s: float) -> tuple[int, list[list[int]]]:
    """Rounds run and every request's tokens, for clients in a closed loop, target-only."""

    async def main():
        target = SimTargetBackend(LATENCY, AcceptanceModel((0.5,)), SimInbox(), random.Random(0))
        config = CoordinatorConfig(
            num_micro_batches=1,
            num_speculative_tokens=0,
            arrival_hold_s=hold_s,
            max_queue=CLIENTS,
            verify_prior=LATENCY.verify,
        )
        coordinator = Coordinator(target, None, config, vocab_size=64)
        await coordinator.start()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        tokens = []

        async def client(number: int) -> None:
            for index in range(REQUESTS_PER_CLIENT):
                prompt = [number % 60 + 1, index + 1, 3]
                stream = await coordinator.submit(prompt, params, request_id=f"c{number}-{index}")
                tokens.append((number, index, (await stream.result()).token_ids))
                await asyncio.sleep(TURNAROUND_S * number)

        await asyncio.gather(*(client(number) for number in range(CLIENTS)))
        rounds = coordinator.stats.rounds
        await coordinator.stop()
        return rounds, [list(ids) for _, _, ids in sorted(tokens)]

    return run_virtual(main())


def test_each_wave_of_a_closed_loop_enters_one_round():
    """With the hold, each of the 3 waves runs its 16 requests in MAX_TOKENS rounds together
    (the first also commits one token); without it, the first arrival of a wave starts a round
    alone, and the rest follow one round later: more rounds, the same tokens."""
    held_rounds, held_tokens = _closed_loop(0.005)
    rounds, tokens = _closed_loop(0.0)
    assert held_rounds == REQUESTS_PER_CLIENT * MAX_TOKENS
    assert rounds > held_rounds
    assert held_tokens == tokens
