"""Does the number of rows in a forward change a row's log-probabilities on the bundled target?

Feeds 30 tokens one at a time, five at a time and three at a time after the same prompt and
prints the largest |difference| of log-softmax over the vocabulary. First argument: ``default``
(the tuned plans as they are) or a kernel name (``onednn``, ``dense``) that every linear, the
head included, then runs for every row count up to 8 with the rows padded to 8, so that the
linears compute one product shape whatever the count; a second argument ``math`` runs attention
through SDPA's math kernel. One torch thread. Record: docs/bench/logprobs-2026-12-02.md.

    PYTHONPATH=. .venv/bin/python scripts/row-count-rounding.py onednn math
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from specray.models.linears import TunedLinear
from specray.models.loading import load_model
from specray.models.runner import ModelRunner

PADDED_ROWS = 8
FED = list(range(1000, 1030))  # token ids fed after the prompt


def pad_every_count(runner: ModelRunner, kernel: str) -> None:
    linears = [module for module in runner.model.modules() if isinstance(module, TunedLinear)]
    if runner._tuned_head is not None:
        linears.append(runner._tuned_head)
    plan = tuple((kernel, min(rows, 1) * PADDED_ROWS) for rows in range(PADDED_ROWS + 1))
    for linear in linears:
        linear.set_plan(plan)


def logprobs(runner: ModelRunner, prompt: list[int], chunk: int) -> torch.Tensor:
    """[len(FED), vocab]: the log-softmax after each fed token, ``chunk`` tokens a forward."""
    runner.forward({"a": prompt[:-1]}, {})
    feed, rows = [prompt[-1], *FED], []
    for start in range(0, len(FED), chunk):
        tokens = feed[start : min(start + chunk, len(FED))]
        logits = runner.forward({"a": tokens}, {"a": len(tokens)})["a"]  # [n, vocab]
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    runner.remove(["a"])
    return torch.cat(rows)


def main() -> None:
    torch.set_num_threads(1)
    kernel = sys.argv[1] if len(sys.argv) > 1 else "default"
    loaded = load_model("default", param="target")
    runner = ModelRunner(loaded.model)
    if kernel != "default":
        pad_every_count(runner, kernel)
    prompt = loaded.tokenizer("The history of the printing press begins")["input_ids"]
    math = len(sys.argv) > 2 and sys.argv[2] == "math"
    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        one, five, three = (logprobs(runner, prompt, chunk) for chunk in (1, 5, 3))
    print(
        f"linears {kernel}, attention {'math' if math else 'default'}: max |d logprob| "
        f"1 vs 5 rows {(one - five).abs().max().item():.2e}, "
        f"1 vs 3 rows {(one - three).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()
