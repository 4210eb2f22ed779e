"""``specray bench``: side-by-side speed and acceptance in one run (docs/design.md section 5).

Configurations, all greedy at batch 1 over the same shipped prompts and the same model weights:
  - specray target-only, and transformers ``generate()`` (the no-runtime-tax check);
  - specray with each drafter, and transformers' assisted generation with the same drafter
    (``prompt_lookup_num_tokens`` for n-gram, ``assistant_model`` for a draft model);
  - batched: one ``generate`` of ``batch_size`` prompts vs the same prompts one call each.
Speedups are ratios of tokens/s measured in this run. The synchronous bound is
``E / (verify(k+1)/verify(1) + k·c)`` with E the measured mean acceptance length, the verify
cost ratio measured on the target, and c the measured draft cost per token over a target step.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from importlib import resources

import torch

from specray.engine import Engine, EngineTiming
from specray.outputs import SpecDecodeMetrics
from specray.sampling import SamplingParams

DRAFTERS = ("ngram", "default")  # "default": the measured winner (specray/data/drafters.json)
# k per drafter: the k `specray bench --drafters all` found best for each here (ngram, and
# ngram+distilled, the recorded default, both at 4).
DEFAULT_K = {"ngram": 4, "default": 4}


def parse_k(value: str) -> tuple[tuple[str, int], ...]:
    """``"8"`` (every drafter) or ``"ngram=4,default=8"`` -> ((drafter, k), ...)."""
    if value.isdigit() and int(value) >= 1:
        return tuple((drafter, int(value)) for drafter in DRAFTERS)
    out = dict(DEFAULT_K)
    for part in value.split(","):
        name, _, number = part.partition("=")
        if name not in DRAFTERS or not number.isdigit() or int(number) < 1:
            raise ValueError(f"k must be N or drafter=N[,drafter=N] over {DRAFTERS}, got {value!r}")
        out[name] = int(number)
    return tuple(out.items())


@dataclass(frozen=True)
class BenchConfig:
    target: str = "default"
    k: tuple[tuple[str, int], ...] = tuple(DEFAULT_K.items())  # (drafter, k) pairs
    max_tokens: int = 64  # generated tokens per prompt at most
    num_prompts: int = 24
    batch_size: int = 8  # prompts in the batched-vs-sequential comparison
    compare_transformers: bool = True

    def __post_init__(self) -> None:
        for name in ("max_tokens", "num_prompts", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def load_prompts(num_prompts: int) -> list[dict]:
    """The shipped prompts, interleaved by category so any prefix covers every category."""
    text = resources.files("specray.data").joinpath("bench_prompts.json").read_text()
    prompts = json.loads(text)["prompts"]
    by_category: dict[str, list[dict]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt["category"], []).append(prompt)
    interleaved = []
    while any(by_category.values()):
        for queue in by_category.values():
            if queue:
                interleaved.append(queue.pop(0))
    if num_prompts > len(interleaved):
        raise ValueError(f"num_prompts must be <= {len(interleaved)}, got {num_prompts}")
    return interleaved[:num_prompts]


def _log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def acceptance_from_mean_length(mean_length: float, k: int) -> float:
    """Per-position acceptance α with (1 - α^(k+1)) / (1 - α) = mean_length (bisection)."""
    return acceptance_from_mix(mean_length, {k: 1.0})


def acceptance_from_mix(mean_length: float, weights: Mapping[int, float]) -> float:
    """α with sum_k w_k (1 - α^(k+1)) / (1 - α) = mean_length, for rounds whose block lengths
    k come in shares ``weights`` summing to 1 (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        alpha = (low + high) / 2
        expected = sum(w * sum(alpha**i for i in range(k + 1)) for k, w in weights.items())
        low, high = (alpha, high) if expected < mean_length else (low, alpha)
    return (low + high) / 2


@torch.inference_mode()
def time_verify(engine: Engine, prompt_ids: list[int], widths, repeats: int = 8) -> dict:
    """Best-of-``repeats`` target forward seconds over each number of new tokens in ``widths``,
    at batch 1 after a real prompt."""
    runner = engine.target
    runner.forward({"probe": prompt_ids}, {"probe": 1})
    seconds = {}
    for width in widths:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            runner.forward({"probe": prompt_ids[:width]}, {"probe": width})
            best = min(best, time.perf_counter() - started)
            runner.rollback("probe", width)
        seconds[width] = best
    runner.remove(["probe"])
    return seconds


def measure_verify_ratio(engine: Engine, prompt_ids: list[int], k: int, repeats: int = 8) -> dict:
    """Target forward time for k+1 tokens over 1 token, at batch 1 after a real prompt."""
    seconds = time_verify(engine, prompt_ids, (1, k + 1), repeats)
    one, many = seconds[1], seconds[k + 1]
    return {"target_step_s": one, "verify_k_plus_1_s": many, "verify_ratio": many / one}


def _run_specray(engine: Engine, prompts: list[str], params: SamplingParams) -> dict:
    engine.timing = EngineTiming()  # reset the phase counters
    metrics, tokens, outputs = SpecDecodeMetrics(), 0, []
    started = time.perf_counter()
    for prompt in prompts:
        output = engine.generate([prompt], params)[0]
        metrics.merge(output.metrics)
        tokens += len(output.token_ids)
        outputs.append(output.token_ids)
    wall_s = time.perf_counter() - started
    return {
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "metrics": metrics,
        "outputs": outputs,
        "draft_s": engine.timing.draft_s,
    }


@torch.inference_mode()
def _run_transformers(model, prompt_ids: list[list[int]], max_tokens: int, **extra) -> dict:
    eos = model.generation_config.eos_token_id
    tokens, outputs = 0, []
    started = time.perf_counter()
    for ids in prompt_ids:
        input_ids = torch.tensor([ids])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos if isinstance(eos, int) else None,
            **extra,
        )
        new = out[0, len(ids) :].tolist()
        tokens += len(new)
        outputs.append(new)
    wall_s = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s, "outputs": outputs}


