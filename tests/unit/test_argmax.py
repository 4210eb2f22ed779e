"""row_argmax (specray/sampling/argmax.py) is torch.argmax: the first maximum of each row,
ties, infinities and NaN included, at vocabulary sizes that are and are not whole chunks."""

import pytest
import torch

from specray.sampling.argmax import CHUNK, MIN_VOCAB, row_argmax


@pytest.mark.parametrize("vocab", [MIN_VOCAB, 1000, 49152, 50257, 128256])
@pytest.mark.parametrize("seed", [0, 1])
def test_it_is_torch_argmax_on_random_rows_with_ties(vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values: most rows hold their maximum many times, in different chunks.
    rows = torch.randint(0, 7, (40, vocab), generator=generator).float()
    rows[1] = 3.0  # every entry a tie: 0
    rows[2, -1] = 100.0  # the last entry (in the padded chunk when vocab is not whole)
    rows[3, :] = float("-inf")  # nothing but -inf: 0
    rows[4, CHUNK + 5] = float("inf")
    rows[5, [9, CHUNK * 2 + 1]] = float("nan")  # NaN is the maximum: the first one
    rows[6] = torch.randn(vocab, generator=generator)
    assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))


def test_small_vocabularies_and_empty_batches_go_to_torch():
    rows = torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]])
    assert row_argmax(rows).tolist() == [1, 0]
    assert row_argmax(torch.zeros(0, 49152)).shape == (0,)


def test_other_devices_keep_torch_argmax():
    rows = torch.zeros(3, 49152, device="meta")
    out = row_argmax(rows)
    assert out.device.type == "meta" and out.shape == (3,)


def test_a_wrong_chunk_rule_would_be_seen():
    """Negative control: taking the last chunk holding the maximum (not the first) differs
    from torch.argmax on these rows, so the comparison above can fail."""
    rows = torch.zeros(2, 4 * CHUNK)
    rows[:, [3, 2 * CHUNK + 3]] = 1.0
    blocks = rows.reshape(2, 4, CHUNK)
    last = 3 - blocks.amax(dim=-1).flip(-1).argmax(dim=-1)
    wrong = last * CHUNK + blocks[torch.arange(2), last].argmax(dim=-1)
    assert not torch.equal(wrong, rows.argmax(dim=-1))
    assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))
