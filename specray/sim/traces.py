"""Acceptance traces recorded from real outputs, for the simulator to replay.

Under greedy decoding a drafter is a function of the committed context, so the whole
acceptance behaviour of one request is its trace: ``trace[t]`` = how many leading tokens of the
draft's proposal from position t (prompt plus the first t output tokens) equal the target's
output from there (the target's argmax, exactly what verification accepts). A round at
position t with k drafts then accepts ``min(trace[t], k)``, and drafts made ahead of it are
kept exactly when ``trace[t] > k`` (the draft's guess of the bonus token was the target's).

Replaying traces keeps what independent per-position draws lose: acceptance varies between
requests and comes in runs within one (a copied passage is accepted token after token), and
the coordinator's per-request estimates react to exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator itself needs neither torch nor models
    from specray.drafters import Drafter
    from specray.sampling import SamplingParams


def leading_matches(proposed: Sequence[int], actual: Sequence[int]) -> int:
    """Length of the common prefix. E.g. [5, 6, 9] against [5, 6, 7, 8]: 2."""
    count = 0
    for left, right in zip(proposed, actual, strict=False):
        if left != right:
            break
        count += 1
    return count


def record_traces(
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_k: int,
) -> list[list[int]]:
    """One trace per (prompt, greedy target output under ``params``, the run's sampling
    parameters): ``trace[t]`` for t < len(output), at most min(max_k, len(output) - t). All
    requests propose together, one call per position."""
    from specray.core import RequestState
    from specray.drafters import DraftRequest

    if len(prompts) != len(outputs):
        raise ValueError(f"prompts and outputs differ in length: {len(prompts)} != {len(outputs)}")
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
        raise ValueError(f"max_k must be a positive integer, got {max_k!r}")
    if getattr(drafter, "needs_target_features", False):
        raise ValueError("traces need a drafter without target features (it runs alone here)")
    if not params.greedy:
        raise ValueError(f"traces need greedy decoding, got temperature {params.temperature!r}")
    states = [
        RequestState.create(f"trace-{i}", list(prompt), params, 0, vocab_size, frozenset())
        for i, prompt in enumerate(prompts)
    ]
    traces: list[list[int]] = [[] for _ in outputs]
    try:
        for t in range(max(map(len, outputs), default=0)):
            live = [i for i, output in enumerate(outputs) if t < len(output)]
            requests = [
                DraftRequest(
                    states[i].request_id,
                    states[i].prompt_token_ids,
                    list(outputs[i][:t]),
                    states[i].pipeline,
                    states[i].random,
                    min(max_k, len(outputs[i]) - t),
                )
                for i in live
            ]
            for i, block in zip(live, drafter.propose(requests), strict=True):
                traces[i].append(leading_matches(block.token_ids, outputs[i][t:]))
    finally:
        drafter.release([state.request_id for state in states])
    return traces


def acceptance_from_traces(
    traces: Sequence[Sequence[int]], max_k: int | None = None
) -> list[float]:
    """Conditional per-position acceptance over every position of the traces, as if every round
    drafted max_k tokens (default: the longest run recorded, at least 1):
    α_j = #(trace >= j) / #(trace >= j - 1), j = 1 .. max_k; a position no trace reaches
    repeats the last value. E.g. traces [[2, 1, 0, 0]]: α_1 = 2/4, α_2 = 1/2."""
    values = [m for trace in traces for m in trace]
    if max_k is None:
        max_k = max(max(values, default=1), 1)
    alphas: list[float] = []
    for j in range(1, max_k + 1):
        reached = sum(m >= j - 1 for m in values)
        alphas.append(sum(m >= j for m in values) / reached if reached else (alphas or [0.0])[-1])
    return alphas
