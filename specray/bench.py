"""``specray bench``: side-by-side speed and acceptance in one run (DESIGN.md section 5).

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
from dataclasses import asdict, dataclass
from importlib import resources

import torch

from specray.engine import Engine
from specray.outputs import SpecDecodeMetrics
from specray.sampling import SamplingParams

DRAFTERS = ("ngram", "default")  # "default" is the target's own weights in bf16


@dataclass(frozen=True)
class BenchConfig:
    target: str = "default"
    k: int = 4  # speculative tokens per round
    max_tokens: int = 64  # generated tokens per prompt at most
    num_prompts: int = 24
    batch_size: int = 8  # prompts in the batched-vs-sequential comparison
    compare_transformers: bool = True

    def __post_init__(self) -> None:
        for name in ("k", "max_tokens", "num_prompts", "batch_size"):
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
    low, high = 0.0, 1.0
    for _ in range(60):
        alpha = (low + high) / 2
        expected = sum(alpha**i for i in range(k + 1))
        low, high = (alpha, high) if expected < mean_length else (low, alpha)
    return (low + high) / 2


@torch.inference_mode()
def measure_verify_ratio(engine: Engine, prompt_ids: list[int], k: int, repeats: int = 8) -> dict:
    """Target forward time for k+1 tokens over 1 token, at batch 1 after a real prompt."""
    runner = engine.target
    runner.forward({"probe": prompt_ids}, {"probe": 1})

    def timed(width: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            runner.forward({"probe": prompt_ids[:width]}, {"probe": width})
            best = min(best, time.perf_counter() - started)
            runner.rollback("probe", width)
        return best

    one, many = timed(1), timed(k + 1)
    runner.remove(["probe"])
    return {"target_step_s": one, "verify_k_plus_1_s": many, "verify_ratio": many / one}


def _run_specray(engine: Engine, prompts: list[str], params: SamplingParams) -> dict:
    engine.timing.__init__()  # reset the phase counters
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
    costs = measure_verify_ratio(target_engine, prompt_ids[0], config.k)
    _log(f"verify(k+1)/verify(1) = {costs['verify_ratio']:.2f}")

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
        _log(f"specray draft={drafter} k={config.k}")
        engine = Engine(config.target, draft=drafter, num_speculative_tokens=config.k)
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
        engines[drafter] = engine
        run = _run_specray(engine, prompts, params)
        row = _row(f"specray draft={drafter}", run, baseline["tokens_per_s"], reference)
        metrics = run["metrics"]
        if metrics.num_draft_tokens:
            step_s = costs["target_step_s"]
            draft_cost = run["draft_s"] / metrics.num_draft_tokens / step_s  # c
            mean_length = metrics.mean_acceptance_length
            bound = mean_length / (costs["verify_ratio"] + config.k * draft_cost)
            row["alpha"] = round(acceptance_from_mean_length(mean_length, config.k), 4)
            row["draft_cost_ratio"] = round(draft_cost, 4)
            row["sync_bound"] = round(bound, 3)
            row["bound_fraction"] = round(row["speedup_vs_target_only"] / bound, 3)
        rows.append(row)
        if config.compare_transformers:
            if drafter == "ngram":
                extra = {"prompt_lookup_num_tokens": config.k}
            else:
                extra = {
                    "assistant_model": engine.drafter.runner.model,
                    "num_assistant_tokens": config.k,
                    "num_assistant_tokens_schedule": "constant",
                }
            _log(f"transformers assisted generation draft={drafter}")
            hf = _run_transformers(model, prompt_ids, config.max_tokens, **extra)
            name = f"transformers assisted draft={drafter}"
            hf_rows = [_row(name, hf, baseline["tokens_per_s"], reference)]
            if drafter != "ngram":  # also transformers' own default schedule for k
                _log(f"transformers assisted generation draft={drafter}, heuristic k")
                extra["num_assistant_tokens_schedule"] = "heuristic"
                hf = _run_transformers(model, prompt_ids, config.max_tokens, **extra)
                hf_rows.append(
                    _row(f"{name} heuristic-k", hf, baseline["tokens_per_s"], reference)
                )
            rows.extend(hf_rows)
            fastest = max(hf_row["tokens_per_s"] for hf_row in hf_rows)
            row["speedup_vs_assisted"] = round(row["tokens_per_s"] / fastest, 3)

    best = max(
        (row for row in rows if row["configuration"].startswith("specray draft=")),
        key=lambda row: row["tokens_per_s"],
    )
    best_drafter = best["configuration"].split("=", 1)[1]
    batch_prompts = prompts[: config.batch_size]
    _log(f"batched vs sequential, {len(batch_prompts)} prompts, draft={best_drafter}")
    engine = engines[best_drafter]
    sequential = _run_specray(engine, batch_prompts, params)
    started = time.perf_counter()
    batched_outputs = engine.generate(batch_prompts, params)
    batched_wall = time.perf_counter() - started
    batched_tokens = sum(len(output.token_ids) for output in batched_outputs)
    batched = {
        "draft": best_drafter,
        "num_prompts": len(batch_prompts),
        "sequential_tokens_per_s": round(sequential["tokens_per_s"], 3),
        "batched_tokens_per_s": round(batched_tokens / batched_wall, 3),
        "batched_over_sequential": round(
            (batched_tokens / batched_wall) / sequential["tokens_per_s"], 3
        ),
        "outputs_match": [o.token_ids for o in batched_outputs] == sequential["outputs"],
    }
    return {
        "config": asdict(config),
        "machine": {"torch_threads": torch.get_num_threads()},
        "costs": {key: round(value, 5) for key, value in costs.items()},
        "rows": rows,
        "batched": batched,
    }


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
    print("batched:", json.dumps(report["batched"]))


def plot_report(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["configuration"] for row in report["rows"]]
    values = [row["tokens_per_s"] for row in report["rows"]]
    colors = ["tab:blue" if name.startswith("specray") else "tab:gray" for name in names]
    figure, axis = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    axis.barh(names[::-1], values[::-1], color=colors[::-1])
    axis.set_xlabel("tokens / s (batch 1, greedy)")
    axis.set_title(f"specray bench, k={report['config']['k']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
