"""Per-request row sets of one round as one tensor, without copying when they already are, and
the row buffers the per-round passes reuse."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def consecutive_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` (each ``[n_i, vocab]``) as one ``[R, vocab]`` view when they are consecutive
    rows of one contiguous tensor (the pieces of a split, as a forward's logits and the
    pipeline's rows come), else None."""
    whole = rows_in_place(parts)
    if whole is None:
        return None
    base, starts = whole  # [span, vocab]
    expected = 0
    for part, start in zip(parts, starts, strict=True):
        if start != expected:
            return None
        expected += part.shape[0]
    return base


def memory_order(parts: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``parts`` by where their memory starts (stable: parts with no memory, as on
    the meta device, keep their order)."""
    return sorted(range(len(parts)), key=lambda index: parts[index].data_ptr())


def rows_in_place(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """``parts`` (each ``[n_i, vocab]``) read where they lie: ``(base [R, vocab], each part's
    first row in base)`` when they are blocks of rows of one contiguous tensor in any order (a
    forward's logits split by sequence in the cache's row order, taken in the requests' order)
    and span at most twice their rows; else None (copy them)."""
    first = parts[0]
    if first.data_ptr() == 0 or first.dim() != 2:  # no memory to compare (meta tensors)
        return None
    storage, width = first.untyped_storage().data_ptr(), first.shape[1]
    row_bytes = width * first.element_size()
    for part in parts:
        if (
            part.dtype != first.dtype
            or part.device != first.device
            or part.dim() != 2
            or part.shape[1] != width
            or not part.is_contiguous()
            or part.untyped_storage().data_ptr() != storage
        ):
            return None
    lowest = min(parts, key=lambda part: part.data_ptr())
    offsets = [part.data_ptr() - lowest.data_ptr() for part in parts]
    if any(offset % row_bytes for offset in offsets):
        return None
    starts = [offset // row_bytes for offset in offsets]
    span = max(start + part.shape[0] for start, part in zip(starts, parts, strict=True))
    if span > 2 * sum(part.shape[0] for part in parts):  # mostly rows nobody asked for
        return None
    return lowest.as_strided((span, width), (width, 1)), starts


class Workspace:
    """``[rows, vocab]`` buffers by name, kept from call to call by their owner (the batched
    logits pass, the verification rules): on a CPU a fresh output of that size per round costs
    more in page faults than the pass that fills it (docs/bench/history.md)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}  # name -> [at least rows, vocab]

    def rows(
        self, name: str, rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The first ``rows`` rows of buffer ``name``, ``[rows, vocab]``, valid until the
        next call for that name."""
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.device != device
            or buffer.shape[0] < rows
            or buffer.shape[1] != vocab_size
        ):
            buffer = torch.empty(rows, vocab_size, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:rows]
