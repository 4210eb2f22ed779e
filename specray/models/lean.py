"""A Llama-family decoder's forward as plain tensor calls, for the runner's forwards.

Around the products of a small forward (a draft step's one token per row, a decode step of a
small target), transformers' module dispatch and keyword plumbing cost about a tenth of the
step here (timings in docs/bench/history.md, "A lean forward for the draft"). This forward
computes the same function from the same modules' weights with the fewest calls: one RMSNorm
kernel, rotary embeddings computed once per forward, attention through the attention function
the model is configured with (the runner's grouped and packed SDPA), the cache written through
:class:`SlotCache.update`. In a small decoder (a draft) a layer's q/k/v and gate/up products
are fused into one each, plain or weight-only int8 (models/int8.py); tuned linears
(models/linears.py) run their own measured kernels.

It gives the model's own logits (to the bit here: fp32 with tuned linears on the target, fp16 and
int8 on the shipped draft; tests/unit/test_runner.py checks it against recomputation), and the
runner computes through it wherever a family has one: a target step of the bundled model took
about 7 % less. Families whose layers hold more than this (q/k norms, per-layer rope switches),
tensor-parallel shards (their all-reduce is a hook) and batch-invariant runners keep the model's
forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specray.models.int8 import Int8Linear
from specray.models.linears import TunedLinear
from specray.models.packing import KWARG

LEAN_TYPES = {"llama", "mistral", "qwen2"}
LINEAR_TYPES = (nn.Linear, Int8Linear, TunedLinear)
# Fused q/k/v and gate/up products are copies of the weights: made only for a decoder this
# small (a draft), where a call's overhead is the size of its product. A large model's
# products dwarf that overhead, and a second copy of its weights may not fit beside it.
MAX_FUSED_BYTES = 64 * 2**20
Product = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]
GroupProduct = Callable[[torch.Tensor], Sequence[torch.Tensor]]  # one output per linear


def _layer_linears(layer: nn.Module) -> list[list[nn.Module]]:
    """A layer's linears in the groups the lean forward multiplies as one."""
    attention, mlp = layer.self_attn, layer.mlp
    return [
        [attention.q_proj, attention.k_proj, attention.v_proj],
        [attention.o_proj],
        [mlp.gate_proj, mlp.up_proj],
        [mlp.down_proj],
    ]


def lean_eligible(model: nn.Module) -> bool:
    """A decoder this module computes as transformers would: a supported family whose linears
    are plain (``nn.Linear``, :class:`Int8Linear` or :class:`TunedLinear`, one kind per group;
    no hooks: a tensor-parallel shard keeps the model's forward) and whose attention is a
    registered function."""
    config = model.config
    if config.model_type not in LEAN_TYPES or not hasattr(model, "get_decoder"):
        return False
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return False
    if (config._attn_implementation or "eager") not in ALL_ATTENTION_FUNCTIONS:
        return False
    for layer in decoder.layers:
        for group in _layer_linears(layer):
            kinds = {type(linear) for linear in group}
            if len(kinds) != 1 or kinds.pop() not in LINEAR_TYPES:
                return False
            if any(linear._forward_hooks or linear._forward_pre_hooks for linear in group):
                return False
    return True


def _single(linear: nn.Module) -> Product:
    """``linear``'s product: ``F.linear`` on a plain one's weight, else its own forward (an
    int8 or a tuned linear runs its kernel)."""
    if type(linear) is nn.Linear:
        return functools.partial(
            F.linear, weight=linear.weight.detach(), bias=_detached(linear.bias)
        )
    return linear.forward


def _side_by_side(group: list[nn.Module], fuse: bool) -> GroupProduct:
    """``group``'s outputs for one input. ``fuse``: one product over a concatenated copy of
    their weights (plain or int8 linears); otherwise, and always for tuned linears (each
    matrix's kernel plan is measured on this machine), each linear's own product."""
    if not fuse or type(group[0]) is TunedLinear:
        products = [_single(linear) for linear in group]
        return lambda inputs: [product(inputs) for product in products]
    sizes = [linear.out_features for linear in group]
    if type(group[0]) is Int8Linear:
        fused = Int8Linear.side_by_side(group).forward
    else:
        weight = torch.cat([linear.weight.detach() for linear in group])
        bias = None
        if any(linear.bias is not None for linear in group):
            bias = torch.cat([_bias_or_zeros(linear) for linear in group]).detach()
        fused = functools.partial(F.linear, weight=weight, bias=bias)
    return lambda inputs: fused(inputs).split(sizes, dim=-1)


def _weight_bytes(decoder: nn.Module) -> int:
    return sum(
        linear.weight.numel() * linear.weight.element_size()
        for layer in decoder.layers
        for group in _layer_linears(layer)
        for linear in group
    )


def _bias_or_zeros(linear: nn.Linear) -> torch.Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


@dataclass(frozen=True)
class _Layer:
    index: int
    attention: nn.Module  # handed to the attention function, as the model does
    input_norm: tuple[torch.Tensor, float]  # (weight [H], eps)
    post_norm: tuple[torch.Tensor, float]
    qkv: GroupProduct  # [..., H] -> ([..., q], [..., kv], [..., kv])
    out: Product  # [..., q] -> [..., H]
    gate_up: GroupProduct  # [..., H] -> ([..., I], [..., I])
    down: Product  # [..., I] -> [..., H]
    act: Callable[[torch.Tensor], torch.Tensor]
    mask_kind: str  # which mask of a per-layer-type dict this layer reads
    extra: dict  # keyword arguments the family's attention passes (a sliding window)


