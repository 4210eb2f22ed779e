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


def _as_int64(value: int) -> int:
    """``value`` mod 2^64 as a two's complement int64 (how a uint64 key travels in a tensor)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


# splitmix64's constants as int64: tensor arithmetic wraps mod 2^64 like the unsigned original.
_GOLDEN_INT64 = _as_int64(0x9E3779B97F4A7C15)
_MIX1_INT64 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2_INT64 = _as_int64(0x94D049BB133111EB)


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
    """One uniform draw in the open interval (0, 1), a pure function of its key.

    The reference definition: :func:`keyed_uniforms` is the same function on tensors.
    """
    bits = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ int(purpose))
    return ((bits >> 12) + 0.5) * 2.0**-52  # in [2^-53, 1 - 2^-53]: never 0 or 1


def _shift_right(bits: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits: ``>>`` is arithmetic, so mask the copies
    of the sign bit it shifts in."""
    return (bits >> shift) & ((1 << (64 - shift)) - 1)


def _splitmix64_tensor(bits: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` elementwise on int64 (the uint64 bit patterns, two's complement)."""
    bits = bits + _GOLDEN_INT64
    bits = (bits ^ _shift_right(bits, 30)) * _MIX1_INT64
    bits = (bits ^ _shift_right(bits, 27)) * _MIX2_INT64
    return bits ^ _shift_right(bits, 31)


def seed_tensor(seeds: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Request seeds as int64 ``[len(seeds)]`` (seed mod 2^64, the bits splitmix64 sees)."""
    return torch.tensor([_as_int64(seed) for seed in seeds], dtype=torch.int64, device=device)


def keyed_uniforms(
    seeds: torch.Tensor,  # [batch] int64, from seed_tensor
    positions: torch.Tensor,  # [batch, n] int64, non-negative output positions
    purpose: Purpose | torch.Tensor,  # one for all, or int64 [n]: one per column
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`keyed_uniform` for every (seed, position) pair, float64 ``[batch, n]`` on
    ``device`` (default: the device of ``positions``); bit-identical to the scalar definition.

    Worked example: ``keyed_uniforms(seed_tensor([7]), torch.tensor([[0, 1]]), Purpose.ACCEPT)``
    equals ``[[keyed_uniform(7, 0, ACCEPT), keyed_uniform(7, 1, ACCEPT)]]`` bit for bit.
    """
    device = positions.device if device is None else device
    seeds = seeds.to(device=device, dtype=torch.int64)
    positions = positions.to(device=device, dtype=torch.int64)
    keyed = _splitmix64_tensor(_splitmix64_tensor(seeds)[:, None] ^ positions)  # [batch, n]
    purpose = purpose.to(device) if isinstance(purpose, torch.Tensor) else int(purpose)
    bits = _splitmix64_tensor(keyed ^ purpose)
    # (bits >> 12) < 2^52 and + 0.5 are exact in float64, as in the scalar definition
    return (_shift_right(bits, 12).to(torch.float64) + 0.5) * 2.0**-52


def random_seed() -> int:
    """A fresh seed for a request that did not bring one (reported back to the caller)."""
    return secrets.randbits(63)


class KeyedRandom:
    """The random source of one request: draws keyed by output position and purpose."""

    def __init__(self, seed: int):
        self.seed = seed

    def uniforms(
        self,
        positions: Sequence[int],
        purpose: Purpose,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Uniforms for the given output positions, float64 ``[len(positions)]``."""
        position_ids = torch.tensor([list(positions)], dtype=torch.int64, device=device)  # [1, n]
        return keyed_uniforms(seed_tensor([self.seed], device), position_ids, purpose)[0]


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
        raise _no_distribution(total)
    token_ids = _inverse_cdf(cdf, uniforms)  # [n]
    # u * total can round up to total: fall back to the last token with positive mass.
    return torch.minimum(token_ids, last_positive(probs))


def _inverse_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    targets = uniforms.to(torch.float64).reshape(-1, 1) * cdf[:, -1:]  # [n, 1]
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # [n]


def last_positive(probs: torch.Tensor) -> torch.Tensor:
    """Per row, the largest id with positive mass: ``[n, vocab] -> [n]``."""
    return (probs.shape[-1] - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)


def _no_distribution(total: torch.Tensor) -> ValueError:
    return ValueError(
        "sample_from_probs needs finite, non-negative rows with positive mass; got row "
        f"sums {total.squeeze(-1).tolist()}"
    )
