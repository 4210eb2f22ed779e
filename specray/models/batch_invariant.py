"""Batch-invariant forwards: a token's logits do not depend on what else is in its forward.

Float kernels block their products by shape, and so round by shape: a decode step multiplies
one row per sequence, a verification k + 1, a batch adds other requests' rows, and attention
reduces over as many slots as the longest sequence in the batch. The same token then gets
log-probabilities that differ in the fifth decimal between those forwards (docs/bench/logprobs-
2026-12-02.md), so a greedy near-tie can fall either way with and without speculation, and
logprobs differ with the batch. In this mode every product a token's row takes part in has a
shape that depends on the model alone:

- linears: rows zero-padded to a multiple of :data:`TILE_ROWS`, through oneDNN's packed
  kernel (one kernel whatever the multiple), or else one BLAS product per tile of exactly
  TILE_ROWS rows (MKL on CPUs with AMX computes a row of an 8-row product unlike the same row
  of a 16-row one; one row alone takes yet another kernel);
- attention: each KV head's query rows padded the same way; slots padded with zeros up to a
  multiple of :data:`SLOT_CHUNK`; the softmax denominator comes out of the same product as the
  numerator (a column of ones beside the values), so masked and padding slots add exact zeros
  to a reduction whose order is fixed by slot index.

Row-wise operations (norms, activations, rotary embeddings, residuals) are invariant as they
are; the log-probabilities' log-sum-exp is made so by
:func:`specray.sampling.logprobs.row_logsumexp`. Invariance holds for a given number of
threads (kernels split work, and so round, by threads; a worker runs ``num_threads``, 1 by
default). Checked bitwise on this CPU by ``tests/unit/test_batch_invariant.py``; on CUDA the
same fixed shapes apply, but cuBLAS's choice of kernel per shape is not checked here. Bitwise
on the default target and on random models of hidden size 64 and 256; on the integration
tests' smallest model (hidden 16, vocabulary 5) a log-probability was seen one or two float32
steps apart with and without speculation, in one process and at TP = 2 alike
(``tests/integration/test_distributed.py``); its linears and attention products pass the
invariance checks, and the step responsible is not found. The cost is measured in
docs/bench/history.md ("Batch-invariant forwards").
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specray.models.linears import TunedLinear, onednn_available, onednn_linear, onednn_pack

TILE_ROWS = 8  # rows of every product a token's row is part of
SLOT_CHUNK = 64  # slots attended over are padded to a multiple of this
BATCH_INVARIANT_ATTENTION = "specray_batch_invariant"


def invariant_linear(module: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    """``module``'s product with the rows zero-padded to a multiple of TILE_ROWS: through
    oneDNN with the weight packed for this CPU where :func:`make_batch_invariant` packed it, in
    one call (the weight is read once; one kernel for every row count); otherwise one product
    of exactly TILE_ROWS rows per tile, since BLAS libraries choose kernels (and so rounding)
    by shape, and some (MKL on CPUs with AMX) compute a row of an 8-row product unlike the
    same row of a 16-row one: [..., in] -> [..., out]."""
    flat = inputs.reshape(-1, module.in_features)  # [n, in]
    rows = flat.shape[0]
    padded = _pad_rows(flat, -(-rows // TILE_ROWS) * TILE_ROWS)  # [n', in]
    packed = getattr(module, "invariant_packed", None)
    if packed is not None:
        out = onednn_linear(padded, packed, module.bias)
    else:
        tiles = padded.split(TILE_ROWS)  # each [TILE_ROWS, in]
        out = torch.cat([F.linear(tile, module.weight, module.bias) for tile in tiles])
    return out[:rows].reshape(*inputs.shape[:-1], module.out_features)  # [..., out]


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` ``[..., r, c]`` with zero rows appended up to ``rows`` (itself if r == rows)."""
    missing = rows - tensor.shape[-2]
    return F.pad(tensor, (0, 0, 0, missing)) if missing else tensor


def invariant_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface, batch-invariant. query ``[b, heads, w, d]``; key and
    value ``[b, kv_heads, end, d]`` (the runner's cache views); attention_mask ``[b, 1, w,
    end]``, True where a query attends, or None: causal, the w queries being the last
    positions (a plain forward of whole sequences). Returns ``([b, w, heads, d], None)``."""
    if attention_mask is None:
        width, end = query.shape[2], key.shape[2]
        last = torch.arange(end - width, end, device=query.device)  # [w]
        attention_mask = (torch.arange(end, device=query.device) <= last[:, None])[None, None]
    if attention_mask.dtype != torch.bool:
        raise ValueError("batch-invariant attention takes boolean masks (True: attend)")
    if kwargs.get("softcap") or kwargs.get("position_bias") is not None:
        raise ValueError("batch-invariant attention supports neither softcap nor position bias")
    batch, heads, width, dim = query.shape
    kv_heads, end = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query head h reads KV head h // groups
    rows = groups * width  # a KV head's query rows, (g, j) -> g * width + j
    padded_rows = -(-rows // TILE_ROWS) * TILE_ROWS
    slots = -(-end // SLOT_CHUNK) * SLOT_CHUNK
    scale = kwargs.get("scaling") or dim**-0.5
    products = batch * kv_heads
    packed = _pad_rows(query.reshape(products, rows, dim), padded_rows)  # [p, r', d]
    keys = _pad_rows(key.reshape(products, end, dim), slots)  # [p, s, d]
    # The last column of ones sums the softmax's denominator in the numerator's product.
    values = F.pad(value.reshape(products, end, dim), (0, 1), value=1.0)
    values = _pad_rows(values, slots)  # [p, s, d + 1], padding slots all zero
    mask = attention_mask.expand(batch, 1, width, end)[:, :, None]
    mask = mask.expand(batch, kv_heads, groups, width, end).reshape(products, rows, end)
    # Padding slots are masked; padding query rows attend everywhere (dropped after).
    mask = F.pad(
        F.pad(mask, (0, slots - end), value=False), (0, 0, 0, padded_rows - rows), value=True
    )
    scores = torch.bmm(packed, keys.transpose(1, 2)) * scale  # [p, r', s]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # exact zeros where masked
    summed = torch.bmm(weights, values)[:, :rows]  # [p, r, d + 1]
    out = (summed[..., :dim] / summed[..., dim:]).reshape(batch, heads, width, dim)
    return out.transpose(1, 2).contiguous(), None  # [batch, width, heads, dim]


AttentionInterface.register(BATCH_INVARIANT_ATTENTION, invariant_attention)
AttentionMaskInterface.register(BATCH_INVARIANT_ATTENTION, sdpa_mask)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Switch ``model`` (in place) to batch-invariant linears and attention. Each linear keeps
    its module (tensor-parallel shards register their all-reduce as forward hooks on it): only
    its ``forward`` is replaced."""
    pack = onednn_available() and all(p.device.type == "cpu" for p in model.parameters())
    for linear in model.modules():
        if type(linear) is nn.Linear:
            if pack and linear.weight.dtype == torch.float32:  # oneDNN's fast kernels, packed
                linear.invariant_packed = onednn_pack(linear.weight)
            linear.forward = types.MethodType(invariant_linear, linear)
        elif isinstance(linear, (nn.Linear, TunedLinear)):
            raise ValueError(
                f"batch-invariant mode cannot rewrite a {type(linear).__name__} (a tuned or "
                "quantised linear): pass the model as loaded"
            )
    owner = model if hasattr(model, "set_attn_implementation") else model.get_decoder()
    owner.set_attn_implementation(BATCH_INVARIANT_ATTENTION)
    return model
