"""Rows that would compute the same thing run once: the ``n`` choices of one prompt (or the same
prompt sent by several clients at once) are prefilled by one row, and the others copy its new
KV slots and its outputs.

Sharing needs two rows to hold the same cached tokens and to be fed the same new tokens (and
the same features, for a model that reads them). Comparing histories token by token on every
forward would cost as much as the bookkeeping it saves, so each row carries a *history id*
instead: two rows have the same id only when their caches were built identically, which this
module guarantees by construction:

- a row with nothing cached has id ``EMPTY``;
- a forward gives each computed row a new id, and each row that copied a computed row that
  row's new id;
- anything else that changes a cache (a rollback, an imported row) gives the row a new id.

So equal ids mean equal caches (never the other way round: two rows that became equal by
different routes simply do not share). The tokens of a sequence and its outputs are the same
whether it shares or not (a forward is a function of its rows' histories and inputs; in
batch-invariant mode bitwise, otherwise up to the batch's own rounding).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence

import torch

EMPTY = 0  # the history id of a row with nothing cached


class Histories:
    """The history id of every cached row, and which fed rows may copy another's forward."""

    def __init__(self):
        self._ids: dict[Hashable, int] = {}
        self._new_ids = itertools.count(EMPTY + 1)

    def of(self, seq_id: Hashable) -> int:
        return self._ids.get(seq_id, EMPTY)

    def plan(
        self,
        new_token_ids: Mapping[Hashable, Sequence[int]],
        features: Mapping[Hashable, torch.Tensor] | None = None,
    ) -> dict[Hashable, Hashable]:
        """{row: the row computed in its place} for the rows of this forward that hold the same
        history as an earlier row of it and are fed the same tokens (and features)."""
        first: dict[tuple, Hashable] = {}
        shared: dict[Hashable, Hashable] = {}
        for seq_id, tokens in new_token_ids.items():
            key = (self.of(seq_id), tuple(tokens))
            source = first.setdefault(key, seq_id)
            if source == seq_id:
                continue
            if features is None or torch.equal(features[seq_id], features[source]):
                shared[seq_id] = source
        return shared

    def advance(self, fed: Sequence[Hashable], shared: Mapping[Hashable, Hashable]) -> None:
        """After a forward of ``fed`` (every row fed, sharing or not): computed rows get new
        ids, and rows that copied one get its id."""
        for seq_id in fed:
            if seq_id not in shared:
                self._ids[seq_id] = next(self._new_ids)
        for seq_id, source in shared.items():
            self._ids[seq_id] = self._ids[source]

    def diverge(self, seq_id: Hashable) -> None:
        """``seq_id``'s cache changed outside a forward (rolled back, imported): it shares with
        nothing until it is fed again alongside a row of the same new history."""
        self._ids[seq_id] = next(self._new_ids)

    def forget(self, seq_ids: Sequence[Hashable]) -> None:
        for seq_id in seq_ids:
            self._ids.pop(seq_id, None)


def widened(wanted: Mapping[Hashable, int], shared: Mapping[Hashable, Hashable]) -> dict:
    """``wanted`` (rows -> trailing positions needing an output) for the computed rows only,
    each asking for the most that it or a row copying it asks for."""
    computed = {seq_id: count for seq_id, count in wanted.items() if seq_id not in shared}
    for seq_id, source in shared.items():
        if seq_id in wanted:
            computed[source] = max(computed.get(source, 0), wanted[seq_id])
    return computed


def trailing(rows: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` rows of ``rows`` (``[n, ...]``, n >= count), as a tensor of its own
    (a caller may write into what it gets)."""
    return rows[rows.shape[0] - count :].clone()
