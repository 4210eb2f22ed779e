"""Per-request rows read where a forward left them, whatever the requests' order: the row
argmax of greedy requests whose logits nothing processes takes no ``[R, vocab]`` copy."""

from __future__ import annotations

import random

import torch
from torch.overrides import TorchFunctionMode

from specray.sampling.argmax import row_argmax
from specray.sampling.batch_pipeline import raw_argmax_rows
from specray.sampling.rows import rows_in_place


class _Cats(TorchFunctionMode):
    """The rows each ``torch.cat`` call of vocabulary-wide tensors copied."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.rows = width, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.cat:
            parts = args[0]
            if parts and parts[0].dim() == 2 and parts[0].shape[1] == self.width:
                self.rows.append(sum(part.shape[0] for part in parts))
        return func(*args, **(kwargs or {}))


def _split(rows: list[int], width: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = torch.randn(sum(rows), width, generator=torch.Generator().manual_seed(seed))
    return flat, list(flat.split(rows))


def test_blocks_of_one_tensor_in_any_order_are_found_where_they_lie():
    rng = random.Random(3)
    for trial in range(50):
        rows = [rng.randint(1, 4) for _ in range(rng.randint(1, 12))]
        flat, parts = _split(rows, 40, trial)
        order = list(range(len(parts)))
        rng.shuffle(order)
        taken = [parts[i] for i in order]
        base, starts = rows_in_place(taken)
        assert base.shape == flat.shape and base.data_ptr() == flat.data_ptr()
        for part, start in zip(taken, starts, strict=True):
            assert torch.equal(base[start : start + part.shape[0]], part)


def test_parts_that_are_not_rows_of_one_tensor_are_refused():
    flat, parts = _split([2, 3, 1], 30, 0)
    assert rows_in_place([parts[0], torch.randn(3, 30)]) is None  # another tensor
    assert rows_in_place([parts[0], flat[:, :20]]) is None  # not whole rows
    assert rows_in_place([flat.view(-1)[5:35].view(1, 30), parts[2]]) is None  # mid-row start
    assert rows_in_place([flat[:1], flat[5:6]]) is None  # 6 rows spanned for 2 asked
    assert rows_in_place([flat.t().contiguous()[:1]]) is not None  # (one contiguous row)
    assert rows_in_place([torch.empty(2, 30, device="meta")]) is None
    assert rows_in_place([flat[:1], flat[2:3]]) is not None  # a gap of one row: read past it


def test_greedy_rows_out_of_order_take_their_argmax_without_a_copy():
    """16 requests of 1 or 3 rows, taken in an order other than the forward's rows (as after
    refilled rows): the same ids as each part's own argmax, and no vocabulary-wide cat; parts
    of separate tensors are copied once (the control)."""
    vocab = 4096
    for rows in ([1] * 16, [3] * 16):
        _, parts = _split(rows, vocab, 7)
        taken = parts[::-1]
        with _Cats(vocab) as cats:
            got = raw_argmax_rows(taken)
        assert cats.rows == []
        assert all(torch.equal(ids, row_argmax(part)) for ids, part in zip(got, taken, strict=True))
        apart = [part.clone() for part in taken]
        with _Cats(vocab) as cats:
            got = raw_argmax_rows(apart)
        assert cats.rows == [sum(rows)]
        assert all(torch.equal(ids, row_argmax(part)) for ids, part in zip(got, apart, strict=True))
