#!/usr/bin/env python3
"""How closely the bundled target's logprobs agree: with and without speculation, against a
plain transformers forward, and the runner's own one-row against (k+1)-row forwards (the float32
rounding that bounds the first). Also the cost of asking for them; with ``--batch-invariant``,
the same for the batch-invariant target and its cost against the default instead. Prints one
JSON report.

    PYTHONPATH=. .venv/bin/python scripts/logprobs-agreement.py [--max-tokens 48] \
        [--batch-invariant] > report.json
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import torch

from specray import Engine
from specray.models.runner import ModelRunner
from specray.sampling import SamplingParams


def prompts() -> list[str]:
    data = json.loads(resources.files("specray.data").joinpath("bench_prompts.json").read_text())
    return [entry if isinstance(entry, str) else entry["prompt"] for entry in data["prompts"]]


def max_gap(a, b) -> float:
    return max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True))


def runner_rounding(model, rows: int, modes) -> dict:
    """Raw log-probabilities of 30 tokens fed one at a time and ``rows`` at a time, for each
    mode: ``tuned`` (the default), ``F.linear`` (no kernel tuning), ``batch-invariant``."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 49152, (40,), generator=generator).tolist()
    tokens = torch.randint(0, 49152, (30,), generator=generator).tolist()
    options = {
        "tuned": {"tune": True},
        "F.linear": {"tune": False},
        "batch-invariant": {"batch_invariant": True},
    }
    out = {}
    for mode in modes:
        runner = ModelRunner(model, **options[mode])
        results = []
        for step in (1, rows):
            runner.forward({"s": context}, {})
            logits = [
                runner.forward({"s": tokens[i : i + step]}, {"s": step})["s"]
                for i in range(0, len(tokens), step)
            ]
            runner.remove(["s"])
            results.append(torch.log_softmax(torch.cat(logits), -1))
        out[mode] = float((results[0] - results[1]).abs().max())
    return out


def agreement(texts, greedy, speculative, target_only) -> dict:
    """Speculation on against off, and against a plain transformers forward."""
    report: dict = {}
    with_spec = speculative.generate(texts, greedy)
    without = target_only.generate(texts, greedy)
    same = [a.token_ids == b.token_ids for a, b in zip(with_spec, without, strict=True)]
    report["greedy_outputs_identical"] = sum(same)
    report["spec_vs_off_max_abs"] = max(
        max_gap(a.logprobs, b.logprobs)
        for a, b, equal in zip(with_spec, without, same, strict=True)
        if equal
    )
    report["accepted_tokens"] = sum(o.metrics.num_accepted_tokens for o in with_spec)
    model = target_only.target.model
    worst = 0.0
    with torch.inference_mode():
        for output in with_spec:
            ids = torch.tensor([output.prompt_token_ids + output.token_ids])
            rows = torch.log_softmax(model(ids).logits[0].float(), -1)
            start = len(output.prompt_token_ids) - 1
            for j, entry in enumerate(output.logprobs):
                worst = max(worst, abs(entry.logprob - float(rows[start + j, entry.token_id])))
    report["spec_vs_transformers_max_abs"] = worst
    return report


def tokens_per_s(runs: dict, texts, rounds: int = 3) -> dict:
    """``runs``: name -> (engine, params). Each one's best tokens/s over ``rounds`` turns, the
    runs alternating."""
    timings = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (engine, params) in runs.items():
            started = time.perf_counter()
            outputs = engine.generate(texts, params)
            elapsed = time.perf_counter() - started
            timings[name].append(sum(len(o.token_ids) for o in outputs) / elapsed)
    return {name: max(values) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also the batch-invariant target: its agreement, and its cost against the default",
    )
    args = parser.parse_args()
    texts = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    speculative = Engine("default", "self:fp32", num_speculative_tokens=4)
    target_only = Engine("default", None)
    report: dict = {"prompts": len(texts), "max_tokens": args.max_tokens}
    report |= agreement(texts, greedy, speculative, target_only)
    modes = ["tuned", "F.linear"]
    report["runner_one_row_vs_5_rows_max_abs"] = runner_rounding(target_only.target.model, 5, modes)
    if not args.batch_invariant:
        # cost: the same greedy requests with and without logprobs, alternated, best of 3
        runs = {"without": (speculative, plain), "with": (speculative, greedy)}
        rates = report["tokens_per_s"] = tokens_per_s(runs, texts)
        report["with_over_without"] = rates["with"] / rates["without"]
        print(json.dumps(report, indent=2))
        return
    invariant = {
        "speculative": Engine("default", "self:fp32", 4, batch_invariant=True),
        "target_only": Engine("default", None, batch_invariant=True),
    }
    report["batch_invariant"] = agreement(
        texts, greedy, invariant["speculative"], invariant["target_only"]
    )
    fresh = Engine("default", None, batch_invariant=True).target.model
    report["batch_invariant"]["runner_one_row_vs_5_rows_max_abs"] = runner_rounding(
        fresh, 5, ["batch-invariant"]
    )["batch-invariant"]
    # cost of the mode: greedy, no logprobs, default and batch-invariant engines alternated
    runs = {
        "default_target_only": (target_only, plain),
        "invariant_target_only": (invariant["target_only"], plain),
        "default_speculative": (speculative, plain),
        "invariant_speculative": (invariant["speculative"], plain),
    }
    rates = report["tokens_per_s"] = tokens_per_s(runs, texts, rounds=2)
    report["invariant_over_default"] = {
        kind: rates[f"invariant_{kind}"] / rates[f"default_{kind}"]
        for kind in ("target_only", "speculative")
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