@functools.cache  # (asked for every layer of every forward)
def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the lean forward attends in, and caches keys and values in, for activations of
    ``dtype`` on ``device``: float32 for half precision on a CPU, whose attention kernels
    emulate half-precision arithmetic (a draft step's one query over 128 cached slots took 6x
    as long in bfloat16 here: docs/bench/history.md); ``dtype`` elsewhere. The layer's other
    products stay in ``dtype`` (an int8 linear's kernel wants bfloat16 rows)."""
    on_cpu = torch.device(device).type == "cpu"
    return torch.float32 if on_cpu and dtype in (torch.bfloat16, torch.float16) else dtype


def _rms_norm(hidden: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalised in float32, scaled in the input's dtype."""
    weight, eps = norm
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=eps)
    return weight * normed.to(hidden.dtype)


def _rotated(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``[batch, heads, width, dim]`` at ``cos``/``sin`` ``[batch, 1, width,
    dim]`` (the half-split convention of the Llama family)."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


class LeanDecoder:
    """``decoder``'s forward (final-norm hidden states) from its modules' weights. The fused
    weights are copies made once; the model's own forward keeps working beside it."""

    def __init__(self, model: nn.Module):
        if not lean_eligible(model):
            raise ValueError(
                f"model_type {model.config.model_type!r} has no lean forward: use one of "
                f"{sorted(LEAN_TYPES)} with plain linears"
            )
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.attend = ALL_ATTENTION_FUNCTIONS[config._attn_implementation or "eager"]
        self.norm = (decoder.norm.weight.detach(), decoder.norm.variance_epsilon)
        silu = config.hidden_act == "silu"
        layer_types = getattr(config, "layer_types", None)
        fuse = _weight_bytes(decoder) <= MAX_FUSED_BYTES
        self.layers = []
        for index, layer in enumerate(decoder.layers):
            attention, mlp = layer.self_attn, layer.mlp
            groups = _layer_linears(layer)
            window = getattr(attention, "sliding_window", None)
            self.layers.append(
                _Layer(
                    index=index,
                    attention=attention,
                    input_norm=(
                        layer.input_layernorm.weight.detach(),
                        layer.input_layernorm.variance_epsilon,
                    ),
                    post_norm=(
                        layer.post_attention_layernorm.weight.detach(),
                        layer.post_attention_layernorm.variance_epsilon,
                    ),
                    qkv=_side_by_side(groups[0], fuse),
                    out=_single(attention.o_proj),
                    gate_up=_side_by_side(groups[2], fuse),
                    down=_single(mlp.down_proj),
                    act=F.silu if silu else mlp.act_fn,
                    mask_kind=layer_types[index] if layer_types else "full_attention",
                    extra={} if window is None else {"sliding_window": window},
                )
            )
        self.head_dim = decoder.layers[0].self_attn.head_dim

    @torch.inference_mode()
    def __call__(
        self,
        positions: torch.Tensor,
        masks,
        cache,
        packing=None,
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[batch, width, H]`` after the final norm, for ``input_ids`` ``[batch,
        width]`` (or ``inputs_embeds`` ``[batch, width, H]``) at ``positions`` ``[batch,
        width]`` (packed: ``[1, T]`` with ``packing``); ``masks`` as the runner builds them (one
        tensor, or {layer type: tensor}); ``cache`` the runner's :class:`SlotCache`."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary(hidden, position_ids=positions)  # [batch, width, dim] each
        cos, sin = cos[:, None], sin[:, None]  # [batch, 1, width, dim]
        extra = {} if packing is None else {KWARG: packing}
        for layer in self.layers:
            mask = masks[layer.mask_kind] if isinstance(masks, dict) else masks
            hidden = hidden + self._attention(
                layer, _rms_norm(hidden, layer.input_norm), cos, sin, mask, cache, extra
            )
            normed = _rms_norm(hidden, layer.post_norm)
            gate, up = layer.gate_up(normed)
            hidden = hidden + layer.down(layer.act(gate) * up)
        return _rms_norm(hidden, self.norm)

    def _attention(self, layer, normed, cos, sin, mask, cache, extra) -> torch.Tensor:
        batch, width = normed.shape[:2]
        q, k, v = layer.qkv(normed)
        # [batch, width, heads * dim] -> [batch, heads, width, dim]
        q = q.view(batch, width, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, width, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, width, -1, self.head_dim).transpose(1, 2)
        q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
        dtype = q.dtype
        kv_dtype = attention_dtype(dtype, q.device)
        if kv_dtype != dtype:
            q, k, v = q.to(kv_dtype), k.to(kv_dtype), v.to(kv_dtype)
        keys, values = cache.update(k, v, layer.index)
        output, _ = self.attend(
            layer.attention,
            q,
            keys,
            values,
            mask,
            dropout=0.0,
            scaling=layer.attention.scaling,
            **layer.extra,
            **extra,
        )  # [batch, width, heads, dim]
        return layer.out(output.reshape(batch, width, -1).to(dtype))
