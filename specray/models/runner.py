"""Batched forward for many sequences, each with its own logical KV cache.

All sequences share one preallocated :class:`~specray.models.slot_cache.SlotCache`: row r holds
its sequence's keys and values at slots ``0 .. length - 1``, a token's slot being its position.
Rows of different lengths coexist (each forward writes every row at its own next slots, and a
per-row causal mask hides the rest); a rollback (rejected draft suffix) only moves the row's
length back; a forward runs only the rows it feeds, ordered to sit next to each other so that
attention reads a view of them, never a copy.

Example: rows A (5 tokens) and B (3 tokens), fed 1 and 2 tokens:
    slots  0 1 2 3 4 5 6
    A      a a a a a n p      n: new token at position 5; p: padding (A got 1 token of 2)
    B      b b b n n . .      B's new tokens at positions 3 and 4
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Mapping, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specray.models.batch_invariant import make_batch_invariant
from specray.models.device import DeviceTimer
from specray.models.lean import LeanDecoder, attention_dtype, lean_eligible
from specray.models.linears import tune_decoder_linears, tune_head
from specray.models.packing import (
    KWARG,
    Packing,
    Segment,
    segment_layout,
    segment_rows,
    should_pack,
    use_packed_attention,
)
from specray.models.row_blocks import Block, note_block, partition, refill
from specray.models.shared_rows import Histories, trailing, widened
from specray.models.slot_cache import SlotCache

# Model families whose logits are exactly ``lm_head(hidden)``: for them the runner computes
# logits only for the rows it needs. Others go through the model's own forward with their head.
PLAIN_HEAD_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}
# Families whose attention masks the runner builds itself (``_masks``): the causal rule per
# row, and a sliding window where the family's own mask function would apply one.
SUPPORTED_TYPES = PLAIN_HEAD_TYPES
MASK_BY_LAYER_TYPE = {"qwen2", "qwen3", "smollm3"}  # they take {layer type: mask}
GROUPED_SDPA = "specray_grouped_sdpa"


def _grouped_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa", except that with a mask, grouped-query KV heads go to SDPA as
    they are instead of being copied once per query head: over the runner's strided cache
    views that copy cost up to 10x the attention itself on CPU (transformers copies to suit
    CUDA's kernels). Several new tokens per row (a verification) are packed: the G query heads
    sharing a KV head become G x width queries of it, so each KV head is read once, not G
    times (timings in docs/bench/history.md); one new token goes through SDPA's
    ``enable_gqa``."""
    batch, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    grouped = attention_mask is not None and heads != kv_heads
    if not grouped or kwargs.get("position_bias") is not None or kwargs.get("softcap"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    options = {"dropout_p": kwargs.get("dropout", 0.0), "scale": kwargs.get("scaling")}
    if width == 1:
        output = sdpa(query, key, value, attn_mask=attention_mask, enable_gqa=True, **options)
    else:
        groups = heads // kv_heads  # query head h reads KV head h // groups
        packed = query.reshape(batch, kv_heads, groups * width, dim)  # (g, j) -> g * width + j
        mask = attention_mask.unsqueeze(2).expand(-1, -1, groups, -1, -1)  # [b, 1, g, w, slots]
        mask = mask.reshape(attention_mask.shape[0], 1, groups * width, -1)
        output = sdpa(packed, key, value, attn_mask=mask, **options)  # [b, kv, g * w, dim]
        output = output.reshape(batch, heads, width, dim)
    return output.transpose(1, 2).contiguous(), None  # [batch, width, heads, dim]


AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # as "sdpa" for anyone else's call


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

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tune: bool = True,
        batch_invariant: bool = False,
        pack: bool = True,
        lean: bool = True,
    ):
        """``batch_invariant``: a token's logits bitwise the same whatever else its forward
        holds (models/batch_invariant.py); no kernel tuning then. ``pack``: rows fed different
        numbers of tokens run packed (models/packing.py); off, every row is padded to the
        longest (benchmarks compare the two). ``lean``: run the decoder through
        :class:`~specray.models.lean.LeanDecoder` where the family has one (the same logits
        without transformers' per-module dispatch; off, the model's own forward: tests compare
        the two)."""
        config = model.config
        if config.model_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported (the runner builds its "
                f"attention masks per family): use one of {sorted(SUPPORTED_TYPES)}"
            )
        self.model = model.eval()
        # Every tensor of a forward lives here; inputs are staged on the host and copied once.
        self.device = next(model.parameters()).device
        on_cpu = self.device.type == "cpu"
        self.batch_invariant = batch_invariant
        if batch_invariant:
            make_batch_invariant(model)
            tune = False
        elif config._attn_implementation == "sdpa" and on_cpu:
            # (a feature-conditioned draft wraps a transformers decoder: switch that)
            owner = model if hasattr(model, "set_attn_implementation") else model.get_decoder()
            owner.set_attn_implementation(GROUPED_SDPA)
        # Rows fed different numbers of tokens run packed (models/packing.py).
        self._packs = use_packed_attention(model) and pack
        self._windows = _windows(config)
        self._mask_by_layer_type = config.model_type in MASK_BY_LAYER_TYPE
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
        tune = tune and on_cpu  # (the kernels it chooses between are the CPU's)
        self.linear_tuning = tune_decoder_linears(decoder) if tune and decoder else None
        self._tuned_head = tune_head(head) if tune and plain_head else None
        # After tuning: the lean forward calls the tuned linears it finds.
        use_lean = lean and plain_head and not batch_invariant and lean_eligible(model)
        self._lean = LeanDecoder(model) if use_lean else None
        self.head_s = 0.0  # seconds in the head (logits), over the runner's life: benchmarks
        self.tokens_fed = 0  # tokens run through forwards, over the runner's life: metrics
        self.tokens_shared = 0  # tokens fed but copied from a row computing the same (life)
        self.histories = Histories()  # which rows hold the same cache (models/shared_rows.py)
        self.cache: SlotCache | None = None
        self.seq_ids: list[Hashable] = []  # row order of the cache
        self.lengths: list[int] = []  # tokens cached per row (slots 0 .. length - 1)
        self._blocks: list[Block] = []  # rows the latest forwards ran together (row_blocks.py)

    # ---- bookkeeping -------------------------------------------------------------------
    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.seq_ids

    def length(self, seq_id: Hashable) -> int:
        return self.lengths[self.seq_ids.index(seq_id)]

    @property
    def kv_cache_usage(self) -> float:
        """The share of the allocated KV slots (rows x slots) that hold cached tokens; 0 with
        nothing allocated."""
        cache = self.cache
        capacity = cache.row_capacity * cache.slot_capacity if cache is not None else 0
        return sum(self.lengths) / capacity if capacity else 0.0

    @property
    def num_slots(self) -> int:
        """Slots a forward over every row would attend over (before its new tokens)."""
        return max(self.lengths, default=0)

    @torch.inference_mode()
    def remove(self, seq_ids: Sequence[Hashable]) -> None:
        """Free the cache rows of finished or cancelled sequences."""
        drop = set(seq_ids) & set(self.seq_ids)
        if not drop:
            return
        self.histories.forget(list(drop))
        freed = {row for row, seq_id in enumerate(self.seq_ids) if seq_id in drop}
        if len(freed) == len(self.seq_ids):
            self.cache, self.seq_ids, self.lengths, self._blocks = None, [], [], []
            return
        # A few rows move, and rows that ran together stay together (models/row_blocks.py).
        order, self._blocks = refill(partition(self._blocks, len(self.seq_ids)), freed)
        self.cache.reorder(order, self.num_slots)
        self.seq_ids = [self.seq_ids[row] for row in order]
        self.lengths = [self.lengths[row] for row in order]
        self.cache.trim(len(order), self.num_slots)

    def rollback(self, seq_id: Hashable, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` cached tokens of a sequence (a rejected suffix)."""
        if num_tokens <= 0:
            return
        row = self.seq_ids.index(seq_id)
        if num_tokens > self.lengths[row]:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of a {self.lengths[row]}-token sequence"
            )
        self.lengths[row] -= num_tokens  # the next forward overwrites those slots
        self.histories.diverge(seq_id)

    # ---- calibration -------------------------------------------------------------------
    @torch.inference_mode()
    def time_forward(
        self, batch: int, tokens: int, *, context: int = 32, repeats: int = 3
    ) -> float:
        """Best-of-``repeats`` seconds of one forward of ``tokens`` new tokens (with logits) for
        ``batch`` sequences of ``context`` cached tokens: the cost model's measurements."""
        ids = [f"calibration-{row}" for row in range(batch)]  # strings: msgpack-safe (TP)
        # Each row its own history (its index in base vocab first): identical rows would share
        # one computation (models/shared_rows.py), and the forward timed would be one row's.
        vocab = self.vocab_size
        self.forward(
            {
                seq_id: [row % vocab, row // vocab % vocab] + [1] * (context - 2)
                for row, seq_id in enumerate(ids)
            },
            {},
        )
        best = float("inf")
        for _ in range(repeats):
            timer = DeviceTimer(self.device).start()
            self.forward({seq_id: [1] * tokens for seq_id in ids}, dict.fromkeys(ids, tokens))
            best = min(best, timer.stop().seconds())
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
        """:meth:`forward`'s work: returns ``(logits, hidden)`` (hidden ``{}`` unless asked);
        rows that would compute the same as another of this forward copy it instead."""
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
        counts = {seq_id: len(tokens) for seq_id, tokens in new_token_ids.items()}
        for seq_id, count in counts.items():  # checked before any state changes
            for name, wanted in (("num_logits", num_logits), ("num_hidden", num_hidden)):
                if seq_id in wanted and not 1 <= wanted[seq_id] <= count:
                    raise ValueError(f"{name} for {seq_id!r} must be in [1, {count}]")
            if features is not None and len(features.get(seq_id, ())) != count:
                raise ValueError(f"features for {seq_id!r} must have {count} rows")
        self.tokens_fed += sum(counts.values())
        shared = self.histories.plan(new_token_ids, features)
        if not shared:
            result = self._compute(new_token_ids, num_logits, num_hidden, features)
        else:
            result = self._compute_shared(new_token_ids, num_logits, num_hidden, features, shared)
        self.histories.advance(list(new_token_ids), shared)
        return result

    def _compute_shared(self, new_token_ids, num_logits, num_hidden, features, shared):
        """:meth:`_compute` of the rows that do not share, then each sharing row takes its
        source's new KV slots and outputs (``shared``: row -> source, same history and feed)."""
        run = {seq_id: tokens for seq_id, tokens in new_token_ids.items() if seq_id not in shared}
        run_features = None if features is None else {seq_id: features[seq_id] for seq_id in run}
        logits, hidden = self._compute(
            run, widened(num_logits, shared), widened(num_hidden, shared), run_features
        )
        cached = set(self.seq_ids)
        fresh = [seq_id for seq_id in shared if seq_id not in cached]
        used_rows, used_slots = len(self.seq_ids), self.num_slots
        self.seq_ids.extend(fresh)
        self.lengths.extend([0] * len(fresh))
        row_of = {seq_id: row for row, seq_id in enumerate(self.seq_ids)}
        self.cache.reserve(len(self.seq_ids), used_slots, used_rows, used_slots)
        copies: dict[Hashable, list[int]] = {}  # source -> the rows copying it (one copy each)
        for seq_id, source in shared.items():
            copies.setdefault(source, []).append(row_of[seq_id])
        for source, rows in copies.items():
            count = len(new_token_ids[source])
            start = self.lengths[rows[0]]  # every copy's length before this forward: the source's
            self.cache.copy_slots(row_of[source], rows, start, start + count)
        for seq_id, source in shared.items():
            count = len(new_token_ids[seq_id])
            self.lengths[row_of[seq_id]] += count
            self.tokens_shared += count
            if seq_id in num_logits:
                logits[seq_id] = trailing(logits[source], num_logits[seq_id])
            if seq_id in num_hidden:
                hidden[seq_id] = trailing(hidden[source], num_hidden[seq_id])
        for source in set(shared.values()):  # back to what the source itself asked for
            for asked, outputs in ((num_logits, logits), (num_hidden, hidden)):
                if source not in asked:
                    outputs.pop(source, None)
                elif len(outputs[source]) > asked[source]:
                    outputs[source] = outputs[source][-asked[source] :]
        return logits, hidden

    def _compute(self, new_token_ids, num_logits, num_hidden, features):
        """The forward of ``new_token_ids`` (checked): ``(logits, hidden)``."""
        hidden: dict[Hashable, torch.Tensor] = {}
        counts = {seq_id: len(tokens) for seq_id, tokens in new_token_ids.items()}
        fresh = [seq_id for seq_id in new_token_ids if seq_id not in self.seq_ids]
        self.seq_ids.extend(fresh)
        self.lengths.extend([0] * len(fresh))
        rows = [row for row, seq_id in enumerate(self.seq_ids) if counts.get(seq_id)]
        if not rows:
            return {}, hidden
        running = [self.seq_ids[row] for row in rows]
        width = max(counts[seq_id] for seq_id in running)
        # Only the rows fed in this call run (a micro-batch, or a prefill beside decoding
        # requests), and as one block of rows: attention then reads a view of their cache.
        if self.cache is None:
            self.cache = SlotCache()
        lengths = [self.lengths[row] for row in rows]
        end = max(lengths) + width  # slots attended over
        self.cache.reserve(len(self.seq_ids), end, len(self.seq_ids), self.num_slots)
        first = self._place_together(rows)
        self._blocks = note_block(self._blocks, (first, first + len(rows)))
        fed = [counts[seq_id] for seq_id in running]
        packing = None
        if self._packs and should_pack(fed):  # ragged rows: run the fed tokens only
            input_ids, token_positions, positions, token_rows, packing = self._stage_packed(
                running, new_token_ids, lengths, width
            )
        else:
            input_ids, positions = self._stage(running, new_token_ids, lengths, width)
            token_positions = positions
        feature_batch = None  # [batch, width, feature_size], zeros where padding; packed [1, T, .]
        if features is not None:
            rows = [features[seq_id].to(self.device) for seq_id in running]
            if packing is not None:
                feature_batch = torch.cat(rows)[None]
            else:
                feature_batch = rows[0].new_zeros(len(running), width, rows[0].shape[-1])
                for index, row in enumerate(rows):
                    feature_batch[index, : len(row)] = row
        packed_slots = None if packing is None else (token_rows, token_positions[0])
        self.cache.begin(first, positions, end, packed_slots)
        masks = self._masks(positions, end)
        output = self._run(input_ids, token_positions, masks, feature_batch, self.cache, packing)
        # Row i's fed tokens: output[i, :count], or packed output[0, starts[i] : + count].
        starts = list(itertools.accumulate(fed, initial=0))

        def tokens_of(index: int, start: int, stop: int) -> torch.Tensor:
            if packing is None:
                return output[index, start:stop]
            return output[0, starts[index] + start : starts[index] + stop]

        wanted = []  # (seq_id, row in this batch, first column, last column + 1) needing logits
        for index, seq_id in enumerate(running):
            count = counts[seq_id]
            self.lengths[first + index] += count
            if seq_id in num_logits:
                wanted.append((seq_id, index, count - num_logits[seq_id], count))
            if seq_id in num_hidden:  # [num_hidden, hidden_size], views of this batch
                hidden[seq_id] = tokens_of(index, count - num_hidden[seq_id], count).float()
        if not wanted:
            return {}, hidden
        # All requested rows through the head in one matmul: the head's weight is read once.
        selected = torch.cat([tokens_of(row, start, stop) for _, row, start, stop in wanted])
        started = time.perf_counter()
        logits = self._logits(selected)  # [total rows, vocab]
        self.head_s += time.perf_counter() - started
        sizes = [stop - start for _, _, start, stop in wanted]
        parts = logits.split(sizes)
        return {seq_id: part for (seq_id, *_), part in zip(wanted, parts, strict=True)}, hidden

    def _stage(self, running, new_token_ids, lengths, width):
        """The forward's token ids and positions, both ``[batch, width]`` int64 on the model's
        device: filled in one host buffer (pinned on CUDA, so the copy is asynchronous) and
        copied with one transfer. Padding ids are 0; a row's positions run on from its length
        (a token's slot is its position)."""
        batch = len(running)
        pinned = self.device.type == "cuda"
        host = torch.zeros(2, batch, width, dtype=torch.int64, device="cpu", pin_memory=pinned)
        ids, positions = host[0], host[1]
        positions += torch.arange(width, device="cpu")
        positions += torch.tensor(lengths, dtype=torch.int64, device="cpu")[:, None]
        for index, seq_id in enumerate(running):
            tokens = new_token_ids[seq_id]
            ids[index, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64, device="cpu")
        staged = host.to(self.device, non_blocking=pinned)  # [2, batch, width]
        return staged[0], staged[1]

    def _stage_packed(self, running, new_token_ids, lengths, width):
        """:meth:`_stage` for a packed forward (models/packing.py): token ids and positions
        ``[1, T]``, the padded positions ``[batch, width]`` (the masks read them), each
        token's cache row ``[T]`` and the :class:`Packing`, staged in one host buffer and
        copied with one transfer."""
        batch = len(running)
        counts = [len(new_token_ids[seq_id]) for seq_id in running]
        total = sum(counts)
        runs = segment_rows(counts)
        scatters = [segment_layout(counts, first, end) for first, end in runs]
        # The buffer: ids, positions, rows [3, T]; padded positions [batch, width]; then each
        # segment's scatter index, between bounds[i] and bounds[i + 1].
        padded_end = 3 * total + batch * width
        sizes = (len(index) if index is not None else 0 for index in scatters)
        bounds = list(itertools.accumulate(sizes, initial=padded_end))
        pinned = self.device.type == "cuda"
        host = torch.empty(bounds[-1], dtype=torch.int64, device="cpu", pin_memory=pinned)
        flat = host[: 3 * total].view(3, total)
        flat[0] = torch.as_tensor(
            [token for seq_id in running for token in new_token_ids[seq_id]],
            dtype=torch.int64,
            device="cpu",
        )
        fed = torch.as_tensor(counts, dtype=torch.int64, device="cpu")  # [batch]
        flat[2] = torch.repeat_interleave(torch.arange(batch, device="cpu"), fed)
        padded = host[3 * total : padded_end].view(batch, width)
        columns = torch.arange(width, device="cpu")
        cached = torch.as_tensor(lengths, dtype=torch.int64, device="cpu")  # [batch]
        torch.add(cached[:, None], columns, out=padded)
        flat[1] = padded[columns < fed[:, None]]  # the fed slots, row by row: the tokens' order
        for index, low, high in zip(scatters, bounds[:-1], bounds[1:], strict=True):
            if index is not None:
                host[low:high] = torch.as_tensor(index, dtype=torch.int64, device="cpu")
        staged = host.to(self.device, non_blocking=pinned)
        ids, positions, rows = staged[: 3 * total].view(3, total)
        token_starts = list(itertools.accumulate(counts, initial=0))
        segments = tuple(
            Segment(
                first,
                end - first,
                max(counts[first:end]),
                token_starts[first],
                token_starts[end] - token_starts[first],
                None if index is None else staged[low:high],
            )
            for (first, end), index, low, high in zip(
                runs, scatters, bounds[:-1], bounds[1:], strict=True
            )
        )
        padded_positions = staged[3 * total : padded_end].view(batch, width)
        return ids[None], positions[None], padded_positions, rows, Packing(segments)

    def _place_together(self, rows: list[int]) -> int:
        """Order the rows so that ``rows`` (ascending) are one block; return its first row.
        Already one block: nothing moves. Otherwise the block goes first and the other rows
        after it in their order, so two micro-batches alternating stay two blocks (one copy
        when a request joins one, none per step)."""
        if rows[-1] - rows[0] + 1 == len(rows):
            return rows[0]
        chosen = set(rows)
        order = rows + [row for row in range(len(self.seq_ids)) if row not in chosen]
        self._blocks = []  # the rows moved: the blocks before say nothing now
        self.cache.reorder(order, self.num_slots)
        self.seq_ids = [self.seq_ids[row] for row in order]
        self.lengths = [self.lengths[row] for row in order]
        return 0

    def _masks(self, positions: torch.Tensor, end: int):
        """Attention masks ``[batch, 1, width, end]`` (True: attend): token j of row i sees slots
        up to its position, and within the family's sliding window where one applies. One
        tensor, or {layer type: tensor} for families that mask per layer type."""
        slots = torch.arange(end, device=positions.device)  # [end]
        query = positions[:, None, :, None]  # [batch, 1, width, 1]
        causal = slots <= query  # [batch, 1, width, end]
        masks = {
            kind: causal if window is None else causal & (slots > query - window)
            for kind, window in self._windows.items()
        }
        return masks if self._mask_by_layer_type else masks["full_attention"]

    def _run(self, input_ids, positions, masks, feature_batch, cache, packing):
        """The model over ``[rows, width]`` tokens (or ``[1, T]`` packed): final-norm hidden
        states ``[rows, width, hidden]``, or logits ``[rows, width, vocab]`` without a plain
        head."""
        if self._lean is not None:
            embeds = None
            if feature_batch is not None:
                embeds = self.model.embed_with_features(input_ids, feature_batch)
                input_ids = None
            return self._lean(
                positions, masks, cache, packing, input_ids=input_ids, inputs_embeds=embeds
            )
        extra = {} if packing is None else {KWARG: packing}  # to attention (models/packing.py)
        common = dict(attention_mask=masks, position_ids=positions, cache=cache, use_cache=True)
        if feature_batch is not None:  # the model mixes each token's feature into its input
            embeds = self.model.embed_with_features(input_ids, feature_batch)
            return self._decoder(inputs_embeds=embeds, **common, **extra).last_hidden_state
        if self._decoder is not None:
            return self._decoder(input_ids=input_ids, **common, **extra).last_hidden_state
        return self.model(input_ids=input_ids, **common, **extra).logits

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
        lengths = [source.lengths[row] for row in rows]
        first, slots = len(self.seq_ids), max(lengths)
        if self.cache is None:
            self.cache = SlotCache()
        self.cache.reserve(first + len(rows), slots, first, self.num_slots)
        index = torch.tensor(rows, device=source.device)
        dtype = self.model.dtype
        if self._lean is not None:  # the dtype its attention caches keys and values in
            dtype = attention_dtype(dtype, self.device)
        self.cache.write_rows(
            first,
            [
                (
                    layer.keys[:, :, :slots].index_select(0, index).to(self.device, dtype),
                    layer.values[:, :, :slots].index_select(0, index).to(self.device, dtype),
                )
                for layer in source.cache.layers
            ],
        )
        self.seq_ids.extend(seq_ids)
        self.lengths.extend(lengths)
        for seq_id in seq_ids:
            self.histories.diverge(seq_id)


def _windows(config) -> dict[str, int | None]:
    """{layer type: sliding window or None} as the family's own mask functions would apply:
    per layer type for the families that mask per type; otherwise one mask, windowed when the
    config has a window (Mistral)."""
    if config.model_type in MASK_BY_LAYER_TYPE:
        windows = {"full_attention": None}
        if "sliding_attention" in config.layer_types:
            windows["sliding_attention"] = config.sliding_window
        return windows
    return {"full_attention": getattr(config, "sliding_window", None)}
