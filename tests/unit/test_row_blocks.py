"""Freeing rows moves few rows and keeps rows that ran together one block
(specray/models/row_blocks.py), checked on random layouts; the runner's logits after such
moves are checked against recomputation in test_runner.py."""

import itertools
import random

import pytest

from specray.models.row_blocks import note_block, partition, refill


def random_layout(rng: random.Random) -> tuple[list[tuple[int, int]], set[int]]:
    """Blocks covering ``range(rows)`` and a set of rows to free."""
    rows = rng.randint(1, 24)
    cuts = sorted(rng.sample(range(1, rows), rng.randint(0, min(3, rows - 1)))) if rows > 1 else []
    bounds = [0, *cuts, rows]
    blocks = list(itertools.pairwise(bounds))
    freed = {row for row in range(rows) if rng.random() < 0.3}
    return blocks, freed


@pytest.mark.parametrize("seed", range(200))
def test_refill_keeps_every_row_and_every_block_together(seed):
    rng = random.Random(seed)
    blocks, freed = random_layout(rng)
    order, moved = refill(blocks, freed)
    rows = blocks[-1][1]
    kept = [row for row in range(rows) if row not in freed]
    assert sorted(order) == kept  # a permutation of the kept rows onto 0 .. len(kept) - 1
    survivors = [[row for row in range(start, end) if row not in freed] for start, end in blocks]
    assert len(moved) == sum(1 for rows_of in survivors if rows_of)
    for (start, end), rows_of in zip(moved, [s for s in survivors if s], strict=True):
        assert sorted(order[start:end]) == rows_of  # the block's rows, one block again
    # Each freed row costs at most one fill in its block and one row of each later block.
    copies = sum(row != i for i, row in enumerate(order))
    assert copies <= len(freed) * len(blocks)


def test_closing_the_gaps_would_move_more():
    """The oldest of 16 rows ends: one row moves (closing the gap: 15)."""
    order, moved = refill([(0, 16)], {0})
    assert sum(row != i for i, row in enumerate(order)) == 1
    assert moved == [(0, 15)]
    closed = [row for row in range(16) if row != 0]
    assert sum(row != i for i, row in enumerate(closed)) == 15


def test_a_forward_splits_the_blocks_it_overlaps():
    assert note_block([(0, 8)], (2, 5)) == [(0, 2), (2, 5), (5, 8)]
    assert note_block([(0, 4), (4, 8)], (0, 8)) == [(0, 8)]
    assert note_block([], (3, 4)) == [(3, 4)]


def test_rows_no_forward_ran_together_are_blocks_of_their_own():
    assert partition([(2, 4)], 6) == [(0, 2), (2, 4), (4, 6)]
    assert partition([(0, 9)], 5) == [(0, 5)]  # rows gone since: clipped
    assert partition([], 3) == [(0, 3)]
