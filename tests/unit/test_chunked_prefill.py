"""Chunked prefill: the rule (a pure function) and the coordinator on simulated workers
(discrete-event clock): a long prompt joining three decoding requests no longer stalls them
for its whole prefill; with no limit (the negative control) it does."""

import asyncio
import random

import pytest

from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.policy import DraftCost, VerifyCost, prefill_chunks
from specray.sampling import SamplingParams
from specray.sim.clock import run_virtual
from specray.sim.model import AcceptanceModel, LatencyModel
from specray.sim.run import SIM_VOCAB_SIZE
from specray.sim.workers import SimDraftBackend, SimInbox, SimTargetBackend

STEP_S = 0.02  # a decode round
PREFILL_PER_TOKEN_S = 0.001
LONG_PROMPT = 4001  # 4000 tokens to cache before decoding: 4 s of prefill


def test_docstring_example():
    assert prefill_chunks([300, 50, 200], 256) == [256, 0, 0]
    assert prefill_chunks([44, 50, 200], 256) == [44, 50, 162]


def test_no_limit_and_nothing_missing():
    assert prefill_chunks([300, 50, 200], 0) == [300, 50, 200]
    assert prefill_chunks([0, 5], 3) == [0, 3]
    assert prefill_chunks([], 10) == []


@pytest.mark.parametrize(
    ("missing", "budget", "message"),
    [([5], -1, "budget must be >= 0"), ([5, -2], 4, r"missing\[1\] must be >= 0"),
     ([1.5], 4, r"missing\[0\] must be an integer")],
)  # fmt: skip
def test_bad_input_is_named(missing, budget, message):
    with pytest.raises(ValueError, match=message):
        prefill_chunks(missing, budget)


def test_config_validation():
    with pytest.raises(ValueError, match="max_prefill_tokens_per_round must be >= 0, got -1"):
        CoordinatorConfig(max_prefill_tokens_per_round=-1)


def _long_prompt_joins(budget: int, speculative: bool):
    """Three requests decode; 0.5 s later a 4001-token prompt joins their micro-batch."""

    async def main():
        latency = LatencyModel(
            verify=VerifyCost(STEP_S, 0.0, 0.0),
            draft_step=DraftCost(0.001, 0.0),
            rtt_s=0.0002,
            coordinator_overhead_s=0.0,
            prefill_per_token_s=PREFILL_PER_TOKEN_S,
        )
        inbox = SimInbox()
        target = SimTargetBackend(
            latency, AcceptanceModel(per_position=(0.8,) * 4), inbox, random.Random(0)
        )
        drafts = SimDraftBackend(1, latency, inbox) if speculative else None
        config = CoordinatorConfig(
            num_micro_batches=1,
            num_speculative_tokens=4 if speculative else 0,
            max_prefill_tokens_per_round=budget,
            verify_prior=latency.verify,
            draft_prior=latency.draft_step,
        )
        coordinator = Coordinator(target, drafts, config, vocab_size=SIM_VOCAB_SIZE)
        await coordinator.start()
        decoding = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        short = [
            await coordinator.submit([1, 2, 3], decoding, request_id=f"short-{i}") for i in range(3)
        ]
        await asyncio.sleep(0.5)
        joining = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        long = await coordinator.submit([1] * LONG_PROMPT, joining, request_id="long")
        outputs = [await stream.result() for stream in short]
        long_output = await long.result()
        stats = coordinator.stats
        await coordinator.stop()
        assert await target.held_requests() == [] and len(inbox) == 0
        return outputs, long_output, stats

    return run_virtual(main())


@pytest.mark.parametrize("speculative", [False, True], ids=["target-only", "speculative"])
def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding(speculative):
    """Budget 256 tokens a round: no decoding request waits more than one chunk's prefill and
    a round (0.256 + 0.02 s) between tokens, and the long prompt's prefill costs what it did
    whole (4 s, 16 chunks); with no limit they wait the whole 4 s."""
    outputs, long_output, stats = _long_prompt_joins(256, speculative)
    assert [len(o.token_ids) for o in outputs] == [300] * 3 and len(long_output.token_ids) == 5
    worst_gap = max(gap for o in outputs for gap in o.chunk_gaps_s)
    assert worst_gap < 256 * PREFILL_PER_TOKEN_S + 3 * STEP_S, worst_gap
    assert stats.target_prefill_tokens == LONG_PROMPT - 1 + 3 * 2
    assert stats.prefill_chunks == 15  # 4000 tokens, 256 a round: 15 partial rounds, then done
    assert stats.target_prefill_s == pytest.approx(stats.target_prefill_tokens * 0.001)
    # Its first token after 16 chunks' prefill and rounds: about the whole prefill's time.
    assert 4.0 < long_output.time_to_first_token_s < 4.0 + 20 * (STEP_S + 0.005)

    outputs, long_output, _ = _long_prompt_joins(0, speculative)  # negative control
    assert max(gap for o in outputs for gap in o.chunk_gaps_s) > 4.0
    assert long_output.time_to_first_token_s < 4.0 + 2 * (STEP_S + 0.005)
