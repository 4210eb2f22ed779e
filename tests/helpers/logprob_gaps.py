"""The largest difference between two runs' log-probabilities (chosen and top entries)."""

from __future__ import annotations


def largest_gap(pairs) -> float:
    """max |a - b| over each pair of entries' chosen and top log-probabilities."""
    return max(
        abs(x - y)
        for a, b in pairs
        for x, y in zip([a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs], strict=True)
    )
