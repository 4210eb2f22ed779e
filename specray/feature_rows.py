"""A request's target feature rows (hidden states by position): kept by the target core for a
feature-conditioned drafter, received by a draft worker with each verdict, and a draft's own
chained outputs."""

from __future__ import annotations

import torch


class FeatureRows:
    """One request's feature rows by position, a contiguous prefix (rows 0 .. len - 1) in a
    buffer that doubles when full. Rows already held are never overwritten (a committed
    position's row never changes), so views handed out stay valid while rows are added.

    Example: write(0, 3 rows) -> len 3; write(2, 2 rows) -> len 4 (row 2 kept, row 3 added);
    write(6, 1 row) -> False, len 4 (rows 4 and 5 are missing: a gap is never stored).
    """

    def __init__(self, feature_size: int):
        self.feature_size = feature_size
        self._buffer = torch.empty(0, feature_size)  # [capacity, feature_size] float32
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def write(self, start: int, rows: torch.Tensor) -> bool:
        """rows: ``[n, feature_size]``, positions start .. start + n - 1. False (nothing stored)
        when start > len: the rows in between were lost, and a prefix has no holes."""
        if start > self._count:
            return False
        new = rows[self._count - start :]  # [n', feature_size]: skip rows already held
        end = self._count + len(new)
        if end > len(self._buffer):
            grown = torch.empty(max(end, 2 * len(self._buffer), 64), self.feature_size)
            grown[: self._count] = self._buffer[: self._count]  # old views keep the old buffer
            self._buffer = grown
        self._buffer[self._count : end] = new
        self._count = end
        return True

    def truncate(self, count: int) -> None:
        self._count = min(self._count, count)

    def view(self, count: int | None = None) -> torch.Tensor:
        """The first ``min(count, len)`` rows (all by default): ``[n, feature_size]``, no copy."""
        return self._buffer[: self._count if count is None else min(count, self._count)]
