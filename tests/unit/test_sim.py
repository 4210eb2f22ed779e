"""The discrete-event simulator: virtual clock, config validation, simulated workers, sweeps."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest

from specray.engine_core.coordinator import Coordinator, CoordinatorConfig
from specray.engine_core.policy import DraftCost, VerifyCost
from specray.outputs import SpecDecodeMetrics
from specray.protocol import (
    DraftItem,
    DropReason,
    ProposeCall,
    RequestSpec,
    VerifyItem,
    VerifyRound,
)
from specray.sampling import SamplingParams
from specray.sim import (
    AcceptanceModel,
    LatencyModel,
    SimConfig,
    SimConfigError,
    SimulationDeadlock,
    VirtualTimeLoop,
    Workload,
    acceptance_from_metrics,
    format_table,
    load_sim_config,
    run_virtual,
    sim_config_from_dict,
    simulate,
)
from specray.sim.workers import SimDraftBackend, SimInbox, SimTargetBackend

CONFIGS = Path(__file__).resolve().parents[2] / "specray" / "sim" / "configs"


# ---- the virtual clock ---------------------------------------------------------------------
def test_thousand_hour_sleeps_take_no_real_time():
    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(*(asyncio.sleep(3600) for _ in range(1000)))
        return loop.time() - started

    real = time.perf_counter()
    assert run_virtual(main()) == 3600.0
    assert time.perf_counter() - real < 1.0


def test_timers_fire_in_order_on_virtual_time():
    async def main():
        loop = asyncio.get_running_loop()
        fired = []

        async def sleeper(delay, tag):
            await asyncio.sleep(delay)
            fired.append((tag, loop.time()))

        await asyncio.gather(sleeper(0.3, "c"), sleeper(0.1, "a"), sleeper(0.2, "b"))
        loop.call_later(0.05, fired.append, ("later", loop.time() + 0.05))
        await asyncio.sleep(0.1)
        return fired

    fired = run_virtual(main())
    assert [tag for tag, _ in fired] == ["a", "b", "c", "later"]
    assert [t for _, t in fired[:3]] == pytest.approx([0.1, 0.2, 0.3])


def test_asyncio_primitives_run_on_virtual_time():
    async def main():
        loop = asyncio.get_running_loop()
        event, lock, queue = asyncio.Event(), asyncio.Lock(), asyncio.Queue()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(event.wait(), 5.0)
        assert loop.time() == pytest.approx(5.0)
        loop.call_later(2.0, event.set)
        await event.wait()
        assert loop.time() == pytest.approx(7.0)
        order = []

        async def hold(tag, seconds):
            async with lock:
                order.append((tag, loop.time()))
                await asyncio.sleep(seconds)

        await asyncio.gather(hold("x", 1.0), hold("y", 1.0), hold("z", 1.0))
        assert order == [("x", 7.0), ("y", 8.0), ("z", 9.0)]
        loop.call_later(0.5, queue.put_nowait, "item")
        assert await queue.get() == "item"
        assert loop.time() == pytest.approx(10.5)
        async with asyncio.timeout(1.0):
            await asyncio.sleep(0.25)
        return loop.time()

    assert run_virtual(main()) == pytest.approx(10.75)


def test_deadlock_raises_instead_of_hanging():
    async def stuck():
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="deadlock"):
        run_virtual(stuck())
    with pytest.raises(SimulationDeadlock):
        run_virtual(stuck())


def test_virtual_loop_starts_at_given_time_and_closes():
    loop = VirtualTimeLoop(start_s=100.0)
    try:
        assert loop.run_until_complete(asyncio.sleep(1.5, result="ok")) == "ok"
        assert loop.time() == 101.5
    finally:
        loop.close()


# ---- configs -------------------------------------------------------------------------------
def _latency(**overrides) -> LatencyModel:
    base = {
        "verify": VerifyCost(0.02, 0.0005, 0.0002),
        "draft_step": DraftCost(0.002, 0.0001),
        "rtt_s": 0.0005,
        "coordinator_overhead_s": 0.0005,
    }
    return LatencyModel(**(base | overrides))


def _config(alpha=(0.8,), **overrides) -> SimConfig:
    base = {
        "name": "test",
        "latency": _latency(),
        "acceptance": AcceptanceModel(tuple(alpha)),
        "workload": Workload(concurrency=4, num_requests=8, prompt_tokens=8, max_tokens=24),
        "coordinator": {"num_speculative_tokens": 4},
    }
    return SimConfig(**(base | overrides))


def _write(tmp_path: Path, data: dict, suffix=".yaml") -> Path:
    path = tmp_path / f"config{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    return path


def _raw_config() -> dict:
    return {
        "name": "raw",
        "latency": {
            "verify": {"fixed_s": 0.02, "per_request_s": 0.0005, "per_token_s": 0.0002},
            "draft_step": {"fixed_s": 0.002, "per_request_s": 0.0001},
            "rtt_s": 0.001,
        },
        "acceptance": {"per_position": [0.8, 0.7]},
        "workload": {"concurrency": 2, "num_requests": 4, "max_tokens": 8},
        "coordinator": {"num_micro_batches": 1, "policy": {"probe_every_rounds": 4}},
        "sweep": {"rtt_s": [0.0002, 0.005], "num_speculative_tokens": [2, 4]},
    }


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_load_config_yaml_and_json(tmp_path, suffix):
    config = load_sim_config(_write(tmp_path, _raw_config(), suffix))
    assert config.latency.verify == VerifyCost(0.02, 0.0005, 0.0002)
    assert config.latency.coordinator_overhead_s == 0.0015  # the default
    assert config.acceptance.per_position == (0.8, 0.7)
    assert config.acceptance.bonus_match == 0.7  # defaults to the last α
    assert config.coordinator_config().policy.probe_every_rounds == 4
    assert len(config.points()) == 4
    point = config.at({"rtt_s": 0.005, "num_speculative_tokens": 2})
    assert point.latency.rtt_s == 0.005 and point.sweep == {}
    assert point.coordinator_config().num_speculative_tokens == 2


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ((), "colour"),
        (("latency",), "rtt_ms"),
        (("latency", "verify"), "per_layer_s"),
        (("workload",), "qps"),
        (("coordinator",), "max_k"),
        (("sweep",), "temperature"),
    ],
)
def test_unknown_keys_are_rejected_by_name(tmp_path, path, key):
    data = _raw_config()
    section = data
    for part in path:
        section = section[part]
    section[key] = 1
    with pytest.raises(SimConfigError, match=repr(key)):
        load_sim_config(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["latency"]["verify"].update(fixed_s=-1), "latency.verify.fixed_s"),
        (lambda d: d["latency"].update(rtt_s="fast"), "latency.rtt_s"),
        (lambda d: d["acceptance"].update(per_position=[0.5, 1.5]), r"per_position\[1\]"),
        (lambda d: d["workload"].update(concurrency=0), "workload.concurrency"),
        (lambda d: d["coordinator"].update(num_micro_batches=0), "num_micro_batches"),
        (lambda d: d["sweep"].update(concurrency=[4, -1]), "concurrency"),
        (lambda d: d["sweep"].update(num_draft_workers=[]), "sweep.num_draft_workers"),
        (lambda d: d["latency"].pop("verify"), "verify"),
    ],
)
def test_invalid_values_name_the_parameter(mutate, message):
    data = _raw_config()
    mutate(data)
    with pytest.raises(SimConfigError, match=message):
        sim_config_from_dict(data)


def test_acceptance_from_metrics():
    assert acceptance_from_metrics([80, 60, 30], 100) == pytest.approx([0.8, 0.75, 0.5])
    assert acceptance_from_metrics([80, 0, 0], 100) == [0.8, 0.0]
    assert acceptance_from_metrics([80, 60], 100, 4) == pytest.approx([0.8, 0.75, 0.75, 0.75])
    metrics = SpecDecodeMetrics()
    for accepted in (4, 2, 0, 4):
        metrics.record(4, accepted)
    model = AcceptanceModel.from_metrics(metrics.to_dict())
    assert model.per_position == pytest.approx((0.75, 1.0, 2 / 3, 1.0))
    data = _raw_config()
    data["acceptance"] = {"from_metrics": metrics.to_dict(), "bonus_match": 0.5}
    assert sim_config_from_dict(data).acceptance.bonus_match == 0.5
    with pytest.raises(SimConfigError, match="num_drafts"):
        acceptance_from_metrics([1], 0)


def test_acceptance_model_sampling():
    model = AcceptanceModel((1.0, 0.0))
    rng = random.Random(0)
    assert {model.sample_accepted(rng, 4) for _ in range(20)} == {1}
    assert model.alpha(1) == 1.0 and model.alpha(5) == 0.0  # beyond the list: the last value
    assert AcceptanceModel((0.5,)).expected_accepted(2) == pytest.approx(0.75)


@pytest.mark.parametrize("name", ["h100_tp4_l4.yaml", "local_cpu.yaml"])
def test_shipped_configs_load(name):
    config = load_sim_config(CONFIGS / name)
    assert config.points()


# ---- simulated workers ---------------------------------------------------------------------
def _spec(request_id: str, *, max_tokens: int) -> RequestSpec:
    return RequestSpec(request_id, (1, 2), SamplingParams(max_tokens=max_tokens), seed=0)


def test_target_goes_alone_after_the_draft_deadline():
    latency = _latency(rtt_s=0.0, coordinator_overhead_s=0.0)

    async def main():
        target = SimTargetBackend(latency, AcceptanceModel((0.5,)), SimInbox(), random.Random(0))
        spec = _spec("r", max_tokens=3)
        item = VerifyItem("r", 1, 0, expect_draft=True, spec=spec)
        reply = await target.verify(VerifyRound((item,), draft_deadline_s=0.5))
        assert reply.wait_s == pytest.approx(0.5)
        assert reply.compute_s == pytest.approx(latency.verify.seconds(1, 1))
        (result,) = reply.results
        assert result.dropped.reason is DropReason.DEADLINE
        assert result.token_ids == (1,) and result.num_draft_tokens == 0
        assert result.finish_reason is None
        item = VerifyItem("r", 2, 1, expect_draft=False)
        reply = await target.verify(VerifyRound((item,), draft_deadline_s=0.5))
        assert reply.wait_s == 0.0 and reply.results[0].finish_reason is None
        assert await target.held_requests() == ["r"]
        with pytest.raises(RuntimeError, match="committed"):  # stale num_committed
            await target.verify(VerifyRound((item,), draft_deadline_s=0.5))
        item = VerifyItem("r", 3, 2, expect_draft=False)
        reply = await target.verify(VerifyRound((item,), draft_deadline_s=0.5))
        assert reply.results[0].finish_reason == "length"
        assert await target.held_requests() == []  # released when it finished

    run_virtual(main())


def test_block_and_verdict_flow_with_draft_ahead():
    latency = _latency(rtt_s=0.002, coordinator_overhead_s=0.0)

    async def main():
        loop = asyncio.get_running_loop()
        inbox = SimInbox()
        target = SimTargetBackend(latency, AcceptanceModel((1.0,), 1.0), inbox, random.Random(0))
        drafts = SimDraftBackend(1, latency, inbox)
        spec = _spec("r", max_tokens=50)
        committed = 0
        replies = []
        for step in (1, 2):
            draft_item = DraftItem(
                "r", step, 3, committed, (1,) * committed, spec=spec if step == 1 else None
            )
            item = VerifyItem("r", step, committed, True, spec=spec if step == 1 else None)
            started = loop.time()
            proposal = asyncio.ensure_future(drafts.propose(0, ProposeCall((draft_item,), True)))
            reply = await target.verify(VerifyRound((item,), draft_deadline_s=5.0))
            replies.append((reply, await proposal, loop.time() - started))
            committed += len(reply.results[0].token_ids)
        return replies

    (first, first_draft, _), (second, second_draft, _) = run_virtual(main())
    step_s = latency.draft_step.seconds(1)
    # Both calls arrive together; the target waits for 3 draft steps and the block's trip.
    assert first.wait_s == pytest.approx(3 * step_s + 0.001, rel=1e-6)
    assert first.results[0].num_accepted == 3 and first.results[0].token_ids == (1,) * 4
    assert first_draft.steps == 3 + first_draft.ahead_tokens
    assert first_draft.ahead_tokens >= 2 and first_draft.reused_tokens == 0
    assert first_draft.bytes == 3 * latency.bytes_per_token
    # The bonus matched (bonus_match = 1): the tokens drafted after the guess are reused.
    assert second_draft.reused_tokens == min(first_draft.ahead_tokens - 1, 3)
    assert second.wait_s < first.wait_s


def test_every_request_gets_exactly_max_tokens():
    config = _config(alpha=(0.7,), coordinator={"num_speculative_tokens": 6})

    async def main():
        inbox = SimInbox()
        target = SimTargetBackend(config.latency, config.acceptance, inbox, random.Random(3))
        drafts = SimDraftBackend(2, config.latency, inbox)
        coordinator = Coordinator(
            target,
            drafts,
            CoordinatorConfig(num_speculative_tokens=6),
            vocab_size=64,
            eos_token_ids=frozenset(),
        )
        await coordinator.start()
        lengths = [1, 2, 3, 7, 19]
        streams = [
            await coordinator.submit([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=n))
            for n in lengths
        ]
        outputs = [await stream.result() for stream in streams]
        await coordinator.stop()
        held = await target.held_requests()
        held += [r for w in range(2) for r in await drafts.held_requests(w)]
        return lengths, outputs, held, len(inbox), coordinator.stats.verdicts_by_k

    lengths, outputs, held, inbox_entries, by_k = run_virtual(main())
    assert [len(o.token_ids) for o in outputs] == lengths
    assert all(o.finish_reason == "length" for o in outputs)
    assert held == [] and inbox_entries == 0
    # Every request-round's verdict is counted once, at the block length it verified.
    assert sum(by_k) == sum(o.metrics.num_target_steps for o in outputs)
    assert sum(k * n for k, n in enumerate(by_k)) == sum(
        o.metrics.num_draft_tokens for o in outputs
    )
    assert sum(by_k[1:]) == sum(o.metrics.num_drafts for o in outputs) > 0


# ---- whole simulations ---------------------------------------------------------------------
def test_sweep_is_deterministic_and_complete():
    config = _config(sweep={"num_draft_workers": [1, 2], "rtt_s": [0.0002, 0.005]})
    first, second = simulate(config), simulate(config)
    assert first == second
    assert len(first) == 4
    assert [(r["num_draft_workers"], r["rtt_s"]) for r in first] == [
        (1, 0.0002),
        (1, 0.005),
        (2, 0.0002),
        (2, 0.005),
    ]
    for row in first:
        assert row["num_requests"] == 8 and row["committed_tokens"] == 8 * 24
        assert row["all_max_tokens"] and row["leaked_requests"] == 0
        assert row["tokens_per_s"] > 0 and row["target_only_tokens_per_s"] > 0
        assert 0 < row["target_busy_fraction"] <= 1
        assert row["speedup"] == pytest.approx(
            row["tokens_per_s"] / row["target_only_tokens_per_s"]
        )
        for key in ("ttft_p50_s", "itl_p50_s", "itl_p95_s", "tpot_mean_s"):
            assert math.isfinite(row[key]) and row[key] > 0
    assert simulate(replace(config, workload=replace(config.workload, seed=1))) != first
    table = format_table(first)
    lines = table.splitlines()
    assert len(lines) == 2 + 4 and "num_draft_workers" in lines[0] and "speedup" in lines[0]
    assert len({len(line) for line in lines}) == 1  # fixed width


def test_zero_acceptance_ends_near_target_only():
    config = _config(
        alpha=(0.0,),
        workload=Workload(concurrency=4, num_requests=8, prompt_tokens=8, max_tokens=96),
    )
    (row,) = simulate(config)
    assert row["acceptance_rate"] == 0.0
    assert row["mean_k"] < 0.5  # only the periodic probes speculate
    assert row["tokens_per_s"] == pytest.approx(row["target_only_tokens_per_s"], rel=0.15)


def test_high_acceptance_with_a_cheap_draft_beats_target_only():
    config = _config(
        alpha=(0.9,),
        latency=_latency(draft_step=DraftCost(0.001, 0.00005)),
        workload=Workload(concurrency=8, num_requests=16, prompt_tokens=8, max_tokens=64),
    )
    (row,) = simulate(config)
    assert row["mean_k"] > 2
    assert row["speedup"] > 1.5


def test_pipelining_keeps_the_target_busier():
    """A draft round (k steps) ~ one verification: with two micro-batches the draft of one hides
    behind the verification of the other; one micro-batch without draft-ahead leaves the target
    idle while the draft works."""
    base = _config(
        alpha=(0.8,),
        latency=_latency(
            verify=VerifyCost(0.02, 0.0002, 0.0001), draft_step=DraftCost(0.001, 0.0008)
        ),
        workload=Workload(concurrency=16, num_requests=32, prompt_tokens=8, max_tokens=48),
    )
    fixed_k = {"num_speculative_tokens": 4, "adaptive_k": False}  # the same blocks in each run

    def run(**coordinator):
        (row,) = simulate(replace(base, coordinator=fixed_k | coordinator))
        return row

    serial = run(num_micro_batches=1, draft_ahead=False)
    for pipelined in (run(num_micro_batches=2, draft_ahead=False), run(num_micro_batches=2)):
        assert pipelined["tokens_per_s"] > 1.1 * serial["tokens_per_s"]
        assert pipelined["target_busy_fraction"] > serial["target_busy_fraction"] + 0.2
    assert serial["target_wait_fraction"] > 0.4  # the bubble: waiting for the draft


def test_unknown_sweep_field_and_processes_are_validated():
    with pytest.raises(SimConfigError, match="'k'"):
        _config(sweep={"k": [1, 2]})
    with pytest.raises(ValueError, match="processes"):
        simulate(_config(), processes=0)


def test_processes_give_the_same_rows():
    config = _config(sweep={"num_speculative_tokens": [2, 4]})
    seen = []
    assert simulate(config, processes=2, on_row=seen.append) == simulate(config) == seen


# Calibrated on this machine (DistributedBackend.calibrate): a bf16 self-draft that batches badly.
CPU_VERIFY = VerifyCost(0.0, 0.0, 0.0, table=((1, 0.085), (3, 0.186), (8, 0.183), (16, 0.221),
                                               (32, 0.395), (48, 0.449), (144, 0.733)))  # fmt: skip
CPU_DRAFT = DraftCost(0.0, 0.0, table=((1, 0.056), (4, 0.154), (8, 0.278), (16, 0.567)))


def test_speculation_off_when_it_cannot_pay_even_at_full_acceptance():
    """Concurrency 16 on the CPU costs: even α = 1 does not pay, so the pipelined coordinator
    neither splits the batch nor probes, and runs exactly as fast as target-only."""
    latency = LatencyModel(verify=CPU_VERIFY, draft_step=CPU_DRAFT, rtt_s=0.004)
    workload = Workload(concurrency=16, num_requests=32, prompt_tokens=60, max_tokens=32)
    coordinator = {"num_micro_batches": 2, "draft_ahead": True, "num_speculative_tokens": 8}
    (row,) = simulate(
        _config(alpha=(1.0,), latency=latency, workload=workload, coordinator=coordinator)
    )
    assert row["mean_k"] == 0
    assert row["tokens_per_s"] == pytest.approx(row["target_only_tokens_per_s"], rel=0.01)
    assert row["target_busy_fraction"] > 0.95


def test_speculation_on_at_concurrency_one_on_the_same_costs():
    latency = LatencyModel(verify=CPU_VERIFY, draft_step=CPU_DRAFT, rtt_s=0.004)
    workload = Workload(concurrency=1, num_requests=3, prompt_tokens=60, max_tokens=32)
    coordinator = {"num_micro_batches": 2, "draft_ahead": True, "num_speculative_tokens": 8}
    (row,) = simulate(
        _config(alpha=(1.0,), latency=latency, workload=workload, coordinator=coordinator)
    )
    assert row["mean_k"] > 1  # draft tokens per target step, prefill rounds included
    assert row["speedup"] > 1.2


def _running_coordinator(
    latency, acceptance, config, *, num_requests, max_tokens, watch, num_draft_workers=1
):
    """Run ``num_requests`` requests at once through a coordinator on simulated workers;
    ``watch(coordinator, target)`` runs as a task beside them. Returns the outputs."""

    async def main():
        inbox = SimInbox()
        target = SimTargetBackend(latency, acceptance, inbox, random.Random(0))
        drafts = SimDraftBackend(num_draft_workers, latency, inbox)
        coordinator = Coordinator(target, drafts, config, vocab_size=64)
        await coordinator.start()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        streams = [await coordinator.submit([5, 6, 7], params) for _ in range(num_requests)]
        watcher = asyncio.ensure_future(watch(coordinator, target))
        outputs = [await stream.result() for stream in streams]
        await coordinator.stop()
        watcher.cancel()
        return outputs

    return run_virtual(main())


def test_micro_batches_merge_when_acceptance_falls():
    """Eight requests split into two micro-batches while the draft is accepted; when its
    acceptance falls to 0 the split no longer pays, and at its next block boundary the second
    micro-batch hands its requests to the first (one verification for all)."""
    latency = LatencyModel(
        verify=VerifyCost(0.0, 0.0, 0.0, table=((1, 0.05), (8, 0.08), (64, 0.3))),
        draft_step=DraftCost(0.001, 0.0001),
        rtt_s=0.0005,
    )
    config = CoordinatorConfig(num_micro_batches=2, num_speculative_tokens=6)
    seen = []  # (virtual time, sizes of the two micro-batches)

    async def watch(coordinator, target):
        loop = asyncio.get_running_loop()
        for _ in range(20):
            await asyncio.sleep(0.25)
            seen.append((loop.time(), [len(batch) for batch in coordinator._batches]))
        target.acceptance = AcceptanceModel((0.0,))  # the draft stops matching
        while True:
            await asyncio.sleep(0.25)
            seen.append((loop.time(), [len(batch) for batch in coordinator._batches]))

    outputs = _running_coordinator(
        latency, AcceptanceModel((0.95,), 0.9), config, num_requests=8, max_tokens=600, watch=watch
    )
    assert all(len(output.token_ids) == 600 for output in outputs)
    assert [4, 4] in [sizes for _, sizes in seen[:20]], "with α = 0.95 the split pays"
    after = [sizes for _, sizes in seen[20:]]
    assert [8, 0] in after, f"after acceptance fell, one micro-batch holds everyone: {after}"
    assert all(sizes[1] == 0 for sizes in after[after.index([8, 0]) :]), after


def test_probes_at_a_large_batch_send_scouts_only():
    """Sixteen requests whose draft is never accepted: speculation is off, yet each request
    gets its chance (a first probe), SCOUT_REQUESTS at a time, and then probes on its own
    schedule: after 16 of its rounds without drafts, doubled per probe that found no gain (16,
    32, 64, 128), so at most 5 probes in 400 tokens. A probe round drafts for SCOUT_REQUESTS
    requests, not all sixteen (which would add probe_k verified tokens to every request)."""
    from specray.engine_core.block_length import SCOUT_REQUESTS

    latency = LatencyModel(
        # At batch 16 speculation pays only for a close draft (α = 1: 320 against 267 tok/s;
        # α = 0.5, the prior: 218), so it starts off and is probed.
        verify=VerifyCost(0.0, 0.0, 0.0, table=((1, 0.05), (16, 0.06), (32, 0.11), (64, 0.2))),
        draft_step=DraftCost(0.001, 0.0001),
        rtt_s=0.0005,
    )
    config = CoordinatorConfig(
        num_micro_batches=1,
        num_speculative_tokens=4,
        verify_prior=latency.verify,
        draft_prior=latency.draft_step,
    )
    probes = []  # per round with drafts: (round, how many requests drafted)
    held = []  # requests the draft worker holds, sampled

    async def watch(coordinator, target):
        original = target.verify

        async def verify(round_):
            drafting = sum(item.expect_draft for item in round_.items)
            if drafting:
                probes.append((target.calls, drafting))
            return await original(round_)

        target.verify = verify
        while True:
            await asyncio.sleep(0.1)
            held.append(len(await coordinator.drafts.held_requests(0)))

    outputs = _running_coordinator(
        latency, AcceptanceModel((0.0,)), config, num_requests=16, max_tokens=400, watch=watch
    )
    assert all(len(output.token_ids) == 400 for output in outputs)
    assert all(count <= SCOUT_REQUESTS for _, count in probes), probes
    per_request = sorted(output.metrics.num_drafts for output in outputs)
    assert per_request[0] >= 1 and per_request[-1] <= 5, per_request  # a chance, then backoff
    assert sum(per_request) == sum(count for _, count in probes)
    assert len(probes) <= 16 * 5 / SCOUT_REQUESTS + 8, probes  # probe rounds are shared
    assert held and max(held) <= 16, held


def test_each_micro_batch_drafts_on_its_own_workers():
    """Two micro-batches, four draft workers: micro-batch i's requests draft on workers
    i and i + 2 only, so one micro-batch's drafting never queues behind the other's. (Two
    requests first measure the acceptance; the split pays for the six that come next.)"""
    latency = LatencyModel(
        verify=VerifyCost(0.0, 0.0, 0.0, table=((1, 0.02), (256, 0.025))),  # GPU-like
        draft_step=DraftCost(0.002, 0.00004),
        rtt_s=0.0002,
    )
    config = CoordinatorConfig(
        num_micro_batches=2,
        num_speculative_tokens=4,
        verify_prior=latency.verify,  # known costs: the split is decided at admission
        draft_prior=latency.draft_step,
    )
    seen = []  # (micro-batch, draft worker) of every running request, sampled

    async def watch(coordinator, _target):
        await asyncio.sleep(0.5)
        params = SamplingParams(temperature=0.0, max_tokens=150)
        for _ in range(6):
            await coordinator.submit([5, 6, 7], params)
        while True:
            await asyncio.sleep(0.05)
            seen.extend(  # the micro-batch it joined (a merge keeps its worker)
                (request.batch_index, request.draft_worker)
                for batch in coordinator._batches
                for request in batch
            )

    outputs = _running_coordinator(
        latency,
        AcceptanceModel((0.8,), 0.7),
        config,
        num_requests=2,
        max_tokens=200,
        watch=watch,
        num_draft_workers=4,
    )
    assert all(len(output.token_ids) == 200 for output in outputs)
    assert {index for index, _ in seen} == {0, 1}, "the split pays: both micro-batches run"
    assert all(worker % 2 == index for index, worker in seen), sorted(set(seen))
    assert {worker for _, worker in seen} == {0, 1, 2, 3}


def test_a_rejecting_verdict_is_folded_in_and_the_next_block_drafted_early():
    """Every draft rejected (bonus never the draft's guess): the drafts made ahead are void,
    but once the verdict arrives the worker drafts the next block from what it committed, and
    the next call reuses all of it instead of drafting after the round trip."""
    latency = _latency(rtt_s=0.002, coordinator_overhead_s=0.0)

    async def main():
        inbox = SimInbox()
        target = SimTargetBackend(latency, AcceptanceModel((0.0,), 0.0), inbox, random.Random(0))
        drafts = SimDraftBackend(1, latency, inbox)
        spec = _spec("r", max_tokens=50)
        committed, replies = 0, []
        for step in (1, 2):
            draft_item = DraftItem(
                "r", step, 3, committed, (1,) * committed, spec=spec if step == 1 else None
            )
            item = VerifyItem("r", step, committed, True, spec=spec if step == 1 else None)
            proposal = asyncio.ensure_future(drafts.propose(0, ProposeCall((draft_item,), True)))
            reply = await target.verify(VerifyRound((item,), draft_deadline_s=5.0))
            replies.append((reply, await proposal))
            committed += len(reply.results[0].token_ids)
        return replies

    (first, _), (second, second_draft) = run_virtual(main())
    assert first.results[0].num_accepted == 0
    assert second_draft.reused_tokens == 3, "the whole next block was drafted from the verdict"
    assert second.wait_s < first.wait_s
