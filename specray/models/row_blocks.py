"""Which cache rows move when sequences leave the runner.

A forward runs one block of neighbouring rows (``ModelRunner._place_together``): every row,
or one micro-batch of two taking turns. Closing the gaps that freed rows leave moves every
row after the first one freed: when the oldest request ends, nearly the whole cache is copied
(docs/bench/history.md, "Freeing rows"). Here each block instead fills its own gaps from its
own end, and a block after freed rows moves only as many of its last rows to its front as it
must shift: a few rows move, and the rows that ran together stay one block, so the next
forward moves none.
"""

from __future__ import annotations

Block = tuple[int, int]  # rows [start, end)


def note_block(blocks: list[Block], block: Block) -> list[Block]:
    """The blocks after a forward ran ``block``: earlier blocks keep the parts it does not
    cover (ascending, disjoint)."""
    start, end = block
    kept = []
    for first, last in blocks:
        kept += [(first, min(last, start))] if first < start else []
        kept += [(max(first, end), last)] if last > end else []
    return sorted([piece for piece in kept if piece[0] < piece[1]] + [block])


def partition(blocks: list[Block], rows: int) -> list[Block]:
    """``blocks`` within ``range(rows)`` with the rows between them as blocks of their own
    (rows no forward ran together since they last moved): blocks covering every row."""
    covered, position = [], 0
    for start, end in sorted(blocks):
        start, end = max(start, position), min(end, rows)
        if start >= end:
            continue
        if start > position:
            covered.append((position, start))
        covered.append((start, end))
        position = end
    if position < rows:
        covered.append((position, rows))
    return covered


def refill(blocks: list[Block], freed: set[int]) -> tuple[list[int], list[Block]]:
    """After freeing the rows ``freed``: the new order (row i becomes old row ``order[i]``)
    and the blocks' new places. ``blocks`` cover every row (:func:`partition`).

    >>> refill([(0, 4)], {0})
    ([3, 1, 2], [(0, 3)])
    >>> refill([(0, 3), (3, 6)], {1})  # the first block fills its gap; the second moves 1 row
    ([0, 2, 5, 3, 4], [(0, 2), (2, 5)])
    """
    order: list[int] = []
    moved: list[Block] = []
    shift = 0  # rows freed before this block
    for start, end in blocks:
        kept = [row for row in range(start, end) if row not in freed]
        size = len(kept)
        # The block's own gaps, filled from its end: placed[i] goes to start + i.
        tail = iter(row for row in kept if row >= start + size)
        placed = [row if row not in freed else next(tail) for row in range(start, start + size)]
        # Then shifted down by ``shift``: its last rows move to its front.
        front = min(shift, size)
        order += placed[size - front :] + placed[: size - front]
        if size:
            moved.append((start - shift, start - shift + size))
        shift += end - start - size
    return order, moved
