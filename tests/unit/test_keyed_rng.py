"""Vectorised keyed randomness is the scalar definition, bit for bit.

The oracle is ``keyed_uniform`` (pure Python, arbitrary-precision ints masked to 64 bits): a
random 20k subset of the keys is compared against it directly, and all 10^6 keys per purpose
against the same splitmix64 written in numpy uint64 arithmetic (which wraps mod 2^64 natively,
no two's complement emulation), itself checked against the scalar oracle on that subset.
"""

import numpy as np
import pytest
import torch

from specray.sampling import KeyedRandom, Purpose, VerifyUniforms, keyed_uniform
from specray.sampling.rng import keyed_uniforms, seed_tensor

NUM_KEYS = 1_000_000
NUM_SCALAR_KEYS = 20_000
MAX_POSITION = 2**20


def _numpy_splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _numpy_keyed_uniforms(seeds: np.ndarray, positions: np.ndarray, purpose: int) -> np.ndarray:
    """seeds, positions: uint64 ``[n]`` -> float64 ``[n]``."""
    keyed = _numpy_splitmix64(_numpy_splitmix64(seeds) ^ positions)
    bits = _numpy_splitmix64(keyed ^ np.uint64(purpose))
    return ((bits >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


@pytest.fixture(scope="module")
def keys():
    generator = np.random.default_rng(20240611)
    seeds = generator.integers(0, 2**63, size=NUM_KEYS, dtype=np.int64)  # [n], 63-bit
    positions = generator.integers(0, MAX_POSITION + 1, size=NUM_KEYS, dtype=np.int64)  # [n]
    positions[:2] = (0, MAX_POSITION)  # both ends of the position range
    seeds[:2] = (0, 2**63 - 1)
    return seeds, positions


@pytest.mark.parametrize("purpose", list(Purpose))
def test_vectorised_draws_equal_the_scalar_definition(keys, purpose):
    seeds, positions = keys
    drawn = keyed_uniforms(torch.from_numpy(seeds), torch.from_numpy(positions)[:, None], purpose)[
        :, 0
    ].numpy()  # [n] float64
    reference = _numpy_keyed_uniforms(seeds.astype(np.uint64), positions.astype(np.uint64), purpose)
    assert drawn.dtype == np.float64
    mismatches = np.flatnonzero(drawn != reference)
    assert mismatches.size == 0, f"{mismatches.size} of {NUM_KEYS} keys differ from numpy"
    subset = np.random.default_rng(int(purpose)).choice(NUM_KEYS, NUM_SCALAR_KEYS, replace=False)
    subset = np.concatenate([[0, 1], subset])  # the extreme keys too
    scalar = np.array([keyed_uniform(int(seeds[i]), int(positions[i]), purpose) for i in subset])
    assert np.array_equal(drawn[subset], scalar), "vectorised != scalar keyed_uniform"
    assert np.array_equal(reference[subset], scalar), "the numpy oracle != scalar keyed_uniform"
    assert drawn.min() > 0.0 and drawn.max() < 1.0


def test_seeds_past_int64_wrap_as_the_scalar_definition_does():
    seeds = [2**64 - 1, 2**63, -5, 7]  # taken mod 2^64 by the scalar masks
    drawn = keyed_uniforms(seed_tensor(seeds), torch.tensor([[3]] * 4), Purpose.DRAFT)[:, 0]
    expected = [keyed_uniform(seed, 3, Purpose.DRAFT) for seed in seeds]
    assert drawn.tolist() == expected


def test_keyed_random_and_round_draws_match_the_scalar_keys():
    random = KeyedRandom(123456789)
    positions = [0, 5, 9, 2**20]
    assert random.uniforms(positions, Purpose.ACCEPT).tolist() == [
        keyed_uniform(123456789, p, Purpose.ACCEPT) for p in positions
    ]
    assert random.uniforms([], Purpose.BONUS).shape == (0,)
    # A round of three requests (2, 0 and 3 drafts), drawn at once, equals per-request draws.
    seeds, firsts, num_draft = [11, 22, 33], [4, 0, 17], [2, 0, 3]
    whole = VerifyUniforms.draw_round(
        seed_tensor(seeds), torch.tensor(firsts), torch.tensor(num_draft), k=3
    )
    assert whole.accept.dtype == torch.float64 and whole.accept.shape == (3, 3)
    for row, (seed, first, n) in enumerate(zip(seeds, firsts, num_draft, strict=True)):
        alone = VerifyUniforms.draw(KeyedRandom(seed), n, first)
        assert torch.equal(whole.accept[row, :n], alone.accept[0])
        assert torch.equal(whole.residual[row, :n], alone.residual[0])
        assert torch.equal(whole.bonus[row : row + 1], alone.bonus)
        assert whole.bonus[row] == keyed_uniform(seed, first + n, Purpose.BONUS)


def test_draws_are_created_on_the_requested_device():
    drawn = keyed_uniforms(
        seed_tensor([1]), torch.tensor([[0, 1]]), Purpose.RESIDUAL, device="meta"
    )
    assert drawn.device.type == "meta" and drawn.shape == (1, 2)
