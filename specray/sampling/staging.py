"""Host-side staging of a forward's sampling metadata (:mod:`specray.sampling.batch_pipeline`):
lists gathered on the host stand for tensors until one upload per dtype turns them into views
of a single copy, and where each request's rows sit in the round."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace

import torch


@dataclass(frozen=True)
class Staged:
    """Stands for a tensor while the metadata is built on the host (see :class:`Staging`)."""

    index: int


class Staging:
    """Host lists gathered while building the metadata, sent to the device in one copy per
    dtype; each list is a :class:`Staged` until then, and a view of that copy after."""

    def __init__(self) -> None:
        self._values: dict[torch.dtype, list] = {torch.int64: [], torch.float32: []}
        self._spans: list[tuple[torch.dtype, int, int, bool]] = []  # dtype, start, stop, column

    def ints(self, values: Sequence[int], *, column: bool = False) -> Staged:
        return self._add(torch.int64, values, column)

    def floats(self, values: Sequence[float], *, column: bool = True) -> Staged:
        return self._add(torch.float32, values, column)  # per-row parameters: [n, 1]

    def _add(self, dtype: torch.dtype, values: Sequence, column: bool) -> Staged:
        store = self._values[dtype]
        start = len(store)
        store.extend(values)
        self._spans.append((dtype, start, len(store), column))
        return Staged(len(self._spans) - 1)

    def upload(self, device: torch.device | str) -> list[torch.Tensor]:
        """One copy per dtype, from pinned memory without waiting when the device is a GPU (a
        plain ``torch.tensor(values, device=...)`` waits for the GPU's queued work)."""
        device = torch.device(device)
        flat = {
            dtype: torch.tensor(
                values, dtype=dtype, device="cpu", pin_memory=device.type == "cuda"
            ).to(device, non_blocking=True)
            for dtype, values in self._values.items()
        }
        return [
            flat[dtype][start:stop].view(-1, 1) if column else flat[dtype][start:stop]
            for dtype, start, stop, column in self._spans
        ]

    @staticmethod
    def resolve(value, tensors: list[torch.Tensor]):
        """``value`` with each :class:`Staged` (in a field of a dataclass too) replaced."""
        if isinstance(value, Staged):
            return tensors[value.index]
        if isinstance(value, tuple):
            return tuple(Staging.resolve(item, tensors) for item in value)
        if value is None or not is_dataclass(value):
            return value
        staged = {f.name: Staging.resolve(getattr(value, f.name), tensors) for f in fields(value)}
        return replace(value, **staged)


class RowIndex:
    """Where each request's rows are: in the round, and among a chosen set of requests."""

    def __init__(self, staged: Staging, num_rows: Sequence[int]):
        self.staged, self.num_rows = staged, num_rows
        self.starts = [sum(num_rows[:i]) for i in range(len(num_rows))]

    def per_row(self, requests: list[int], value: Callable[[int], object]) -> list:
        """``value(i)`` once for each row of each request i, in order."""
        return [value(i) for i in requests for _ in range(self.num_rows[i])]

    def of(self, requests: list[int], within: list[int] | None = None) -> Staged | None:
        """The rows of ``requests``, counted in the round (``within`` None) or among the rows
        of ``within``'s requests; None when they are all of them."""
        rows, num_all = self.indices(requests, within)
        return None if len(rows) == num_all else self.staged.ints(rows)

    def indices(self, requests: list[int], within: list[int] | None) -> tuple[list[int], int]:
        """The rows of ``requests`` (see :meth:`of`), and how many rows there are in all."""
        if within is None:
            first, num_all = self.starts, sum(self.num_rows)
        else:
            first, num_all = {}, 0
            for i in within:
                first[i], num_all = num_all, num_all + self.num_rows[i]
        return [first[i] + j for i in requests for j in range(self.num_rows[i])], num_all
