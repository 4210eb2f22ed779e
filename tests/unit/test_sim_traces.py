"""Acceptance traces: recorded from a real drafter and target, replayed by the simulator."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

import specray.sim
from specray.engine import Engine
from specray.engine_core.coordinator import Coordinator
from specray.sampling import SamplingParams
from specray.sim import (
    AcceptanceModel,
    SimConfigError,
    Workload,
    load_sim_config,
    sim_config_from_dict,
    simulate,
)
from specray.sim.clock import run_virtual
from specray.sim.model import coordinator_config
from specray.sim.run import SIM_VOCAB_SIZE
from specray.sim.traces import acceptance_from_traces, leading_matches, record_traces
from specray.sim.workers import SimDraftBackend, SimInbox, SimTargetBackend
from tests.helpers.tiny_models import perturbed_copy, tiny_llama
from tests.unit.test_sim import _config, _raw_config

VOCAB_SIZE = 8
K = 4
MAX_TOKENS = 40
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 0], [2, 2, 5], [7, 1, 0, 3, 3, 6]]


def test_leading_matches_and_per_position_acceptance():
    assert leading_matches([5, 6, 9], [5, 6, 7, 8]) == 2
    assert leading_matches([], [1]) == 0
    assert leading_matches([1, 2], [1]) == 1
    assert acceptance_from_traces([[2, 1, 0, 0]]) == [0.5, 0.5]
    assert acceptance_from_traces([[0, 0]], max_k=3) == [0.0, 0.0, 0.0]
    # α_2 counts only positions whose first draft was accepted: 2 of the 3 with m >= 1
    assert acceptance_from_traces([[3, 2, 1, 0]], max_k=2) == [0.75, pytest.approx(2 / 3)]


def _replay(trace: list[int], k: int) -> tuple[int, list[int]]:
    """(drafts, accepted per position) of greedy rounds with block length min(k, left - 1)."""
    drafts, per_position, t = 0, [0] * k, 0
    while t < len(trace):
        block = min(k, len(trace) - t - 1)
        accepted = min(trace[t], block)
        if block:
            drafts += 1
            for j in range(accepted):
                per_position[j] += 1
        t += accepted + 1
    return drafts, per_position


def test_a_recorded_trace_predicts_what_the_engine_accepts():
    """Record traces with the engine's own drafter from the engine's greedy outputs, then
    replay the engine's rounds (k = 4, cut near max_tokens): the replay must give exactly the
    engine's draft and per-position acceptance counts. A trace shifted by one position (a
    wrong alignment) must not."""
    target = tiny_llama(VOCAB_SIZE, seed=3, num_hidden_layers=2, hidden_size=32)
    draft = perturbed_copy(target, seed=4, noise=0.3)
    engine = Engine(target=target, draft=draft, num_speculative_tokens=K)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    outputs = engine.generate(PROMPTS, params)
    traces = record_traces(
        engine.drafter,
        PROMPTS,
        [output.token_ids for output in outputs],
        params,
        vocab_size=VOCAB_SIZE,
        max_k=K,
    )
    shifted_matches = 0
    for output, trace in zip(outputs, traces, strict=True):
        assert len(trace) == MAX_TOKENS
        assert all(0 <= m <= min(K, MAX_TOKENS - t) for t, m in enumerate(trace))
        drafts, per_position = _replay(trace, K)
        metrics = output.metrics
        assert (drafts, per_position) == (
            metrics.num_drafts,
            (metrics.accepted_per_position + [0] * K)[:K],
        )
        shifted_matches += _replay([*trace[1:], 0], K) == (drafts, per_position)
    assert sum(sum(t) for t in traces) > 0  # the draft agrees sometimes: a meaningful check
    assert shifted_matches < len(PROMPTS)


def test_traces_need_greedy_and_matching_lengths():
    engine = Engine(target=tiny_llama(VOCAB_SIZE, seed=3), draft="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        record_traces(engine.drafter, [[1]], [[2]], SamplingParams(), vocab_size=8, max_k=2)
    with pytest.raises(ValueError, match="differ in length"):
        record_traces(
            engine.drafter, [[1]], [], SamplingParams(temperature=0), vocab_size=8, max_k=2
        )
    with pytest.raises(ValueError, match="max_k"):
        record_traces(
            engine.drafter, [[1]], [[2]], SamplingParams(temperature=0), vocab_size=8, max_k=0
        )


def test_config_traces_are_validated_by_name():
    data = _raw_config()
    data["acceptance"] = {"traces": [[2, 1, 0, 0]]}
    model = sim_config_from_dict(data).acceptance
    assert model.per_position == (0.5, 0.5) and model.trace(3) == (2, 1, 0, 0)
    for bad, message in (
        ([[2, -1]], r"acceptance.traces\[0\]\[1\]"),
        ([[]], r"acceptance.traces\[0\]"),
        ([], "must not be empty"),
        ("12", "list of lists"),
    ):
        data["acceptance"] = {"traces": bad}
        with pytest.raises(SimConfigError, match=message):
            sim_config_from_dict(data)
    data["acceptance"] = {"traces": [[1]], "per_position": [0.5]}
    with pytest.raises(SimConfigError, match="exactly one"):
        sim_config_from_dict(data)


def _traced(traces, **workload) -> dict:
    acceptance = AcceptanceModel(tuple(acceptance_from_traces(traces) or [0.0]), traces=traces)
    base = dict(concurrency=2, num_requests=4, prompt_tokens=8, max_tokens=24)
    config = _config(acceptance=acceptance, workload=Workload(**(base | workload)))
    (row,) = simulate(config)
    return row


def test_the_simulator_replays_traces_exactly():
    """All-zero traces accept nothing; traces that always match accept every draft (no random
    draws left); and replays are deterministic."""
    never = _traced(((0,) * 24,))
    assert never["acceptance_rate"] == 0.0
    always = _traced(tuple((8,) * 24 for _ in range(3)))
    assert always["acceptance_rate"] == 1.0
    assert always["speedup"] > never["speedup"]
    bursty = tuple((0, 0, 0, 0, 4, 3, 2, 1) * 3 for _ in range(2))
    assert _traced(bursty) == _traced(bursty)


def _on_this_host(traces, concurrency: int, **coordinator) -> dict:
    """The shipped local_cpu.yaml costs (a CPU host like this one), replaying ``traces``."""
    base = load_sim_config(Path(specray.sim.__file__).parent / "configs" / "local_cpu.yaml")
    acceptance = AcceptanceModel(tuple(acceptance_from_traces(traces) or [0.0]), traces=traces)
    workload = Workload(
        concurrency=concurrency, num_requests=len(traces), prompt_tokens=8, max_tokens=64
    )
    config = replace(
        base,
        acceptance=acceptance,
        workload=workload,
        coordinator={**base.coordinator, **coordinator},
        sweep={},
    )
    (row,) = simulate(config)
    return row


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_badly_drafted_request_does_not_hold_speculation_off_for_the_next(concurrency):
    """The first request's draft is useless (a trace of zeros, like the demo's forced first
    prompt), the seven after it are drafted well (runs of 1 to 8 matching tokens). Each later
    request gets its own chance (a probe at once, its own estimate and backoff), so the default
    policy is at least as fast as the best fixed k on the same workload. Before, the group's
    acceptance seeded every new request and the micro-batch's probe backoff carried over: the
    policy stayed off (speedup 0.99 against 1.22 at concurrency 1)."""
    bad = (0,) * 64
    good = (6, 5, 4, 3, 2, 1, 0, 8, 7, 6, 5, 4, 3, 2, 1, 0) * 4
    traces = (bad,) + (good,) * 7
    policy = _on_this_host(traces, concurrency, num_speculative_tokens=4)
    fixed = {
        k: _on_this_host(traces, concurrency, num_speculative_tokens=k, adaptive_k=False)
        for k in range(1, 5)
    }
    best = max(row["speedup"] for row in fixed.values())
    assert policy["speedup"] >= best, (
        policy["speedup"],
        {k: r["speedup"] for k, r in fixed.items()},
    )
    assert policy["acceptance_rate"] > 0.7  # the good requests speculated on their acceptance


def test_speculation_on_drafts_every_round_where_the_policy_would_not():
    """Two requests whose draft is useless (traces of zeros) under this host's costs: the
    policy drafts for one only on probes, while speculation "on" (fixed_k) drafts k every round
    after its first, whatever the acceptance says."""
    base = load_sim_config(Path(specray.sim.__file__).parent / "configs" / "local_cpu.yaml")
    traces = ((0,) * 40, (0,) * 40)
    acceptance = AcceptanceModel((0.0,), traces=traces)

    async def main():
        inbox = SimInbox()
        target = SimTargetBackend(base.latency, acceptance, inbox, random.Random(0))
        drafts = SimDraftBackend(1, base.latency, inbox)
        config = coordinator_config(
            {"verify_prior": base.latency.verify, "draft_prior": base.latency.draft_step}
            | base.coordinator
        )
        coordinator = Coordinator(
            target, drafts, config, vocab_size=SIM_VOCAB_SIZE, eos_token_ids=frozenset()
        )
        await coordinator.start()
        params = SamplingParams(temperature=0.0, max_tokens=40)
        streams = []
        for index, fixed_k in enumerate((False, True)):
            target.assign_trace(f"r{index}", index)
            streams.append(
                await coordinator.submit([1, 2, 3], params, request_id=f"r{index}", fixed_k=fixed_k)
            )
        outputs = [await stream.result() for stream in streams]
        await coordinator.stop()
        return outputs

    auto, on = run_virtual(main())
    k = base.coordinator["num_speculative_tokens"]
    # Every round but its first (the target's prefill) and its last (no room for a draft).
    assert on.metrics.num_drafts == on.metrics.num_target_steps - 2
    assert on.metrics.num_draft_tokens >= k * (on.metrics.num_drafts - k)  # k, but at the end
    assert on.metrics.num_accepted_tokens == 0
    assert auto.metrics.num_drafts <= 4  # probes only
