"""Batched forward for many sequences, each with its own logical KV cache.

All sequences share one batched ``DynamicCache`` whose columns are *physical slots*. Each row
has a validity mask over the slots: a rollback (rejected draft suffix) simply marks the row's
last slots invalid, so no prefix is recomputed and rows of different lengths coexist. Holes are
hidden by the attention mask; positions (RoPE) come from each row's logical length. When holes
waste too many slots the cache is compacted (one gather per layer), and trailing slots that no
row uses are cropped.

Example: rows A (5 tokens) and B (3 tokens) after a right-padded prefill:
    slots  0 1 2 3 4
    A      1 1 1 1 1
    B      1 1 1 0 0      <- B's padding, masked
Feeding A 1 token and B 2 tokens appends 2 slots; A's second new slot is padding.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence

import torch
from transformers import DynamicCache

from specray.models.linears import tune_decoder_linears, tune_head

# Model families whose logits are exactly ``lm_head(hidden)``: for them the runner computes
# logits only for the rows it needs. Others go through the model's own forward with their head.
PLAIN_HEAD_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}
COMPACT_MIN_WASTED_SLOTS = 32  # compact when this many slots are wasted in the widest row ...
COMPACT_MIN_WASTED_FRACTION = 0.25  # ... and they are at least this share of all slots


def require_plain_head(model: torch.nn.Module, needed_by: str) -> None:
    """Refuse a model whose logits are not ``lm_head(hidden)`` for ``needed_by`` (a feature that
    reads or applies the head to the decoder's final-norm output directly)."""
    if model.config.model_type not in PLAIN_HEAD_TYPES:
        raise ValueError(
            f"{needed_by} needs a target whose logits are lm_head(hidden) (model types "
            f"{sorted(PLAIN_HEAD_TYPES)}), got model_type {model.config.model_type!r}"
        )


class ModelRunner:
    """Owns a model and the KV caches of the sequences it serves."""

    def __init__(self, model: torch.nn.Module, *, tune: bool = True):
        self.model = model.eval()
        config = model.config
        head = model.get_output_embeddings()
        # A reduced-vocabulary head (a distilled draft) reports the full size as out_features.
        self.vocab_size = int(getattr(head, "out_features", head.weight.shape[0]))
        plain_head = config.model_type in PLAIN_HEAD_TYPES and getattr(head, "bias", None) is None
        self._decoder = model.get_decoder() if plain_head else None
        self._head = head if plain_head else None
        # Kernels and row padding for small-batch products chosen by timing this machine
        # (models/linears.py): a 1-token step and a (k+1)-token verification then cost about
        # the same, as memory-bound products should.
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.linear_tuning = tune_decoder_linears(decoder) if tune and decoder else None
        self._tuned_head = tune_head(head) if tune and plain_head else None
        self.head_s = 0.0  # seconds in the head (logits), over the runner's life: benchmarks
        self.cache: DynamicCache | None = None
        self.seq_ids: list[Hashable] = []  # row order of the cache
        self.lengths: list[int] = []  # logical tokens cached per row
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]

    # ---- bookkeeping -------------------------------------------------------------------
    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.seq_ids

    def length(self, seq_id: Hashable) -> int:
        return self.lengths[self.seq_ids.index(seq_id)]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def _layers(self):
        return self.cache.layers if self.cache is not None else []

    @torch.inference_mode()
    def remove(self, seq_ids: Sequence[Hashable]) -> None:
        """Free the cache rows of finished or cancelled sequences."""
        drop = set(seq_ids) & set(self.seq_ids)
        if not drop:
            return
        keep = [row for row, seq_id in enumerate(self.seq_ids) if seq_id not in drop]
        self.seq_ids = [self.seq_ids[row] for row in keep]
        self.lengths = [self.lengths[row] for row in keep]
        if not keep:
            self.cache, self.valid = None, torch.zeros(0, 0, dtype=torch.bool)
            return
        index = torch.tensor(keep)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.valid = self.valid.index_select(0, index)
        self._shrink()

    @torch.inference_mode()
    def rollback(self, seq_id: Hashable, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` cached tokens of a sequence (a rejected suffix)."""
        if num_tokens <= 0:
            return
        row = self.seq_ids.index(seq_id)
        if num_tokens > self.lengths[row]:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of a {self.lengths[row]}-token sequence"
            )
        slots = self.valid[row].nonzero().squeeze(-1)  # [length]
        self.valid[row, slots[-num_tokens:]] = False
        self.lengths[row] -= num_tokens
        self._shrink()  # at batch 1 the rejected suffix is the tail: cropped, no holes left

    @torch.inference_mode()
    def _shrink(self) -> None:
        """Crop slots no row uses at the end; compact when holes waste too much."""
        used = self.valid.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0
        if width < self.num_slots:
            self.valid = self.valid[:, :width]
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        longest = max(self.lengths, default=0)
        wasted = self.num_slots - longest
        if wasted >= COMPACT_MIN_WASTED_SLOTS and wasted >= COMPACT_MIN_WASTED_FRACTION * (
            self.num_slots
        ):
            self._compact(longest)

    def _compact(self, width: int) -> None:
        """Gather each row's valid slots to the right end of a ``width``-slot cache."""
        rows = len(self.seq_ids)
        index = torch.zeros(rows, width, dtype=torch.int64)  # [rows, width]
        valid = torch.zeros(rows, width, dtype=torch.bool)
        for row in range(rows):
            slots = self.valid[row].nonzero().squeeze(-1)
            index[row, width - len(slots) :] = slots
            valid[row, width - len(slots) :] = True
        for layer in self._layers():
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            gather = index[:, None, :, None].expand(rows, heads, width, dim)
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = valid

    # ---- calibration -------------------------------------------------------------------
    @torch.inference_mode()
    def time_forward(
        self, batch: int, tokens: int, *, context: int = 32, repeats: int = 3
    ) -> float:
        """Best-of-``repeats`` seconds of one forward of ``tokens`` new tokens (with logits) for
        ``batch`` sequences of ``context`` cached tokens: the cost model's measurements."""
        ids = [f"calibration-{row}" for row in range(batch)]  # strings: msgpack-safe (TP)
        self.forward({seq_id: [1] * context for seq_id in ids}, {})
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            self.forward({seq_id: [1] * tokens for seq_id in ids}, dict.fromkeys(ids, tokens))
            best = min(best, time.perf_counter() - started)
            for seq_id in ids:
                self.rollback(seq_id, tokens)
        self.remove(ids)
        return best

    # ---- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        new_token_ids: Mapping[Hashable, Sequence[int]],
        num_logits: Mapping[Hashable, int],
        *,
        num_hidden: Mapping[Hashable, int] | None = None,
        features: Mapping[Hashable, torch.Tensor] | None = None,
    ):
        """Append tokens to sequences and return logits for the last ones.

        new_token_ids: seq_id -> tokens to append (unknown ids start new sequences).
        num_logits: seq_id -> how many trailing new positions need logits (1..len).
        num_hidden: seq_id -> how many trailing new positions need their final-norm hidden
            state (what the head reads; 1..len). Only when given, the return value is the pair
            ``(logits, hidden)`` with hidden: seq_id -> float32 ``[num_hidden, hidden_size]``.
        features: seq_id -> ``[len, feature_size]``, one per new token, for a model that reads
            a feature per token beside its embedding (``embed_with_features``: a
            feature-conditioned draft); required by such a model, refused by any other.
        Returns seq_id -> float32 logits ``[num_logits, vocab]``.
        """
        logits, hidden = self._forward(new_token_ids, num_logits, num_hidden or {}, features)
        return logits if num_hidden is None else (logits, hidden)

    def _forward(self, new_token_ids, num_logits, num_hidden, features):
        """:meth:`forward`'s work: returns ``(logits, hidden)`` (hidden ``{}`` unless asked)."""
        hidden: dict[Hashable, torch.Tensor] = {}
        reads_features = hasattr(self.model, "embed_with_features")
        if reads_features != (features is not None):
            raise ValueError(
                "features must be given exactly when the model reads them (embed_with_features)"
            )
        if (num_hidden or features is not None) and self._decoder is None:
            raise ValueError(
                f"hidden states need a model whose logits are lm_head(hidden) (model types "
                f"{sorted(PLAIN_HEAD_TYPES)}), got {self.model.config.model_type!r}"
            )
        fresh = [seq_id for seq_id in new_token_ids if seq_id not in self.seq_ids]
        if fresh:
            self._append_rows(fresh)
        if not self.seq_ids:
            return {}, hidden
        rows = len(self.seq_ids)
        counts = [len(new_token_ids.get(seq_id, ())) for seq_id in self.seq_ids]
        width = max(counts)
        if width == 0:
            return {}, hidden
        for row, seq_id in enumerate(self.seq_ids):  # checked before any state changes
            for name, wanted in (("num_logits", num_logits), ("num_hidden", num_hidden)):
                if seq_id in wanted and not 1 <= wanted[seq_id] <= counts[row]:
                    raise ValueError(f"{name} for {seq_id!r} must be in [1, {counts[row]}]")
            if features is not None and len(features.get(seq_id, ())) != counts[row]:
                raise ValueError(f"features for {seq_id!r} must have {counts[row]} rows")
        # Only the rows fed in this call run: with two micro-batches (or a prefill beside
        # decoding requests) the others would otherwise be computed as padding.
        active = [row for row in range(rows) if counts[row] or not self._layers()]
        batch = len(active)
        input_ids = torch.zeros(batch, width, dtype=torch.int64)  # [batch, width], 0 = padding
        positions = torch.zeros(batch, width, dtype=torch.int64)  # [batch, width]
        new_valid = torch.zeros(batch, width, dtype=torch.bool)  # [batch, width]
        feature_batch = None  # [batch, width, feature_size], zeros where padding
        if features is not None:
            size = next(iter(features.values())).shape[-1]
            feature_batch = torch.zeros(batch, width, size)
        for index, row in enumerate(active):
            seq_id = self.seq_ids[row]
            tokens = new_token_ids[seq_id]
            input_ids[index, : len(tokens)] = torch.as_tensor(list(tokens))
            new_valid[index, : len(tokens)] = True
            if feature_batch is not None:
                feature_batch[index, : len(tokens)] = features[seq_id]
            positions[index] = torch.arange(self.lengths[row], self.lengths[row] + width)
        if self.cache is None:
            self.cache = DynamicCache()  # full-attention layers: slots are ours to crop
        # (Before the first forward there are no layers to gather from: everyone runs.)
        subset = torch.tensor(active) if batch < rows and self._layers() else None
        old_valid = self.valid if subset is None else self.valid.index_select(0, subset)
        valid = torch.cat([old_valid, new_valid], dim=1)  # [batch, slots + width]
        attention_mask = None if bool(valid.all()) else valid.to(torch.int64)
        cache = self.cache if subset is None else self._gather(subset)
        hidden_or_logits = self._run(input_ids, positions, attention_mask, feature_batch, cache)
        if subset is None:
            self.valid = valid
        else:
            self._scatter(subset, cache, width)
            self.valid = torch.cat([self.valid, torch.zeros(rows, width, dtype=torch.bool)], 1)
            self.valid[subset] = valid
        wanted = []  # (seq_id, row in this batch, first column, last column + 1) needing logits
        for index, row in enumerate(active):
            seq_id = self.seq_ids[row]
            self.lengths[row] += counts[row]
            if seq_id in num_logits:
                wanted.append((seq_id, index, counts[row] - num_logits[seq_id], counts[row]))
            if seq_id in num_hidden:  # [num_hidden, hidden_size], views of this batch
                first = counts[row] - num_hidden[seq_id]
                hidden[seq_id] = hidden_or_logits[index, first : counts[row]].float()
        if subset is not None:
            # The rows that did not run got `width` masked slots: compact now rather than
            # carry them (every later step copies and attends over all slots) until a
            # rollback or removal happens to do it.
            self._shrink()
        if not wanted:
            return {}, hidden
        # All requested rows through the head in one matmul: the head's weight is read once.
        selected = torch.cat([hidden_or_logits[row, start:stop] for _, row, start, stop in wanted])
        started = time.perf_counter()
        logits = self._logits(selected)  # [total rows, vocab]
        self.head_s += time.perf_counter() - started
        sizes = [stop - start for _, _, start, stop in wanted]
        parts = logits.split(sizes)
        return {seq_id: part for (seq_id, *_), part in zip(wanted, parts, strict=True)}, hidden

    def _gather(self, subset: torch.Tensor) -> DynamicCache:
        """A cache holding only the ``subset`` rows (copies), for a forward over them."""
        cache = DynamicCache()
        for index, layer in enumerate(self._layers()):
            cache.update(
                layer.keys.index_select(0, subset), layer.values.index_select(0, subset), index
            )
        return cache

    def _scatter(self, subset: torch.Tensor, cache: DynamicCache, width: int) -> None:
        """Append ``width`` slots to every row: the ``subset`` rows' new keys and values from
        ``cache``; zeros (masked as invalid) for the rows that did not run."""
        for layer, ran in zip(self._layers(), cache.layers, strict=True):
            for name in ("keys", "values"):
                old = getattr(layer, name)  # [rows, heads, slots, dim]
                new = getattr(ran, name)[:, :, old.shape[2] :]  # [batch, heads, width, dim]
                grown = torch.cat([old, old.new_zeros((*old.shape[:2], width, old.shape[3]))], 2)
                grown[:, :, old.shape[2] :].index_copy_(0, subset, new)
                setattr(layer, name, grown)

    def _run(self, input_ids, positions, attention_mask, feature_batch, cache):
        if feature_batch is not None:  # the model mixes each token's feature into its input
            return self._decoder(
                inputs_embeds=self.model.embed_with_features(input_ids, feature_batch),
                attention_mask=attention_mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            ).last_hidden_state  # [rows, width, hidden]
        if self._decoder is not None:
            return self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            ).last_hidden_state  # [rows, width, hidden]
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).logits  # [rows, width, vocab]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: ``[n, hidden]`` (or already ``[n, vocab]`` without a plain head)."""
        if self._head is None:
            return rows.float()
        if self._tuned_head is not None:
            return self._tuned_head(rows).float()  # [n, vocab]
        return self._head(rows).float()  # [n, vocab]

    @torch.inference_mode()
    def import_rows(self, source: ModelRunner, seq_ids: Sequence[Hashable]) -> None:
        """Adopt other sequences' KV caches from a runner of the same architecture (cast to
        this runner's dtype). A self-draft uses it to start from the target's prompt cache
        instead of recomputing it at its own, slower, precision."""
        rows = [source.seq_ids.index(seq_id) for seq_id in seq_ids]
        if not rows or source.cache is None:
            return
        if any(seq_id in self.seq_ids for seq_id in seq_ids):
            raise ValueError("import_rows: a sequence is already cached here")
        index = torch.tensor(rows)
        width = max(self.num_slots, source.num_slots)
        dtype = self.model.dtype

        def pad(tensor: torch.Tensor, slots_dim: int) -> torch.Tensor:  # right-pad to width
            missing = width - tensor.shape[slots_dim]
            if missing == 0:
                return tensor
            shape = list(tensor.shape)
            shape[slots_dim] = missing
            return torch.cat([tensor, tensor.new_zeros(shape)], dim=slots_dim)

        imported = [
            (
                pad(layer.keys.index_select(0, index).to(dtype), 2),
                pad(layer.values.index_select(0, index).to(dtype), 2),
            )
            for layer in source.cache.layers
        ]
        if self.cache is None:
            self.cache = DynamicCache()  # full-attention layers: slots are ours to crop
            for layer_index, (keys, values) in enumerate(imported):
                self.cache.update(keys, values, layer_index)
            self.valid = pad(source.valid.index_select(0, index), 1)
        else:
            for layer, (keys, values) in zip(self.cache.layers, imported, strict=True):
                layer.keys = torch.cat([pad(layer.keys, 2), keys])
                layer.values = torch.cat([pad(layer.values, 2), values])
            self.valid = torch.cat(
                [pad(self.valid, 1), pad(source.valid.index_select(0, index), 1)]
            )
        self.seq_ids.extend(seq_ids)
        self.lengths.extend(source.lengths[row] for row in rows)

    def _append_rows(self, seq_ids: Sequence[Hashable]) -> None:
        """Register new, empty sequences: add cache rows whose slots are all invalid."""
        added = len(seq_ids)
        self.seq_ids.extend(seq_ids)
        self.lengths.extend([0] * added)
        self.valid = torch.cat([self.valid, torch.zeros(added, self.num_slots, dtype=torch.bool)])
        for layer in self._layers():
            pad = layer.keys.new_zeros((added, *layer.keys.shape[1:]))
            layer.keys = torch.cat([layer.keys, pad])
            layer.values = torch.cat([layer.values, pad.clone()])
