"""Preallocated KV storage that a forward writes in place, one row per sequence.

Each decoder layer keeps keys and values as ``[row_capacity, kv_heads, slot_capacity,
head_dim]``. Row r holds its sequence's tokens at slots ``0 .. length_r - 1``, left-aligned
with no holes, so a token's slot is its position: a rollback only moves the row's length back,
and the next forward overwrites the rejected slots.

A forward runs a contiguous range of rows (the runner orders rows so that the ones it feeds
together sit together). Each running row writes its ``width`` new keys at its own slots
``length_r .. length_r + width - 1`` (the ones past its real tokens are padding, left beyond
its length); attention reads a view of the range's first ``end`` slots, masked per row by
position. Nothing is copied per step: transformers' ``DynamicCache`` concatenates (copies) every
layer's whole cache on every forward, a cost that grows with the context (what it came to:
docs/bench/history.md).

Example: rows A (length 5) and B (length 3) fed 2 and 1 tokens (width 2):
    slots  0 1 2 3 4 5 6
    A      a a a a a n n      n: new, written at positions 5, 6
    B      b b b n p . .      p: B's padding at position 4, beyond B's new length 4
"""

from __future__ import annotations

import math

import torch

MIN_ROWS = 4  # capacities grow by GROWTH and are rounded up to these multiples
MIN_SLOTS = 64
GROWTH = 1.5
SHRINK_BELOW = 0.25  # give memory back when this share of a capacity is in use ...
SHRINK_MIN_SLOTS = 1024  # ... and the slot capacity is at least this


def _capacity(needed: int, current: int, multiple: int) -> int:
    """The capacity to grow to: ``GROWTH`` times the current one at least (so growing costs
    amortised O(1) copies per slot), rounded up to ``multiple``."""
    target = max(needed, math.ceil(current * GROWTH))
    return math.ceil(target / multiple) * multiple


