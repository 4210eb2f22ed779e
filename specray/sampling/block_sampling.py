"""Inverse-CDF sampling that reads each row once and writes nothing vocabulary-sized.

:func:`specray.sampling.rng.sample_from_probs` takes a float64 cumulative sum of the whole row:
a ``[n, vocab]`` float64 tensor written and read back, about twice a softmax's time on a CPU
at a 128k vocabulary. Here the row is cut into blocks of ``BLOCK`` ids:

  1. block masses: one float32 sum per block (one read of the row, no write), widened to
     float64 and accumulated across blocks;
  2. the block holding ``u * total``: a search among the ``vocab / BLOCK`` block boundaries;
  3. inside that block: a float64 cumulative sum of its ``BLOCK`` values, then a search.

Token i is chosen iff ``u * total`` falls in its share ``[before_i, before_i + p_i)``, as in
``sample_from_probs``; only the block boundaries carry float32 rounding (a block's sum, about
1e-7 of its mass), which the exactness contract allows ("compute in fp32 or wider"). A token
with zero mass is never chosen. ``u * total`` at or past a boundary that rounding moved picks
the last token with positive mass before it, as ``sample_from_probs`` does at the row's end.

Worked example (BLOCK = 2 for the example): row ``[0.1, 0.3, 0, 0.6]``, u = 0.5: block masses
``[0.4, 0.6]``, boundaries ``[0.4, 1.0]``; 0.5 lies in block 1, whose cumulative sum from 0.4
is ``[0.4, 1.0]``: token 3 (token 2 has no mass).
"""

from __future__ import annotations

import torch

from specray.sampling.rng import last_positive

BLOCK = 256  # ids per block: 501 blocks at Llama 3's 128256


def block_masses(rows: torch.Tensor) -> torch.Tensor:
    """Each block's mass, float64 ``[n, num_blocks]`` from float32 ``[n, vocab]`` (the last
    block is shorter when ``BLOCK`` does not divide the vocabulary). One read of ``rows``."""
    n, vocab = rows.shape
    full = vocab // BLOCK
    parts = []
    if full:  # a view of the whole blocks, [n, full, BLOCK]: no copy
        parts.append(rows[:, : full * BLOCK].reshape(n, full, BLOCK).sum(dim=-1))
    if vocab > full * BLOCK:
        parts.append(rows[:, full * BLOCK :].sum(dim=-1, keepdim=True))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(torch.float64)


def sample_blocked(
    rows: torch.Tensor,  # [n, vocab] float32, non-negative
    uniforms: torch.Tensor,  # [n] float64 in (0, 1)
    masses: torch.Tensor | None = None,  # [n, num_blocks] float64; None: block_masses(rows)
) -> torch.Tensor:
    """One token id per row, int64 ``[n]`` (see the module docstring). ``masses`` lets a
    caller that changed a few entries pass the block masses it corrected instead of a second
    read. Reads one flag on the host: a row without a distribution (not finite, or no mass)
    raises ValueError naming its sum."""
    n, vocab = rows.shape
    device = rows.device
    if masses is None:
        masses = block_masses(rows)
    num_blocks = masses.shape[1]
    boundaries = masses.cumsum(dim=-1)  # [n, num_blocks]
    total = boundaries[:, -1:]  # [n, 1]
    target = uniforms.to(torch.float64).reshape(n, 1) * total  # [n, 1]
    block = torch.searchsorted(boundaries, target, right=True)  # [n, 1]
    # u * total rounded up to the total: the last block with mass.
    block = torch.where(block >= num_blocks, last_positive(masses)[:, None], block)
    previous = boundaries.gather(1, (block - 1).clamp(min=0))  # [n, 1]
    before = torch.where(block > 0, previous, torch.zeros_like(previous))  # mass before it
    columns = block * BLOCK + torch.arange(BLOCK, device=device)  # [n, BLOCK]
    inside = columns < vocab  # the last block may be short
    values = rows.gather(1, columns.clamp(max=vocab - 1)).to(torch.float64) * inside
    cumulative = before + values.cumsum(dim=-1)  # [n, BLOCK]
    offset = torch.searchsorted(cumulative, target, right=True)  # [n, 1]
    # The block's float32 mass and the float64 sum of its values differ in the last bits:
    # u * total past the latter takes the block's last token with mass.
    offset = torch.where(offset >= BLOCK, last_positive(values)[:, None], offset)
    if bool((~torch.isfinite(total) | (total <= 0)).any()):  # the host read
        raise ValueError(
            "sampling needs finite, non-negative rows with positive mass; got row sums "
            f"{total.squeeze(-1).tolist()}"
        )
    return (block * BLOCK + offset).squeeze(-1)
