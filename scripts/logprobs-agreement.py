#!/usr/bin/env python3
"""How closely the bundled target's logprobs agree: with and without speculation, against a
plain transformers forward, and the runner's own one-row against (k+1)-row forwards (the float32
rounding that bounds the first). Also the cost of asking for them. Prints one JSON report.

    PYTHONPATH=. .venv/bin/python scripts/logprobs-agreement.py [--max-tokens 48] > report.json
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


def runner_rounding(model, rows: int) -> dict:
    """Raw log-probabilities of 30 tokens fed one at a time and ``rows`` at a time."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 49152, (40,), generator=generator).tolist()
    tokens = torch.randint(0, 49152, (30,), generator=generator).tolist()
    out = {}
    for tune in (True, False):
        runner = ModelRunner(model, tune=tune)
        results = []
        for step in (1, rows):
            runner.forward({"s": context}, {})
            logits = [
                runner.forward({"s": tokens[i : i + step]}, {"s": step})["s"]
                for i in range(0, len(tokens), step)
            ]
            runner.remove(["s"])
            results.append(torch.log_softmax(torch.cat(logits), -1))
        out["tuned" if tune else "F.linear"] = float((results[0] - results[1]).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    texts = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    speculative = Engine("default", "self:fp32", num_speculative_tokens=4)
    target_only = Engine("default", None)
    report: dict = {"prompts": len(texts), "max_tokens": args.max_tokens}

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
    report["runner_one_row_vs_5_rows_max_abs"] = runner_rounding(model, 5)

    # cost: the same greedy requests with and without logprobs, alternated, best of 3
    timings = {"without": [], "with": []}
    for _ in range(3):
        for name, params in (("without", plain), ("with", greedy)):
            started = time.perf_counter()
            outputs = speculative.generate(texts, params)
            elapsed = time.perf_counter() - started
            timings[name].append(sum(len(o.token_ids) for o in outputs) / elapsed)
    report["tokens_per_s"] = {name: max(values) for name, values in timings.items()}
    rates = report["tokens_per_s"]
    report["with_over_without"] = rates["with"] / rates["without"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
