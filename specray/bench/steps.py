"""One target forward through specray's runner against transformers' own KV cache, side by
side in one run: a decode step (1 new token per sequence) and a verification (k + 1 new tokens
per sequence) at several batch sizes and context lengths.

The baseline is what ``generate`` does per step: the model's forward with a ``DynamicCache``
(which appends by concatenating, so every step copies every layer's whole cache), all rows at
the same length, no padding. The runner's rows also share one length here, so both compute the
same tokens; what differs is the cache (specray's is preallocated and written in place) and the
attention kernel path. Both return logits for every new token, as a verification needs.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class StepsConfig:
    target: str = "default"
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 256)  # cached tokens per sequence before the step
    widths: tuple[int, ...] = (1, 5)  # new tokens per sequence: a decode step, k = 4
    # Mixed rounds: batch - 1 decoding rows beside a new prompt of this many tokens, packed
    # against padded (models/packing.py) and against the two forwards apart.
    mixed_prompts: tuple[int, ...] = (16, 64)
    repeats: int = 5  # best of

    def __post_init__(self) -> None:
        for name in ("batches", "contexts", "widths", "mixed_prompts"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must hold positive integers, got {values!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats!r}")


def _best_ms(step, undo, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
        undo()
    return round(1e3 * best, 2)


@torch.inference_mode()
def _transformers_ms(model, prompts: torch.Tensor, width: int, repeats: int) -> float:
    """prompts: ``[batch, context]``; one forward of ``width`` tokens per row after them."""
    from transformers import DynamicCache

    batch, context = prompts.shape
    runners_attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # the same model object (same kernels), its own path
    try:
        cache = DynamicCache(config=model.config)
        model(input_ids=prompts, cache=cache, use_cache=True)
        new = torch.ones(batch, width, dtype=torch.int64)  # [batch, width]
        positions = torch.arange(context, context + width).expand(batch, width)  # [batch, width]
        return _best_ms(
            lambda: model(input_ids=new, position_ids=positions, cache=cache, use_cache=True),
            lambda: cache.crop(-width),  # drop the step's tokens
            repeats,
        )
    finally:
        model.set_attn_implementation(runners_attention)


def _runner_ms(runner, prompts: torch.Tensor, width: int, repeats: int) -> float:
    ids = [f"row-{row}" for row in range(prompts.shape[0])]
    runner.forward({seq_id: prompts[row].tolist() for row, seq_id in enumerate(ids)}, {})
    feeds = {seq_id: [1] * width for seq_id in ids}
    try:
        return _best_ms(
            lambda: runner.forward(feeds, dict.fromkeys(ids, width)),
            lambda: [runner.rollback(seq_id, width) for seq_id in ids],
            repeats,
        )
    finally:
        runner.remove(ids)


def _mixed_ms(runner, prompts: torch.Tensor, prompt: list[int], repeats: int) -> float:
    """One forward: a decode step of every row of ``prompts`` (``[batch - 1, context]``, cached
    first) beside the prefill of ``prompt``, a new sequence (``[]``: the decode step alone;
    no rows: the prefill alone)."""
    ids = [f"row-{row}" for row in range(prompts.shape[0])]
    runner.forward({seq_id: prompts[row].tolist() for row, seq_id in enumerate(ids)}, {})
    feeds = {seq_id: [1] for seq_id in ids}
    if prompt:
        feeds["new"] = prompt
    try:
        return _best_ms(
            lambda: runner.forward(feeds, dict.fromkeys(feeds, 1)),
            lambda: [runner.rollback(seq_id, len(feed)) for seq_id, feed in feeds.items()],
            repeats,
        )
    finally:
        runner.remove([*ids, "new"])


def _mixed_rows(runner, padded, config: StepsConfig, draw: random.Random) -> list[dict]:
    """Per batch > 1, context and prompt length: the mixed forward packed and padded, and the
    decode step and the prefill as two forwards (what splitting the round would cost)."""
    rows = []
    for batch in (b for b in config.batches if b > 1):
        for context in config.contexts:
            prompts = torch.tensor(
                [
                    [draw.randrange(runner.vocab_size) for _ in range(context)]
                    for _ in range(batch - 1)
                ]
            )  # [batch - 1, context]
            for length in config.mixed_prompts:
                prompt = [draw.randrange(runner.vocab_size) for _ in range(length)]
                packed = _mixed_ms(runner, prompts, prompt, config.repeats)
                padded_ms = _mixed_ms(padded, prompts, prompt, config.repeats)
                apart = _mixed_ms(runner, prompts, [], config.repeats) + _mixed_ms(
                    runner, prompts[:0], prompt, config.repeats
                )
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "prompt": length,
                        "packed_ms": packed,
                        "padded_ms": padded_ms,
                        "apart_ms": round(apart, 2),
                        "padded_over_packed": round(padded_ms / packed, 3),
                        "apart_over_packed": round(apart / packed, 3),
                    }
                )
    return rows


def run_steps_bench(config: StepsConfig) -> dict:
    from specray.models.loading import load_model
    from specray.models.runner import ModelRunner

    loaded = load_model(config.target, param="target")
    runner = ModelRunner(loaded.model)  # tunes the model's small-batch kernels in place
    vocab = runner.vocab_size
    draw = random.Random(0)
    rows = []
    for batch in config.batches:
        for context in config.contexts:
            prompts = torch.tensor(
                [[draw.randrange(vocab) for _ in range(context)] for _ in range(batch)]
            )  # [batch, context]
            for width in config.widths:
                ours = _runner_ms(runner, prompts, width, config.repeats)
                theirs = _transformers_ms(loaded.model, prompts, width, config.repeats)
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "new_tokens": width,
                        "specray_ms": ours,
                        "transformers_ms": theirs,
                        "speedup": round(theirs / ours, 3),
                    }
                )
    padded = ModelRunner(loaded.model, tune=False, pack=False)  # the same (tuned) kernels
    mixed = _mixed_rows(runner, padded, config, draw)
    return {
        "config": asdict(config),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "mixed_rows": mixed,
    }


def format_steps(report: dict) -> str:
    lines = [
        f"one forward, best of {report['config']['repeats']}, {report['threads']} thread(s)",
        f"{'batch':>5} {'context':>7} {'new':>4} {'specray ms':>11} {'transformers ms':>16} "
        f"{'speedup':>8}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['batch']:>5} {row['context']:>7} {row['new_tokens']:>4} "
            f"{row['specray_ms']:>11.1f} {row['transformers_ms']:>16.1f} {row['speedup']:>7.2f}x"
        )
    if report.get("mixed_rows"):
        lines += [
            "",
            "a decode step of batch - 1 rows beside a new prompt, one forward",
            f"{'batch':>5} {'context':>7} {'prompt':>6} {'packed ms':>10} {'padded ms':>10} "
            f"{'two forwards ms':>16} {'padded/packed':>14}",
        ]
        for row in report["mixed_rows"]:
            lines.append(
                f"{row['batch']:>5} {row['context']:>7} {row['prompt']:>6} "
                f"{row['packed_ms']:>10.1f} {row['padded_ms']:>10.1f} {row['apart_ms']:>16.1f} "
                f"{row['padded_over_packed']:>13.2f}x"
            )
    return "\n".join(lines)
