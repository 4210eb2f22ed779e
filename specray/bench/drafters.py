"""``specray bench --drafters all``: every drafter on the held-out bench prompts, side by side.

In process, batch 1, greedy, the same prompts and target for every row, in one run: target-only,
then each drafter at the k that maximises its synchronous bound ``E(α, k) / (verify(k+1)/verify(1)
+ k·c)``, with α and c measured on two calibration prompts from the distillation prompt set (never
the held-out ones). Per row: α (per-position acceptance fitted to the mean acceptance length),
first-position acceptance, mean acceptance length, c (draft cost per token over a target step),
tokens/s and speedup over target-only, where the draft's time goes, and whether the output is
token for token the target-only output. With ``pipelined``, the fastest drafters also run through
the coordinator with draft and target on separate one-core Ray nodes. ``record`` writes the winner
to ``specray/data/drafters.json``, which ``draft="auto"`` / ``"default"`` resolve to.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specray.bench.main import _run_specray, acceptance_from_mean_length, load_prompts, time_verify
from specray.drafters import measured_drafts_file, model_digest
from specray.engine import Engine
from specray.models.linears import cpu_model
from specray.models.loading import resolve_model_dir
from specray.sampling import SamplingParams

ALL_DRAFTERS = (
    "ngram",
    "self:bf16",
    "self:fp16",
    "self:int8",
    "distilled:fp32",
    "distilled:fp16",
    "distilled:int8",
    "ngram+distilled",
    "ngram+self:auto",
)
CALIBRATION_K = 4


def parse_drafters(value: str) -> tuple[str, ...]:
    if value == "all":
        return ALL_DRAFTERS
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    if not names:
        raise ValueError(f"drafters must be 'all' or a comma-separated list, got {value!r}")
    return names


@dataclass(frozen=True)
class DraftersBenchConfig:
    target: str = "default"
    drafters: tuple[str, ...] = ALL_DRAFTERS
    max_tokens: int = 64
    num_prompts: int = 12
    max_k: int = 8
    pipelined_top: int = 0  # the N fastest drafters also run pipelined (0: none)
    pipelined_prompts: int = 6  # held-out prompts per pipelined run (each runs 3 schedules)
    record: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens", "num_prompts", "max_k", "pipelined_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.pipelined_top < 0:
            raise ValueError(f"pipelined_top must be >= 0, got {self.pipelined_top!r}")


def _log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def best_k(alpha: float, c: float, verify_ratio: dict[int, float]) -> tuple[int, float]:
    """The k in ``verify_ratio`` maximising the synchronous bound, and that bound (pure)."""

    def bound(k: int) -> float:
        expected = sum(alpha**i for i in range(k + 1))
        return expected / (verify_ratio[k] + k * c)

    k = max(verify_ratio, key=bound)
    return k, bound(k)


def verify_ratios(engine: Engine, prompt_ids: list[int], max_k: int, repeats: int = 6):
    """(target step seconds, {k: verify(k+1) / verify(1)} for k = 1..max_k)."""
    seconds = time_verify(engine, prompt_ids, range(1, max_k + 2), repeats)
    return seconds[1], {k: seconds[k + 1] / seconds[1] for k in range(1, max_k + 1)}


def _draft_profile(engine: Engine) -> dict | None:
    drafter = engine.drafter
    model = getattr(drafter, "then", drafter)  # the model part of an n-gram-first chain
    profile = getattr(model, "profile", None)
    if profile is None or not profile.tokens:
        return None
    per_step = 1e3 / max(profile.steps, 1)
    return {
        "draft_steps": profile.steps,
        "forward_ms_per_step": round(profile.forward_s * per_step, 3),
        "of_which_head_ms": round(profile.head_s * per_step, 3),
        "pipeline_ms_per_token": round(1e3 * profile.pipeline_s / profile.tokens, 3),
        "sample_ms_per_token": round(1e3 * profile.sample_s / profile.tokens, 3),
    }


def _calibration_prompts() -> list[str]:
    from specray.distill.prompts import chat_and_code_prompts

    return chat_and_code_prompts(seed=1)[:2]  # same templates as training, never held out


def _measure(engine: Engine, prompts, params, step_s: float) -> dict:
    run = _run_specray(engine, prompts, params)
    metrics = run["metrics"]
    k = engine.num_speculative_tokens
    out = {"run": run, "k": k}
    if metrics.num_draft_tokens:
        out["c"] = run["draft_s"] / metrics.num_draft_tokens / step_s
        out["alpha"] = acceptance_from_mean_length(metrics.mean_acceptance_length, k)
    return out


def acceptance_fields(metrics, k: int) -> dict:
    """A drafters row's acceptance, from a run's counters (it drafted at least once): α fitted
    to the mean acceptance length at k, the first position's and every position's acceptance
    (rounds that accepted position j over rounds with drafts, vLLM's rate), the rate and E."""
    return {
        "alpha": round(acceptance_from_mean_length(metrics.mean_acceptance_length, k), 4),
        "first_position_acceptance": round(
            metrics.accepted_per_position[0] / max(metrics.num_drafts, 1), 4
        ),
        "acceptance_per_position": [
            round(accepted / metrics.num_drafts, 4) for accepted in metrics.accepted_per_position
        ],
        "acceptance_rate": round(metrics.acceptance_rate, 4),
        "mean_acceptance_length": round(metrics.mean_acceptance_length, 4),
    }


def run_drafters_bench(config: DraftersBenchConfig) -> dict:
    prompts = [item["prompt"] for item in load_prompts(config.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, seed=0)
    calibration = _calibration_prompts()
    calibration_params = SamplingParams(temperature=0.0, max_tokens=32, seed=0)
    _log(f"loading target {config.target}")
    target_engine = Engine(config.target, draft=None)
    target_engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    step_s, ratios = verify_ratios(
        target_engine, target_engine.encode_prompt(prompts[0]), config.max_k
    )
    _log("target-only")
    baseline = _run_specray(target_engine, prompts, params)
    reference = baseline["outputs"]
    rows = [
        {
            "draft": "none",
            "k": 0,
            "tokens_per_s": round(baseline["tokens_per_s"], 3),
            "speedup": 1.0,
            "matches_target_only": True,
        }
    ]
    for drafter in config.drafters:
        _log(f"draft={drafter}: calibrating k on {len(calibration)} non-held-out prompts")
        engine = Engine(config.target, draft=drafter, num_speculative_tokens=CALIBRATION_K)
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
        probe = _measure(engine, calibration, calibration_params, step_s)
        if "alpha" in probe:
            k, bound = best_k(probe["alpha"], probe["c"], ratios)
        else:
            k, bound = CALIBRATION_K, None
        engine.num_speculative_tokens = k
        _log(f"draft={drafter} k={k}")
        measured = _measure(engine, prompts, params, step_s)
        run, metrics = measured["run"], measured["run"]["metrics"]
        row = {
            "draft": drafter,
            "k": k,
            "tokens_per_s": round(run["tokens_per_s"], 3),
            "speedup": round(run["tokens_per_s"] / baseline["tokens_per_s"], 3),
            "matches_target_only": run["outputs"] == reference,
            "calibration_alpha": round(probe.get("alpha", 0.0), 4),
            "calibration_bound": None if bound is None else round(bound, 3),
        }
        if metrics.num_draft_tokens:
            sync_bound = sum(measured["alpha"] ** i for i in range(k + 1)) / (
                ratios[k] + k * measured["c"]
            )
            row |= acceptance_fields(metrics, k) | {
                "draft_cost_ratio": round(measured["c"], 4),
                "verify_ratio": round(ratios[k], 3),
                "sync_bound": round(sync_bound, 3),
                "bound_fraction": round(row["speedup"] / sync_bound, 3),
                "draft_profile": _draft_profile(engine),
            }
        rows.append(row)
        del engine
    exact = [row for row in rows[1:] if row["matches_target_only"]]
    winner = max(exact, key=lambda row: row["tokens_per_s"]) if exact else None
    report = {
        "config": asdict(config),
        "machine": {"torch_threads": torch.get_num_threads()},
        "target_step_ms": round(1e3 * step_s, 2),
        "verify_ratio": {k: round(value, 3) for k, value in ratios.items()},
        "rows": rows,
        "winner": None if winner is None else {"draft": winner["draft"], "k": winner["k"]},
    }
    if config.pipelined_top:
        ranked = sorted(exact, key=lambda row: -row["tokens_per_s"])[: config.pipelined_top]
        report["pipelined"] = run_pipelined(config, [row["draft"] for row in ranked])
    if config.record and winner is not None:
        record_winner(config.target, report)
    return report


def run_pipelined(config: DraftersBenchConfig, drafters: list[str]) -> list[dict]:
    """Each drafter through the coordinator (adaptive k, draft-ahead) at concurrency 1, draft and
    target on separate one-core Ray nodes, next to target-only on the same workers."""
    from specray.bench.serving import ServingBenchConfig, run_serving_bench

    rows = []
    for drafter in drafters:
        _log(f"pipelined: draft={drafter}")
        serving = ServingBenchConfig(
            target=config.target,
            draft=drafter,
            concurrency=(1,),
            max_tokens=config.max_tokens,
            requests_per_client=config.pipelined_prompts,
            num_speculative_tokens=config.max_k,
        )
        report = run_serving_bench(serving)
        by_mode = {row["mode"]: row for row in report["rows"]}
        pipelined = by_mode["pipelined"]
        rows.append(
            {
                "draft": drafter,
                "target_only_tokens_per_s": round(by_mode["target-only"]["tokens_per_s"], 3),
                "unpipelined_tokens_per_s": round(by_mode["unpipelined"]["tokens_per_s"], 3),
                "pipelined_tokens_per_s": round(pipelined["tokens_per_s"], 3),
                "speedup": round(pipelined["speedup"], 3),
                "acceptance_rate": round(pipelined["acceptance_rate"], 4),
                "mean_k": round(pipelined["mean_k"], 2),
                "fraction_of_bound": round(pipelined.get("fraction_of_bound", 0.0), 3),
                "matches_target_only": pipelined["matches_target_only"],
            }
        )
    return rows


def record_winner(target: str, report: dict, path: Path | None = None) -> Path:
    """Write the measured winner for ``target`` where ``draft="auto"`` looks it up."""
    path = path or measured_drafts_file()
    record = {
        "target": target,
        "target_digest": model_digest(resolve_model_dir(target)),
        "measured": time.strftime("%Y-%m-%d"),
        "how": "specray bench --drafters all --record (held-out bench prompts, batch 1, greedy)",
        "machine": {"cpu": cpu_model(), "torch_threads": torch.get_num_threads()},
        "winner": report["winner"],
        "rows": [
            {key: row.get(key) for key in ("draft", "k", "alpha", "speedup", "tokens_per_s")}
            for row in report["rows"]
        ],
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    _log(f"winner {report['winner']} recorded in {path}")
    return path


def print_drafters_report(report: dict) -> None:
    columns = [
        ("draft", 18), ("k", 3), ("alpha", 6), ("first_position_acceptance", 6),
        ("mean_acceptance_length", 6), ("draft_cost_ratio", 6), ("tokens_per_s", 7),
        ("speedup", 7), ("bound_fraction", 6), ("matches_target_only", 6),
    ]  # fmt: skip
    titles = ["draft", "k", "alpha", "pos1", "E", "c", "tok/s", "speedup", "bound%", "exact"]
    print("  ".join(title.ljust(width) for title, (_, width) in zip(titles, columns, strict=True)))
    for row in report["rows"]:
        cells = []
        for name, width in columns:
            value = row.get(name, "")
            text = f"{value:.3f}" if isinstance(value, float) else str(value)
            cells.append(text.ljust(width))
        print("  ".join(cells))
    for row in report["rows"]:
        if row.get("draft_profile"):
            print(f"draft time, {row['draft']}: {json.dumps(row['draft_profile'])}")
    for row in report.get("pipelined", []):
        print(f"pipelined: {json.dumps(row)}")
    print(f"winner: {json.dumps(report['winner'])}")
