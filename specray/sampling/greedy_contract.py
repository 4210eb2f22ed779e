"""Greedy identity up to near-ties: the contract on hardware whose kernels depend on shapes.

Speculative greedy decoding verifies k + 1 rows in one forward, target-only decoding runs one
row per forward; on a GPU the two may pick different kernels and round the logits
differently in their last bits. specray's contract (README, "Greedy identity on GPUs"): the two
outputs are identical, except that they may part where the target-only run's two best logits
were within a tolerance of each other, relative to the larger magnitude: ``2^-6`` for bfloat16
and float16 targets (about two bfloat16 ulps), ``2^-16`` for float32. After such a parting the
continuations differ and are not compared. On the CPU the outputs are identical.

Worked example: reference logits ``[5.0, 4.99, 1.0]`` at the parting step are a near-tie in
bfloat16 (gap 0.01 <= 5 * 2^-6 = 0.078), not in float32 (0.01 > 5 * 2^-16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEAR_TIE_RELATIVE = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-6, torch.float32: 2.0**-16}


@dataclass(frozen=True)
class GreedyComparison:
    """Where two greedy outputs part (None: identical), and whether the contract allows it."""

    parted_at: int | None  # output position of the first different token
    gap: float | None  # the reference's top-2 logit gap there
    tolerance: float | None  # the near-tie tolerance there
    holds: bool


def near_tie_tolerance(top_logit: float, dtype: torch.dtype) -> float:
    if dtype not in NEAR_TIE_RELATIVE:
        raise ValueError(f"dtype must be one of {list(NEAR_TIE_RELATIVE)}, got {dtype}")
    return NEAR_TIE_RELATIVE[dtype] * max(1.0, abs(top_logit))


def compare_greedy(
    speculative: Sequence[int],
    reference: Sequence[int],
    reference_logits: torch.Tensor,  # [len(reference), vocab]: row j chose reference[j]
    dtype: torch.dtype,
) -> GreedyComparison:
    """Check ``speculative`` against the target-only ``reference`` under the contract."""
    if reference_logits.shape[0] < len(reference):
        raise ValueError(
            f"reference_logits needs a row per reference token ({len(reference)}), "
            f"got {reference_logits.shape[0]}"
        )
    parted = next(
        (j for j, (a, b) in enumerate(zip(speculative, reference, strict=False)) if a != b), None
    )
    if parted is None:
        # Same tokens as far as both go: one may only stop earlier (a length limit).
        return GreedyComparison(None, None, None, True)
    top2 = reference_logits[parted].float().topk(2).values.tolist()
    gap, tolerance = top2[0] - top2[1], near_tie_tolerance(top2[0], dtype)
    return GreedyComparison(parted, gap, tolerance, gap <= tolerance)
