"""A tensor-parallel rank's weights, read as its own shard: never the whole model in memory.

The model is built on the meta device (shapes, no storage), sharded there by
:func:`specray.models.tp.apply_tp` exactly as a loaded model would be, and then each remaining
parameter is read from the safetensors files as the slice this rank keeps: the rows (colwise)
or columns (rowwise) of its shard, whole for the embeddings, norms and head. The files are read,
not memory-mapped: a mapped column slice would make the whole tensor resident. A rank's peak
memory is then about its shard plus what every rank holds whole, instead of the full model
(figures: docs/bench/history.md, "Tensor-parallel loading").

Buffers that are not saved (the rotary embedding's inverse frequencies) are computed again on
the rank's device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specray.models.loading import _DTYPES, LoadedModel, load_tokenizer, resolve_model_dir
from specray.models.tp import apply_tp


def load_model_shard(
    source: str,
    rank: int,
    world_size: int,
    *,
    device: torch.device,
    dtype: str = "float32",
    group=None,
    param: str = "target",
) -> LoadedModel:
    """Rank ``rank`` of ``world_size``'s sharded model, loaded from ``source``'s safetensors
    (the process group must be initialised, as for :func:`apply_tp`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_dir(source, param=param)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    apply_tp(model, rank, world_size, group)
    _load_shards(model, path, rank, device, _DTYPES[dtype])
    _rebuild_buffers(model, device)
    return LoadedModel(model.eval(), load_tokenizer(path), path)


# safetensors' dtype names -> torch dtypes (the ones model weights use)
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_READ_BLOCK_BYTES = 64 << 20  # a column slice is read this many bytes of rows at a time


@dataclass(frozen=True)
class _Saved:
    """Where one tensor's bytes are in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


def _saved_tensors(path: Path) -> dict[str, _Saved]:
    """Every tensor of the directory's safetensors files, from their headers (an 8-byte
    little-endian length, then that many bytes of JSON: dtype, shape and byte range)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    saved = {}
    for file in files:
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            saved[name] = _Saved(
                file,
                _SAFETENSORS_DTYPES[entry["dtype"]],
                tuple(entry["shape"]),
                8 + length + entry["data_offsets"][0],
            )
    return saved


def _read(saved: _Saved, index: tuple[slice, ...]) -> torch.Tensor:
    """The ``index`` part of a saved tensor, read into memory of its own: rows of it as one
    read, a column range a block of rows at a time (so the whole tensor is never resident,
    as it would be through a memory map)."""
    shape = tuple(s.stop - s.start for s in index) or ()
    out = torch.empty(shape, dtype=saved.dtype)
    if not shape or len(shape) == 1 or index[1:] == tuple(slice(0, n) for n in saved.shape[1:]):
        row_bytes = out[0].numel() * out.element_size() if shape else out.element_size()
        with saved.file.open("rb", buffering=0) as handle:
            handle.seek(saved.offset + (index[0].start if shape else 0) * row_bytes)
            handle.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B"))
        return out
    if len(shape) != 2 or index[0] != slice(0, saved.shape[0]):
        raise ValueError(f"cannot read the part {index} of a tensor of shape {saved.shape}")
    rows, columns = saved.shape
    row_bytes = columns * out.element_size()
    block = max(1, _READ_BLOCK_BYTES // row_bytes)
    buffer = torch.empty(min(block, rows), columns, dtype=saved.dtype)
    with saved.file.open("rb", buffering=0) as handle:
        handle.seek(saved.offset)
        for first in range(0, rows, block):
            part = buffer[: min(block, rows - first)]
            handle.readinto(memoryview(part.view(torch.uint8).numpy()).cast("B"))
            out[first : first + len(part)] = part[:, index[1]]
    return out


def shard_slice(full: tuple[int, ...], shard: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """Which part of a saved tensor of shape ``full`` is this rank's ``shard``: the whole of
    every dimension but the one that is split (``apply_tp`` splits at most one), of which the
    ``rank``-th equal chunk.

    >>> shard_slice((8, 4), (4, 4), 1), shard_slice((8, 4), (8, 2), 0)
    ((slice(4, 8, None), slice(0, 4, None)), (slice(0, 8, None), slice(0, 2, None)))
    """
    if len(full) != len(shard):
        raise ValueError(f"a saved tensor of shape {full} cannot hold a shard of shape {shard}")
    pairs = list(enumerate(zip(full, shard, strict=True)))
    split = [dim for dim, (whole, part) in pairs if whole != part]
    if len(split) > 1 or (split and full[split[0]] % shard[split[0]]):
        raise ValueError(f"a shard of shape {shard} is not one chunk of a tensor of shape {full}")
    return tuple(
        slice(rank * part, (rank + 1) * part) if dim in split else slice(0, whole)
        for dim, (whole, part) in pairs
    )


@torch.inference_mode()
def _load_shards(model: nn.Module, path: Path, rank: int, device: torch.device, dtype) -> None:
    saved = _saved_tensors(path)
    state: dict[str, torch.Tensor] = {}
    for name, meta in model.state_dict().items():  # meta tensors: the shapes this rank keeps
        if name not in saved:
            continue  # a tied head: tied again below
        index = shard_slice(saved[name].shape, tuple(meta.shape), rank)
        state[name] = _read(saved[name], index).to(device=device, dtype=dtype)
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"{path}: no saved weights for {still_meta[:3]} (missing {missing[:3]})")


def _rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute buffers left on the meta device (not saved: built by the module's own
    constructor from the config), on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        with torch.device(device):
            fresh = type(module)(config=model.config)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, fresh)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise ValueError(f"buffers {left[:3]} could not be rebuilt off the meta device")
