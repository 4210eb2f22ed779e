"""Blocked inverse-CDF sampling (specray.sampling.block_sampling) against the full-row
definition (rng.sample_from_probs): the same tokens but where a uniform lies within float32
rounding of a block boundary, and the same distribution, measured by quadrature."""

import pytest
import torch

from specray.sampling.block_sampling import BLOCK, block_masses, sample_blocked
from specray.sampling.rng import sample_from_probs

# vocabularies: shorter than a block, whole blocks, whole blocks and a tail, Llama 3's
VOCABS = [50, 4 * BLOCK, 4 * BLOCK + 37, 128256]


def _rows(generator, n: int, vocab: int) -> torch.Tensor:
    """Softmax rows (flat to peaked) with whole zero runs, as top-k and masks leave them."""
    scale = torch.tensor([0.5, 3.0, 12.0])[torch.arange(n) % 3][:, None]
    rows = torch.softmax(torch.randn(n, vocab, generator=generator) * scale, dim=-1)
    keep = torch.rand(n, vocab, generator=generator) < 0.3
    keep[:, 0] = True
    return rows * keep  # [n, vocab], not normalised: the sampler normalises


@pytest.mark.parametrize("vocab", VOCABS)
def test_blocked_sampling_picks_the_full_row_tokens(vocab):
    generator = torch.Generator().manual_seed(vocab)
    n = 400
    rows = _rows(generator, n, vocab)
    uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
    blocked = sample_blocked(rows, uniforms)
    reference = sample_from_probs(rows, uniforms)
    assert blocked.shape == (n,) and blocked.dtype == torch.int64
    assert torch.equal(blocked, reference)
    assert bool((rows.gather(1, blocked[:, None]) > 0).all())  # never a zero-mass token


def test_a_uniform_at_the_top_picks_the_last_token_with_mass():
    vocab = 3 * BLOCK + 5
    rows = torch.zeros(2, vocab)
    rows[0, [3, BLOCK + 7]] = torch.tensor([0.25, 0.75])  # the last blocks are empty
    rows[1, [0, vocab - 1]] = 0.5  # the last, short block holds the last token
    top = torch.full((2,), 1 - 2.0**-53, dtype=torch.float64)
    assert sample_blocked(rows, top).tolist() == [BLOCK + 7, vocab - 1]
    bottom = torch.full((2,), 2.0**-53, dtype=torch.float64)
    assert sample_blocked(rows, bottom).tolist() == [3, 0]


@pytest.mark.parametrize("vocab", [50, 4 * BLOCK + 37])
def test_the_sampled_distribution_is_the_row_by_quadrature(vocab):
    """Each token's share of a fine grid of uniforms is its probability: |share - p| is at
    most one grid step plus float32 rounding of the block masses (1e-6)."""
    generator = torch.Generator().manual_seed(1)
    row = _rows(generator, 1, vocab)  # [1, vocab]
    grid = 200_000
    uniforms = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    ids = sample_blocked(row.expand(grid, vocab).contiguous(), uniforms)
    share = torch.bincount(ids, minlength=vocab).double() / grid
    probs = row[0].double() / row[0].double().sum()
    assert float((share - probs).abs().max()) <= 2 / grid + 1e-6
    # Negative control: the same check catches a distribution off by one block's mass.
    moved = probs.clone()
    moved[0] += 0.01
    moved[-1] -= 0.01
    assert float((share - moved).abs().max()) > 2 / grid + 1e-6


def test_block_masses_cover_the_row_once():
    generator = torch.Generator().manual_seed(2)
    rows = _rows(generator, 3, 4 * BLOCK + 37)
    masses = block_masses(rows)
    assert masses.shape == (3, 5) and masses.dtype == torch.float64
    assert torch.allclose(masses.sum(dim=-1), rows.double().sum(dim=-1), rtol=1e-6)
    assert torch.allclose(masses[:, -1], rows[:, 4 * BLOCK :].double().sum(dim=-1), rtol=1e-6)


@pytest.mark.parametrize("bad", ["zero", "nan", "inf"])
def test_a_row_without_a_distribution_is_refused(bad):
    rows = torch.full((2, 10), 0.1)
    rows[1] = {"zero": 0.0, "nan": float("nan"), "inf": float("inf")}[bad]
    with pytest.raises(ValueError, match="positive mass; got row sums"):
        sample_blocked(rows, torch.tensor([0.5, 0.5], dtype=torch.float64))
