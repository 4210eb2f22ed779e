"""Packed forwards: a batch of rows fed different numbers of tokens runs as one flat sequence.

A forward that prefills a prompt beside decoding requests used to pad every row to the
prompt's length, so each decoding row paid the prompt's compute in every linear and in
attention (15 decoding rows beside a 60-token prompt: 2.7 s against 0.29 s for the two
forwards apart, on the bundled target; docs/bench/history.md). Packed, the linears, norms and
MLPs run over the fed tokens only, ``[1, T, hidden]``. Attention, the one step that needs each
token's row, runs per segment: a run of neighbouring rows fed about as many tokens, whose
queries are a slice of the T tokens (padded only within the segment), against a view of those
rows' cache. The cache writes each token at its row and slot (``SlotCache.begin``).

Example: rows A, B, C fed 1, 1 and 40 tokens: tokens a b c0..c39; segments (A, B) of width 1
(queries [2, heads, 1, dim], a reshape of tokens 0..1) and (C) of width 40 (tokens 2..41).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PACKED_PREFIX = "specray_packed_"
KWARG = "specray_packing"  # how the runner hands the layout to attention, through the model
# A segment takes in the next row while padding leaves it at most this many times its tokens
# (or at most SMALL_SEGMENT tokens padded in all, where another attention call costs more).
MAX_PADDING_FACTOR = 2
SMALL_SEGMENT = 32


@dataclass(frozen=True)
class Segment:
    """Rows ``first_row ..`` (``rows`` of them), whose fed tokens are ``first_token ..``
    (``tokens`` of them) of the packed sequence, attending padded to ``width``."""

    first_row: int
    rows: int
    width: int
    first_token: int
    tokens: int
    # [tokens] int64: each token's index in the padded [rows * width] layout; None when every
    # row was fed ``width`` tokens (the slice is the layout already)
    scatter: torch.Tensor | None


@dataclass(frozen=True)
class Packing:
    segments: tuple[Segment, ...]


def should_pack(counts: list[int]) -> bool:
    """Rows fed different numbers of tokens (padding would compute tokens nobody needs)."""
    return len(set(counts)) > 1


def segment_rows(counts: list[int]) -> list[tuple[int, int]]:
    """Contiguous (first row, end row) runs of rows to attend together: a run grows while its
    padded size stays within MAX_PADDING_FACTOR of its tokens (or SMALL_SEGMENT). E.g. [1, 1,
    40] -> [(0, 2), (2, 3)]; [5, 1, 1, 3] -> [(0, 4)] (16 padded, 10 tokens)."""
    runs, first = [], 0
    for end in range(1, len(counts) + 1):
        if end < len(counts):
            group = counts[first : end + 1]
            padded, tokens = len(group) * max(group), sum(group)
            if padded <= max(MAX_PADDING_FACTOR * tokens, SMALL_SEGMENT):
                continue
        runs.append((first, end))
        first = end
    return runs


def segment_layout(counts: list[int], first: int, end: int) -> list[int] | None:
    """The padded-layout index of each token of rows ``first .. end - 1`` (None: no padding).
    E.g. counts [2, 1], width 2 -> [0, 1, 2]."""
    width = max(counts[first:end])
    if all(count == width for count in counts[first:end]):
        return None
    return [
        row * width + column for row in range(end - first) for column in range(counts[first + row])
    ]


def _packed(inner):
    """``inner`` (a transformers attention function) for a packed query ``[1, heads, T, dim]``
    when the call carries a :class:`Packing`; the call as is otherwise."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        packing: Packing | None = kwargs.pop(KWARG, None)
        if packing is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        heads, dim = query.shape[1], query.shape[3]
        outputs = []
        for seg in packing.segments:
            tokens = query[0, :, seg.first_token : seg.first_token + seg.tokens]  # [heads, t, d]
            if seg.scatter is not None:
                padded = tokens.new_zeros(heads, seg.rows * seg.width, dim)
                padded[:, seg.scatter] = tokens
                tokens = padded
            queries = tokens.reshape(heads, seg.rows, seg.width, dim).transpose(0, 1)
            rows = slice(seg.first_row, seg.first_row + seg.rows)
            mask = None if attention_mask is None else attention_mask[rows, :, : seg.width]
            output, _ = inner(module, queries, key[rows], value[rows], mask, **kwargs)
            output = output.reshape(seg.rows * seg.width, heads, dim)  # from [r, w, heads, d]
            outputs.append(output if seg.scatter is None else output[seg.scatter])
        return torch.cat(outputs)[None], None  # [1, T, heads, dim]

    return attention


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` (in place) to its current attention implementation wrapped to accept
    packed calls; idempotent. Unpacked calls (a plain forward of the model) are unchanged.
    False (nothing changed) for an implementation that is the model's own code ("eager"),
    which only the model's module can call: its forwards stay padded."""
    owner = model if hasattr(model, "set_attn_implementation") else model.get_decoder()
    inner = owner.config._attn_implementation or "eager"
    if inner.startswith(PACKED_PREFIX):
        return True
    if inner not in ALL_ATTENTION_FUNCTIONS:
        return False
    name = PACKED_PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _packed(ALL_ATTENTION_FUNCTIONS[inner]))
        if inner in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    owner.set_attn_implementation(name)
    return True
