"""Per-request row sets of one round as one tensor, without copying when they already are."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def consecutive_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` (each ``[n_i, vocab]``) as one ``[R, vocab]`` view when they are consecutive
    rows of one contiguous tensor (the pieces of a split, as a forward's logits and the
    pipeline's rows come), else None."""
    first = parts[0]
    address, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    if address == 0:  # no memory to compare (meta tensors)
        return None
    for part in parts:
        if (
            part.dtype != first.dtype
            or part.device != first.device
            or part.shape[1:] != first.shape[1:]
            or not part.is_contiguous()
            or part.data_ptr() != address
            or part.untyped_storage().data_ptr() != storage
        ):
            return None
        address += part.numel() * part.element_size()
    rows, vocab_size = sum(part.shape[0] for part in parts), first.shape[1]
    return first.as_strided((rows, vocab_size), (vocab_size, 1))