class SlotLayer:
    """One decoder layer's storage: ``keys`` and ``values`` ``[rows, kv_heads, slots, dim]``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys = keys
        self.values = values


class SlotCache:
    """What the model's attention calls (``update``) plus the runner's row operations.

    The runner calls :meth:`reserve` and :meth:`begin` before each forward; the model then
    calls :meth:`update` once per layer. Storage is allocated on the first ``update`` (the
    layer's head count, head size and dtype come from its keys).
    """

    def __init__(self):
        self.layers: list[SlotLayer] = []
        self.row_capacity = 0
        self.slot_capacity = 0
        self._rows = slice(0, 0)  # the rows this forward runs
        # ([batch, 1] rows, [batch, width] slots): where this forward's tokens go
        self._write = (torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 0, dtype=torch.int64))
        self._end = 0  # slots this forward attends over
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # ([T] rows, [T] slots)

    # ---- the model's side ------------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this forward's ``[batch, kv_heads, width, dim]`` keys and values of layer
        ``layer_idx``; return the running rows' keys and values over the first ``end`` slots
        (views: ``[batch, kv_heads, end, dim]``)."""
        if layer_idx == len(self.layers):
            shape = (self.row_capacity, keys.shape[1], self.slot_capacity, keys.shape[3])
            self.layers.append(SlotLayer(keys.new_zeros(shape), values.new_zeros(shape)))
        layer = self.layers[layer_idx]
        stored_keys = layer.keys[self._rows]
        stored_values = layer.values[self._rows]
        if self._packed is not None:  # keys [1, kv_heads, T, dim]: token t at its row and slot
            rows, slots = self._packed
            stored_keys[rows, :, slots] = keys[0].transpose(0, 1)  # [T, kv_heads, dim]
            stored_values[rows, :, slots] = values[0].transpose(0, 1)
        else:  # token j of row i at slot positions[i, j]: [batch, width, kv_heads, dim] views
            rows, slots = self._write
            stored_keys.transpose(1, 2)[rows, slots] = keys.transpose(1, 2)
            stored_values.transpose(1, 2)[rows, slots] = values.transpose(1, 2)
        return stored_keys[:, :, : self._end], stored_values[:, :, : self._end]

    # ---- the runner's side -----------------------------------------------------------------
    def begin(
        self,
        first_row: int,
        positions: torch.Tensor,
        end: int,
        packed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The next forward runs rows ``first_row ..`` (one per row of ``positions``), writing
        token j of row i at slot ``positions[i, j]`` (``[batch, width]``), attending over the
        first ``end`` slots. ``packed``: the forward's tokens are flat (models/packing.py),
        token t of row ``rows[t]`` going to slot ``slots[t]`` (both ``[T]``)."""
        self._rows = slice(first_row, first_row + positions.shape[0])
        # An indexed write, not a scatter: about 3x cheaper per layer for a few tokens on CPU.
        self._write = (
            torch.arange(positions.shape[0], device=positions.device)[:, None],
            positions,
        )
        self._end = end
        self._packed = packed

    @torch.inference_mode()
    def reserve(self, rows: int, slots: int, used_rows: int, used_slots: int) -> None:
        """Make room for ``rows`` rows of ``slots`` slots, keeping the first ``used_rows`` rows'
        first ``used_slots`` slots."""
        if rows <= self.row_capacity and slots <= self.slot_capacity:
            return
        self._reallocate(
            _capacity(rows, self.row_capacity, MIN_ROWS) if rows > self.row_capacity else None,
            _capacity(slots, self.slot_capacity, MIN_SLOTS) if slots > self.slot_capacity else None,
            used_rows,
            used_slots,
        )

    @torch.inference_mode()
    def trim(self, used_rows: int, used_slots: int) -> None:
        """Give memory back after long sequences left: shrink a capacity of which less than
        ``SHRINK_BELOW`` is in use."""
        slots = rows = None
        if self.slot_capacity >= SHRINK_MIN_SLOTS and used_slots < SHRINK_BELOW * (
            self.slot_capacity
        ):
            slots = _capacity(used_slots, 0, MIN_SLOTS) * 2
        if self.row_capacity > MIN_ROWS and used_rows < SHRINK_BELOW * self.row_capacity:
            rows = _capacity(max(used_rows, 1), 0, MIN_ROWS) * 2
        if slots is not None or rows is not None:
            self._reallocate(rows, slots, used_rows, used_slots)

    def _reallocate(self, rows, slots, used_rows: int, used_slots: int) -> None:
        self.row_capacity = rows if rows is not None else self.row_capacity
        self.slot_capacity = slots if slots is not None else self.slot_capacity
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                shape = (self.row_capacity, old.shape[1], self.slot_capacity, old.shape[3])
                new = old.new_zeros(shape)
                rows, slots = min(used_rows, old.shape[0]), min(used_slots, old.shape[2])
                new[:rows, :, :slots] = old[:rows, :, :slots]
                setattr(layer, name, new)

    @torch.inference_mode()
    def reorder(self, order: list[int], used_slots: int) -> None:
        """Row i becomes old row ``order[i]`` (for ``i < len(order)``; rows after are free).
        Only the rows that change are copied."""
        changed = [i for i, row in enumerate(order) if row != i]
        if not changed or not self.layers:
            return
        # [2, moved], one transfer: where the moved rows go, and where they come from
        targets, sources = torch.tensor(
            [changed, [order[i] for i in changed]], device=self.layers[0].keys.device
        )
        for layer in self.layers:
            for name in ("keys", "values"):
                stored = getattr(layer, name)[:, :, :used_slots]  # [rows, kv_heads, used, dim]
                # index_select copies first: a row may be read after another moved onto it
                stored[targets] = stored.index_select(0, sources)

    @torch.inference_mode()
    def copy_slots(self, source_row: int, rows: list[int], start: int, stop: int) -> None:
        """Set slots ``start .. stop - 1`` of ``rows`` to those of ``source_row`` in every layer
        (a row that shares another's forward: models/shared_rows.py)."""
        for layer in self.layers:
            for stored in (layer.keys, layer.values):  # [rows, kv_heads, slots, dim]
                # A copy of the source: a view spanning whole rows counts as overlapping the
                # rows written, and torch refuses that write (slots filled to capacity).
                stored[rows, :, start:stop] = stored[source_row, :, start:stop].clone()

    @torch.inference_mode()
    def write_rows(self, first_row: int, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        """Set rows ``first_row ..`` from per-layer ``(keys, values)`` ``[rows, kv_heads,
        slots, dim]`` (another runner's cache; storage must already be reserved)."""
        if not self.layers:
            for keys, values in layers:
                shape = (self.row_capacity, keys.shape[1], self.slot_capacity, keys.shape[3])
                self.layers.append(SlotLayer(keys.new_zeros(shape), values.new_zeros(shape)))
        for layer, (keys, values) in zip(self.layers, layers, strict=True):
            rows, slots = keys.shape[0], keys.shape[2]
            layer.keys[first_row : first_row + rows, :, :slots] = keys
            layer.values[first_row : first_row + rows, :, :slots] = values