def _row(name: str, run: dict, baseline_tps: float, reference_outputs) -> dict:
    row = {
        "configuration": name,
        "tokens": run["tokens"],
        "wall_s": round(run["wall_s"], 3),
        "tokens_per_s": round(run["tokens_per_s"], 3),
        "speedup_vs_target_only": round(run["tokens_per_s"] / baseline_tps, 3),
        "matches_target_only": run["outputs"] == reference_outputs,
    }
    metrics: SpecDecodeMetrics | None = run.get("metrics")
    if metrics is not None and metrics.num_drafts:
        row["acceptance_rate"] = round(metrics.acceptance_rate, 4)
        row["mean_acceptance_length"] = round(metrics.mean_acceptance_length, 4)
        row["accepted_per_position"] = metrics.accepted_per_position
    return row


def run_bench(config: BenchConfig) -> dict:
    prompts = [item["prompt"] for item in load_prompts(config.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, seed=0)
    _log(f"loading target {config.target}")
    target_engine = Engine(config.target, draft=None)
    prompt_ids = [target_engine.encode_prompt(prompt) for prompt in prompts]
    target_engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
    k_by_drafter = dict(config.k)
    costs = {
        drafter: measure_verify_ratio(target_engine, prompt_ids[0], k)
        for drafter, k in k_by_drafter.items()
    }
    step_s = min(cost["target_step_s"] for cost in costs.values())

    rows = []
    _log("specray target-only")
    baseline = _run_specray(target_engine, prompts, params)
    reference = baseline["outputs"]
    rows.append(_row("specray target-only", baseline, baseline["tokens_per_s"], reference))
    model = target_engine.target.model
    if config.compare_transformers:
        _log("transformers generate()")
        hf = _run_transformers(model, prompt_ids, config.max_tokens)
        rows.append(_row("transformers generate", hf, baseline["tokens_per_s"], reference))

    engines = {}
    for drafter in DRAFTERS:
        k = k_by_drafter[drafter]
        _log(f"specray draft={drafter} k={k}")
        engine = Engine(config.target, draft=drafter, num_speculative_tokens=k)
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
        engines[drafter] = engine
        run = _run_specray(engine, prompts, params)
        row = _row(f"specray draft={drafter} k={k}", run, baseline["tokens_per_s"], reference)
        metrics = run["metrics"]
        if metrics.num_draft_tokens:
            draft_cost = run["draft_s"] / metrics.num_draft_tokens / step_s  # c
            mean_length = metrics.mean_acceptance_length
            bound = mean_length / (costs[drafter]["verify_ratio"] + k * draft_cost)
            row["verify_ratio"] = round(costs[drafter]["verify_ratio"], 3)
            row["alpha"] = round(acceptance_from_mean_length(mean_length, k), 4)
            row["draft_cost_ratio"] = round(draft_cost, 4)
            row["sync_bound"] = round(bound, 3)
            row["bound_fraction"] = round(row["speedup_vs_target_only"] / bound, 3)
        rows.append(row)
        if config.compare_transformers:
            hf_rows = []
            for variant, extra in _assisted_variants(drafter, k, engine):
                name = f"transformers assisted draft={drafter} {variant}"
                _log(name)
                hf = _run_transformers(model, prompt_ids, config.max_tokens, **extra())
                hf_rows.append(_row(name, hf, baseline["tokens_per_s"], reference))
            rows.extend(hf_rows)
            fastest = max(hf_row["tokens_per_s"] for hf_row in hf_rows)
            row["speedup_vs_assisted"] = round(row["tokens_per_s"] / fastest, 3)

    batch_prompts = prompts[: config.batch_size]
    batched = []
    for drafter, engine in [("none", target_engine), *engines.items()]:
        _log(f"batched vs sequential, {len(batch_prompts)} prompts, draft={drafter}")
        sequential = _run_specray(engine, batch_prompts, params)
        started = time.perf_counter()
        batched_outputs = engine.generate(batch_prompts, params)
        batched_wall = time.perf_counter() - started
        batched_tps = sum(len(output.token_ids) for output in batched_outputs) / batched_wall
        batched.append(
            {
                "draft": drafter,
                "k": engine.num_speculative_tokens,
                "num_prompts": len(batch_prompts),
                "sequential_tokens_per_s": round(sequential["tokens_per_s"], 3),
                "batched_tokens_per_s": round(batched_tps, 3),
                "batched_over_sequential": round(batched_tps / sequential["tokens_per_s"], 3),
                "outputs_match": [o.token_ids for o in batched_outputs] == sequential["outputs"],
            }
        )
    return {
        "config": asdict(config),
        "machine": {"torch_threads": torch.get_num_threads()},
        "costs": {
            drafter: {key: round(value, 5) for key, value in cost.items()}
            for drafter, cost in costs.items()
        },
        "rows": rows,
        "batched": batched,
    }


def _assisted_variants(drafter: str, k: int, engine: Engine) -> list[tuple[str, Callable]]:
    """transformers' assisted generation with the same drafter: at the same k, and (for a draft
    model) with transformers' own defaults (k starts at 20, heuristic schedule, early exit
    below 0.4 confidence). The assistant's k lives in *its* generation config, so each variant is
    a function that configures it just before its run and returns generate()'s extra kwargs."""
    if drafter == "ngram":
        return [(f"k={k}", lambda: {"prompt_lookup_num_tokens": k})]
    assistant = engine.drafter.runner.model
    settings = assistant.generation_config

    def configured(num_tokens: int, schedule: str, threshold: float) -> dict:
        settings.num_assistant_tokens = num_tokens
        settings.num_assistant_tokens_schedule = schedule
        settings.assistant_confidence_threshold = threshold
        return {"assistant_model": assistant}

    return [
        (f"k={k}", lambda: configured(k, "constant", 0.0)),
        ("transformers-defaults", lambda: configured(20, "heuristic", 0.4)),
    ]


def print_report(report: dict) -> None:
    columns = [
        ("configuration", 36),
        ("tokens_per_s", 12),
        ("speedup_vs_target_only", 10),
        ("speedup_vs_assisted", 10),
        ("alpha", 7),
        ("mean_acceptance_length", 8),
        ("bound_fraction", 8),
        ("matches_target_only", 7),
    ]
    print("  ".join(name[:width].ljust(width) for name, width in columns))
    for row in report["rows"]:
        cells = []
        for name, width in columns:
            value = row.get(name, "")
            cells.append((f"{value:.3f}" if isinstance(value, float) else str(value)).ljust(width))
        print("  ".join(cells))
    for row in report["batched"]:
        print("batched:", json.dumps(row))


DISTRIBUTED_ENCODINGS = ("fp32", "fp16", "top64")
# SmolLM2-135M has 3 KV heads: TP = 3 is the only split it allows (TP = 2 is tested on a tiny
# model with 2 KV heads). On 2 CPU cores TP shows correctness, not speed.
TP_SIZES = (1, 3)


def run_distributed_bench(config: BenchConfig) -> dict:
    """The distribution tax: the same prompts in process and across a local multi-node Ray
    cluster (head, a draft node, a target node), draft="default", one torch thread per worker
    and in process alike. Reports per-round overhead, bytes on the wire and tokens/s."""
    import ray
    from ray.cluster_utils import Cluster

    prompts = [item["prompt"] for item in load_prompts(config.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, seed=0)
    torch.set_num_threads(1)  # the workers run one thread each: compare like with like
    _log("in-process reference, draft=default")
    k = dict(config.k)["default"]
    local = Engine(config.target, draft="default", num_speculative_tokens=k)
    # A draft worker on another node cannot adopt the target's prompt cache; for a like-for-like
    # tax the in-process draft prefills itself too.
    local.drafter.shares_target_architecture = False
    local.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    costs = measure_verify_ratio(local, local.encode_prompt(prompts[0]), k)
    in_process = _run_specray(local, prompts, params)
    rounds_in_process = local.timing.rounds
    del local
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=2, resources={"draft": 4})
    cluster.add_node(num_cpus=2, resources={"target": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    rows = []
    try:
        for encoding in DISTRIBUTED_ENCODINGS:
            _log(f"distributed, draft_probs_encoding={encoding}")
            engine = Engine(
                config.target,
                draft="default",
                num_speculative_tokens=k,
                draft_probs_encoding=encoding,
                cluster=cluster.address,
            )
            engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
            before = engine.engine_stats()["stats"]
            run = _run_specray(engine, prompts, params)
            after = engine.engine_stats()["stats"]
            rounds = after["rounds"] - before["rounds"]
            wire_bytes = after["draft_bytes"] - before["draft_bytes"]
            engine.shutdown()
            metrics = run["metrics"]
            round_s = run["wall_s"] / rounds
            overhead_s = round_s - in_process["wall_s"] / rounds_in_process
            rows.append(
                {
                    "draft_probs_encoding": encoding,
                    "tokens_per_s": round(run["tokens_per_s"], 3),
                    "matches_in_process": run["outputs"] == in_process["outputs"],
                    "round_ms": round(1e3 * round_s, 2),
                    "overhead_ms_per_round": round(1e3 * overhead_s, 2),
                    "overhead_fraction_of_target_step": round(
                        overhead_s / costs["target_step_s"], 4
                    ),
                    "bytes_per_draft_token": round(wire_bytes / metrics.num_draft_tokens, 1),
                    "bytes_per_accepted_token": round(
                        wire_bytes / max(metrics.num_accepted_tokens, 1), 1
                    ),
                    "acceptance_rate": round(metrics.acceptance_rate, 4),
                }
            )
        tp_rows = []
        for tp_size in TP_SIZES:
            _log(f"target-only step time, tp_size={tp_size}")
            engine = Engine(config.target, draft=None, cluster=cluster.address, tp_size=tp_size)
            engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
            rounds_before = engine.engine_stats()["stats"]["rounds"]
            run = _run_specray(engine, prompts[:2], params)
            rounds = engine.engine_stats()["stats"]["rounds"] - rounds_before
            engine.shutdown()
            tp_rows.append({"tp_size": tp_size, "round_ms": round(1e3 * run["wall_s"] / rounds, 2)})
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {
        "tensor_parallel": tp_rows,
        "config": asdict(config),
        "in_process": {
            "tokens_per_s": round(in_process["tokens_per_s"], 3),
            "round_ms": round(1e3 * in_process["wall_s"] / rounds_in_process, 2),
            "target_step_ms": round(1e3 * costs["target_step_s"], 2),
        },
        "distributed": rows,
    }
