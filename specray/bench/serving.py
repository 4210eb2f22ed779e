"""``specray bench --concurrency 1,4,16``: the coordinator under concurrent load, side by side.

A local multi-node Ray cluster (a head that only drives, a draft node and a target node with one
core each) serves closed-loop clients: ``C`` clients each send their next prompt as soon as the
previous one finished. For every concurrency, three schedules run on the same workers in one
run: target-only, the unpipelined coordinator (one micro-batch: draft, then verify) and the
pipelined one (two micro-batches plus draft-ahead), both with adaptive k. Reported per row:
tokens/s, speedup over target-only, p50/p95 gap between streamed chunks, time per output token,
target busy fraction, α, mean k, and at concurrency 1 the fraction of docs/design.md's pipelined
bound ``E / max(verify(K+1)/verify(1) + r/T, K·c)`` reached. Then the simulator predicts every
row from the costs observed in it and the acceptance traces of the run's outputs (recorded
after the runs with the same drafter, :mod:`specray.sim.traces`): the simulator-vs-real check.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

from specray.bench.clients import run_clients
from specray.bench.main import acceptance_from_mix, load_prompts
from specray.cluster.placement import PlacementConfig, check_draft_placement
from specray.engine_core.client import EngineCoreClient
from specray.engine_core.coordinator_config import (
    DEFAULT_DRAFT_DEADLINE_S,
    DEFAULT_DRAFT_PRIOR,
    CoordinatorConfig,
)
from specray.engine_core.costs import scaled
from specray.outputs import ServedSummary, SpecDecodeMetrics, percentile
from specray.prompts import prompt_token_ids
from specray.sampling import SamplingParams

MODES = ("target-only", "unpipelined", "pipelined")


@dataclass(frozen=True)
class ServingBenchConfig:
    target: str = "default"
    draft: str = "default"
    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 32
    requests_per_client: int = 2
    num_speculative_tokens: int = 8  # the largest k the policy may choose
    temperature: float = 0.0
    draft_probs_encoding: str = "top64"  # sparse q: ~0.5 kB per drafted token instead of 196 kB
    draft_deadline_s: float = DEFAULT_DRAFT_DEADLINE_S
    # The cluster has a draft node beside the target's: the draft works there, in parallel with
    # verification, as the pipelined bound assumes ("colocated": in the target's process).
    draft_placement: str = "workers"

    def __post_init__(self) -> None:
        check_draft_placement(self.draft_placement)
        for name in ("max_tokens", "requests_per_client", "num_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.concurrency or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.concurrency
        ):
            raise ValueError(f"concurrency must be positive integers, got {self.concurrency!r}")


def parse_concurrency(value: str, *, param: str = "concurrency") -> tuple[int, ...]:
    """``"1,4,16"`` -> ``(1, 4, 16)``; ``param`` names the option in errors."""
    try:
        levels = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"{param} must be like 1,4,16, got {value!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"{param} must be positive integers, got {value!r}")
    return levels


def _log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _mode_config(
    mode: str, config: ServingBenchConfig, concurrency: int, calibration
) -> CoordinatorConfig:
    pipelined = mode == "pipelined"
    verify, draft = calibration
    return CoordinatorConfig(
        verify_prior=verify,
        draft_prior=draft or DEFAULT_DRAFT_PRIOR,
        max_running=max(concurrency, 1),
        max_queue=max(concurrency, 1),
        num_micro_batches=2 if pipelined else 1,
        num_speculative_tokens=0 if mode == "target-only" else config.num_speculative_tokens,
        adaptive_k=True,
        draft_ahead=pipelined,
        draft_deadline_s=config.draft_deadline_s,
    )


def _closed_loop(client, prompts, params, concurrency, per_client) -> list:
    """``concurrency`` clients, each sending ``per_client`` prompts one after the other."""
    results: list[list] = [[] for _ in range(concurrency)]

    def client_loop(index: int) -> None:
        for turn in range(per_client):
            prompt = prompts[(index * per_client + turn) % len(prompts)]
            results[index].append(client.submit(prompt, params).result())

    run_clients(concurrency, client_loop)
    return [output for outputs in results for output in outputs]


def _run_mode(backend, info, mode, config, concurrency, prompts, params, calibration) -> dict:
    """One row: the engine core on the target's rank 0 with this mode's settings, driven by
    ``concurrency`` closed-loop clients over one session."""
    import ray

    coordinator_config = _mode_config(mode, config, concurrency, calibration)
    address = backend.start_engine(
        coordinator_config,
        max_positions=info.max_positions,
        with_drafts=mode != "target-only",
    )
    client = EngineCoreClient(address)
    try:
        # Warm-up: one short request fits the cost model before the clock starts.
        _closed_loop(client, prompts[:1], params, 1, 1)
        ray.get(backend.leader.reset_engine_stats.remote())
        started = time.perf_counter()
        outputs = _closed_loop(client, prompts, params, concurrency, config.requests_per_client)
        wall_s = time.perf_counter() - started
        core = backend.engine_stats()
    finally:
        client.close()
        ray.get(backend.leader.stop_engine_core.remote())
    stats, costs = SimpleNamespace(**core["stats"]), core["costs"]
    summary = ServedSummary.of(outputs)
    metrics, tokens, gaps, tpot = (
        summary.metrics, summary.tokens, summary.chunk_gaps_s, summary.tpot_s
    )  # fmt: skip
    mean_k = metrics.num_draft_tokens / max(metrics.num_drafts, 1)
    return {
        "concurrency": concurrency,
        "mode": mode,
        "tokens_per_s": tokens / wall_s,
        "requests": len(outputs),
        "tokens": tokens,
        "wall_s": wall_s,
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p95_s": percentile(gaps, 0.95),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else 0.0,
        "ttft_p50_s": percentile([o.time_to_first_token_s for o in outputs], 0.5),
        "target_busy_fraction": min(stats.target_compute_s / wall_s, 1.0),
        "bubble_s": stats.target_wait_s,
        "target_compute_s": stats.target_compute_s,
        "target_forward_s": stats.target_forward_s,
        "target_prefill_s": stats.target_prefill_s,
        "acceptance_rate": metrics.acceptance_rate,
        "mean_acceptance_length": metrics.mean_acceptance_length,
        "mean_k": mean_k,
        "speculated_fraction": metrics.num_drafts / max(metrics.num_target_steps, 1),
        "reused_tokens": stats.reused_tokens,
        "verdicts_by_k": list(stats.verdicts_by_k),
        "bytes_per_token": stats.draft_bytes / max(tokens, 1),
        "draft_step_s": costs.draft.seconds(1),
        # Observed / calibrated seconds over the run: calibration times each worker alone,
        # in service they share two cores with each other and with Ray.
        # (target-only rounds; rounds verifying drafts cost draft_round_scale times more than
        # their calibrated forward relative to those, see Costs.mean_levels)
        "verify_level": costs.mean_levels[0],
        "draft_round_scale": costs.mean_levels[1],
        "draft_level": costs.mean_draft_level,
        "verify_cost": asdict(costs.verify),
        "draft_cost": asdict(costs.draft),
        "rtt_s": costs.rtt_s,
        "prefill_per_token_s": stats.target_prefill_s / max(stats.target_prefill_tokens, 1),
        "draft_prefill_per_token_s": stats.draft_prefill_s / max(stats.draft_prefill_tokens, 1),
        "metrics": metrics.to_dict(),
        "coordinator": {
            name: getattr(coordinator_config, name)
            for name in ("max_running", "max_queue", "num_micro_batches", "draft_ahead")
        }
        | {"num_speculative_tokens": coordinator_config.num_speculative_tokens},
        "prompt_tokens": round(statistics.fmean(len(o.prompt_token_ids) for o in outputs)),
        "outputs": [output.token_ids for output in outputs],
    }


@dataclass(frozen=True)
class _BoundTerms:
    """A concurrency-1 row in the performance model's terms (docs/design.md section 5), one
    entry per block length K the row's rounds used (its verdicts by K; a row without them: its
    mean K, rounded)."""

    weights: tuple[float, ...]  # share of the row's draft rounds at each K
    ks: tuple[int, ...]
    alpha: float  # per-position acceptance giving the row's mean acceptance length over its Ks
    expected: tuple[float, ...]  # E_K: tokens committed per target call at K
    verify: tuple[float, ...]  # V_K = verify(K+1)/T + r/T, in target steps
    draft: tuple[float, ...]  # D_K = K·c, in target steps

    def mean(self, per_k) -> float:
        return sum(w * value for w, value in zip(self.weights, per_k, strict=True))


def _block_lengths(row: dict, *, all_rounds: bool = False) -> dict[int, int]:
    """Draft rounds by block length K (K >= 1): the row's verdicts by K where recorded; with
    ``all_rounds``, its rounds without a draft (K = 0) as well."""
    counts = {k: n for k, n in enumerate(row.get("verdicts_by_k") or ()) if n > 0}
    drafted = {k: n for k, n in counts.items() if k > 0}
    if not drafted:
        return {max(round(row["mean_k"]), 1): 1}
    return counts if all_rounds else drafted


def _shares(counts: dict[int, int]) -> dict[int, float]:
    total = sum(counts.values())
    return {k: n / total for k, n in sorted(counts.items())}


def _bound_terms(
    row: dict, calibration, target_only: dict | None, *, all_rounds: bool = False
) -> _BoundTerms:
    verify, draft = calibration
    draft = draft or DEFAULT_DRAFT_PRIOR
    weights = _shares(_block_lengths(row, all_rounds=all_rounds))
    # The acceptance length is the drafted rounds' own.
    alpha = acceptance_from_mix(row["mean_acceptance_length"], _shares(_block_lengths(row)))
    target_step_s, draft_s = verify.seconds(1, 1), draft.seconds(1)
    verify_scale = plain_scale = 1.0
    if target_only is not None:
        target_step_s *= target_only["verify_level"]
        plain_scale = row["verify_level"]  # a round without a draft: no draft beside it
        verify_scale = plain_scale * row.get("draft_round_scale", 1.0)
        draft_s *= row["draft_level"]
    ks = tuple(weights)
    return _BoundTerms(
        weights=tuple(weights.values()),
        ks=ks,
        alpha=alpha,
        expected=tuple(sum(alpha**i for i in range(k + 1)) for k in ks),
        verify=tuple(
            (verify.seconds(1, k + 1) * (verify_scale if k else plain_scale) + row["rtt_s"])
            / target_step_s
            for k in ks
        ),
        draft=tuple(k * draft_s / target_step_s for k in ks),
    )


def pipelined_bound(
    row: dict, calibration, target_only: dict | None = None, *, all_rounds: bool = False
) -> float:
    """docs/design.md section 5 at batch 1: E / max(verify(K+1)/verify(1) + r/T, K·c), with the
    measured acceptance of the row and the costs calibrated on the workers, over the block
    lengths its rounds used (E and the round's cost each averaged over them: a row whose
    rounds mix K = 1 and 2 is neither's bound).

    With ``target_only`` (that concurrency's target-only row): the same bound at the per-call
    costs measured in the runs instead (each row's level over the calibration, and the row's
    extra slowness of rounds that verify drafts, ``draft_round_scale``): on a machine where the
    draft, the target and everything else share the cores, the draft's work slows the target's
    forwards, which the calibrated bound does not know.

    With ``all_rounds``: over the row's rounds without a draft too (the policy's K = 0: one
    token at a verification of one), so that what the policy chose not to draft is not
    counted as the pipeline's shortfall (a diagnostic beside the bound over draft rounds)."""
    terms = _bound_terms(row, calibration, target_only, all_rounds=all_rounds)
    costs = [max(v, d) for v, d in zip(terms.verify, terms.draft, strict=True)]
    return terms.mean(terms.expected) / terms.mean(costs)


def one_request_bound(row: dict, calibration, target_only: dict | None = None) -> float:
    """The pipelined bound for a single request (concurrency 1), where the draft cannot work
    on another micro-batch while the target verifies: a block drafted ahead during
    verification is usable only if the target accepts the whole block and draws the bonus
    token the draft guessed next (probability α^(K+1)); otherwise the next block is drafted
    after the verdict. Expected cost of a round, in target steps, with V = verify(K+1)/T +
    r/T and D = K·c: α^(K+1)·max(V, D) + (1 − α^(K+1))·(V + D), averaged over the row's block
    lengths as in :func:`pipelined_bound` (``target_only``: the costs measured in the run)."""
    terms = _bound_terms(row, calibration, target_only)
    costs = []
    for k, v, d in zip(terms.ks, terms.verify, terms.draft, strict=True):
        ahead = terms.alpha ** (k + 1)
        costs.append(ahead * max(v, d) + (1 - ahead) * (v + d))
    return terms.mean(terms.expected) / terms.mean(costs)


def simulated_tokens_per_s(
    row: dict, config: ServingBenchConfig, calibration, traces: list[list[int]] | None = None
) -> float:
    """The simulator's prediction for this row: same workload and coordinator settings, the
    acceptance of this run and the costs measured in it: the calibrated tables at the level the
    coordinator observed over the run (the simulator-vs-real check: what it tests is the
    coordinator's dynamics, given per-call costs). Acceptance: the run's traces when recorded
    (greedy; request i replays prompt i's, as the bench's request i used prompt i mod their
    number), else independent draws at the per-position rates of the row's counters."""
    from specray.sim import simulate
    from specray.sim.model import sim_config_from_dict

    verify, draft = calibration
    verify = replace(
        scaled(verify, row["verify_level"]), draft_round_scale=row.get("draft_round_scale", 1.0)
    )
    draft = scaled(draft or DEFAULT_DRAFT_PRIOR, row["draft_level"])

    if traces and row["mode"] != "target-only":
        acceptance = {"traces": traces}
    elif row["metrics"]["num_drafts"]:
        acceptance = {"from_metrics": row["metrics"] | {}}
        for key in ("acceptance_rate", "mean_acceptance_length"):
            acceptance["from_metrics"].pop(key, None)
    else:
        acceptance = {"per_position": [0.0]}
    sim_config = sim_config_from_dict(
        {
            "name": f"check-{row['mode']}-{row['concurrency']}",
            "latency": {
                "verify": asdict(verify),
                "draft_step": asdict(draft),
                "rtt_s": row["rtt_s"],
                "prefill_per_token_s": row["prefill_per_token_s"],
                "draft_prefill_per_token_s": row["draft_prefill_per_token_s"],
            },
            "acceptance": acceptance,
            "workload": {
                "concurrency": row["concurrency"],
                "num_requests": row["requests"],
                "prompt_tokens": row["prompt_tokens"],
                "max_tokens": config.max_tokens,
                "seed": 0,
            },
            "coordinator": row["coordinator"],
            "num_draft_workers": 1,
        }
    )
    (result,) = simulate(sim_config)
    return result["tokens_per_s"]


def _in_process_row(config: ServingBenchConfig, concurrency: int, prompts, params) -> dict:
    """The in-process ``Engine`` with the same drafter and prompts, for reference: waves of
    ``concurrency`` prompts (it batches what it is given; no admission or pipelining), with
    both cores to itself where each distributed worker has one."""
    from specray import Engine

    engine = Engine(
        config.target,
        draft=config.draft,
        num_speculative_tokens=min(config.num_speculative_tokens, 4),
        draft_probs_encoding=config.draft_probs_encoding,
    )
    engine.generate(prompts[:1], params)  # warm-up
    count = concurrency * config.requests_per_client
    chosen = [prompts[i % len(prompts)] for i in range(count)]
    started = time.perf_counter()
    outputs = []
    for wave in range(0, count, concurrency):
        outputs += engine.generate(chosen[wave : wave + concurrency], params)
    wall_s = time.perf_counter() - started
    metrics = SpecDecodeMetrics()
    for output in outputs:
        metrics.merge(output.metrics)
    tokens = sum(len(output.token_ids) for output in outputs)
    return {
        "concurrency": concurrency,
        "mode": "in-process",
        "tokens_per_s": tokens / wall_s,
        "requests": len(outputs),
        "tokens": tokens,
        "wall_s": wall_s,
        "acceptance_rate": metrics.acceptance_rate,
        "mean_acceptance_length": metrics.mean_acceptance_length,
        "num_speculative_tokens": engine.num_speculative_tokens,
        "metrics": metrics.to_dict(),  # the per-position counts, as the distributed rows
    }


def run_serving_bench(config: ServingBenchConfig) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from specray.cluster.distributed import DistributedBackend
    from specray.models.loading import load_model_info

    info = load_model_info(config.target, param="target")
    texts = [item["prompt"] for item in load_prompts(24)]
    prompts = [prompt_token_ids(info.tokenizer, text, use_chat_template=True) for text in texts]
    params = SamplingParams(
        temperature=config.temperature, max_tokens=config.max_tokens, ignore_eos=True, seed=0
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1, resources={"draft": 1})
    cluster.add_node(num_cpus=1, resources={"target": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    placement = PlacementConfig(draft_num_cpus=1, target_num_cpus=1)
    rows = []
    try:
        _log(f"starting workers: target={config.target} draft={config.draft}")
        backend = DistributedBackend(
            config.target,
            config.draft,
            placement=placement,
            draft_probs_encoding=config.draft_probs_encoding,
            draft_placement=config.draft_placement,
        )
        _log("calibrating: target forwards over (batch, tokens), draft steps over batch")
        calibration = backend.calibrate()
        for concurrency in config.concurrency:
            for mode in MODES:
                _log(f"concurrency {concurrency}: {mode}")
                rows.append(
                    _run_mode(
                        backend, info, mode, config, concurrency, prompts, params, calibration
                    )
                )
        backend.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    traces = _record_traces(config, info, prompts, rows, params) if params.greedy else None
    by_key = {(row["concurrency"], row["mode"]): row for row in rows}
    for row in rows:
        baseline = by_key[(row["concurrency"], "target-only")]
        row["speedup"] = row["tokens_per_s"] / baseline["tokens_per_s"]
        row["pipelined_over_unpipelined"] = (
            row["tokens_per_s"] / by_key[(row["concurrency"], "unpipelined")]["tokens_per_s"]
        )
        row["matches_target_only"] = row["outputs"] == baseline["outputs"]
        if row["mode"] != "target-only" and row["mean_k"] > 0 and row["concurrency"] == 1:
            bound = pipelined_bound(row, calibration)
            row["pipelined_bound"] = bound
            row["fraction_of_bound"] = row["speedup"] / bound
            measured = pipelined_bound(row, calibration, baseline)
            row["measured_bound"] = measured
            row["fraction_of_measured_bound"] = row["speedup"] / measured
            over_all = pipelined_bound(row, calibration, baseline, all_rounds=True)
            row["measured_bound_all_rounds"] = over_all
            row["fraction_of_measured_bound_all_rounds"] = row["speedup"] / over_all
            one = one_request_bound(row, calibration, baseline)
            row["one_request_bound"] = one
            row["fraction_of_one_request_bound"] = row["speedup"] / one
    for row in rows:
        del row["outputs"]
        row["simulated_tokens_per_s"] = simulated_tokens_per_s(row, config, calibration, traces)
        row["simulated_error"] = row["simulated_tokens_per_s"] / row["tokens_per_s"] - 1
    for concurrency in config.concurrency:
        _log(f"concurrency {concurrency}: in-process Engine")
        row = _in_process_row(config, concurrency, prompts, params)
        row["speedup"] = row["tokens_per_s"] / by_key[(concurrency, "target-only")]["tokens_per_s"]
        rows.append(row)
    return {
        "config": asdict(config),
        "calibration": {
            "verify": asdict(calibration[0]),
            "draft_step": asdict(calibration[1]) if calibration[1] else None,
        },
        "rows": rows,
        "acceptance_traces": traces,
    }


def _record_traces(config: ServingBenchConfig, info, prompts, rows, params):
    """Acceptance traces (:mod:`specray.sim.traces`) of the prompts this run used, from the
    target-only outputs: client c's turn t used prompt (c * per_client + t) mod len(prompts),
    and outputs are listed in that order. None for a run without a drafter."""
    from specray.drafters import make_drafter
    from specray.models.loading import load_model
    from specray.sampling.encoding import DraftProbsEncoding
    from specray.sim.traces import record_traces

    outputs: dict[int, list[int]] = {}
    for row in rows:
        if row["mode"] == "target-only":
            for index, output in enumerate(row["outputs"]):
                outputs.setdefault(index % len(prompts), list(output))
    used = range(len(outputs))  # the first prompts, in order
    _log(f"recording acceptance traces of {len(outputs)} prompts for the simulator check")
    target = load_model(config.target, param="target")
    encoding = DraftProbsEncoding.parse(config.draft_probs_encoding)
    drafter = make_drafter(config.draft, target, info.vocab_size, encoding)
    if drafter is None:
        return None
    return record_traces(
        drafter,
        [prompts[i] for i in used],
        [outputs[i] for i in used],
        params,
        vocab_size=info.vocab_size,
        max_k=config.num_speculative_tokens,
    )


def print_serving_report(report: dict) -> None:
    header = (
        f"{'conc':>4} {'mode':<12} {'tok/s':>7} {'speedup':>7} {'vs unpip':>8} {'itl p50':>8} "
        f"{'itl p95':>8} {'busy':>5} {'alpha':>5} {'k':>4} {'bound%':>6} {'all%':>5} {'1req%':>5} "
        f"{'greedy=':>7} {'sim tok/s':>9} {'sim err':>7}"
    )
    print(header)
    for row in report["rows"]:
        if row["mode"] == "in-process":
            print(
                f"{row['concurrency']:>4} {row['mode']:<12} {row['tokens_per_s']:>7.2f} "
                f"{row['speedup']:>7.2f} {'':>8} {'':>8} {'':>8} {'':>5} "
                f"{row['acceptance_rate']:>5.2f} {row['num_speculative_tokens']:>4} "
                "(the in-process Engine, fixed k, both cores)"
            )
            continue
        bound = row.get("fraction_of_bound")
        one = row.get("fraction_of_one_request_bound")
        over_all = row.get("fraction_of_measured_bound_all_rounds")
        print(
            f"{row['concurrency']:>4} {row['mode']:<12} {row['tokens_per_s']:>7.2f} "
            f"{row['speedup']:>7.2f} {row['pipelined_over_unpipelined']:>8.2f} "
            f"{row['itl_p50_s'] * 1e3:>6.0f}ms {row['itl_p95_s'] * 1e3:>6.0f}ms "
            f"{row['target_busy_fraction']:>5.2f} {row['acceptance_rate']:>5.2f} "
            f"{row['mean_k']:>4.1f} {'' if bound is None else f'{100 * bound:.0f}':>6} "
            f"{'' if over_all is None else f'{100 * over_all:.0f}':>5} "
            f"{'' if one is None else f'{100 * one:.0f}':>5} "
            f"{'yes' if row['matches_target_only'] else 'NO':>7} "
            f"{row['simulated_tokens_per_s']:>9.2f} {100 * row['simulated_error']:>6.1f}%"
        )
