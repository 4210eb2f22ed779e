"""Keyed randomness: every draw is a pure function of (seed, position, purpose).

The global RNG is never touched. Because a draw depends only on its key, a request's output
is the same whatever the batch it ran in, how its rounds were cut into blocks, whether it was
retried or which replica served it (docs/design.md 1.6).

Why reusing keys is still exact: a round at output positions ``n .. n+k`` commits tokens up to
the first rejection ``j`` using only draws keyed at positions ``<= j``; draws keyed after ``j``
were made but never influenced a committed token, so the next round's reuse of those keys is a
fresh, independent draw as far as the committed sequence is concerned.

Worked example: ``keyed_uniform(seed=7, position=0, purpose=Purpose.ACCEPT)`` always returns
the same float in (0, 1); changing any of the three inputs gives an independent one.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """What a draw decides. Distinct purposes at one position are independent."""

    DRAFT = 1  # the draft samples its proposal from q
    ACCEPT = 2  # accept a draft token with probability min(1, p/q)
    RESIDUAL = 3  # sample the recovered token from normalize(max(0, p - q))
    BONUS = 4  # sample the bonus token from p after k accepted drafts (or k = 0)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keyed_uniform(seed: int, position: int, purpose: Purpose) -> float:
    """One uniform draw in the open interval (0, 1), a pure function of its key."""
    bits = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ int(purpose))
    return ((bits >> 12) + 0.5) * 2.0**-52  # in [2^-53, 1 - 2^-53]: never 0 or 1


def random_seed() -> int:
    """A fresh seed for a request that did not bring one (reported back to the caller)."""
    return secrets.randbits(63)


class KeyedRandom:
    """The random source of one request: draws keyed by output position and purpose."""

    def __init__(self, seed: int):
        self.seed = seed

    def uniforms(self, positions: Sequence[int], purpose: Purpose) -> torch.Tensor:
        """Uniforms for the given output positions, float64 ``[len(positions)]``."""
        values = [keyed_uniform(self.seed, position, purpose) for position in positions]
        return torch.tensor(values, dtype=torch.float64)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token id per row.

    probs: ``[n, vocab]`` non-negative (need not sum to exactly 1); uniforms: ``[n]`` in (0, 1).
    Token i is chosen iff ``cdf[i-1] <= u * total < cdf[i]``, so it has probability
    ``probs[i] / total`` exactly (up to float64 rounding) and zero-probability tokens are
    never chosen.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [n, vocab]
    total = cdf[:, -1:]  # [n, 1]
    # A NaN / inf / all-zero row has no distribution: fail loudly rather than silently pick
    # the last token (which may be banned or outside allowed_token_ids).
    if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
        raise ValueError(
            "sample_from_probs needs finite, non-negative rows with positive mass; got row "
            f"sums {total.squeeze(-1).tolist()}"
        )
    targets = uniforms.to(torch.float64).reshape(-1, 1) * total  # [n, 1]
    token_ids = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # [n]
    # u * total can round up to total: fall back to the last token with positive mass.
    last_positive = (probs.shape[-1] - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(token_ids, last_positive)
