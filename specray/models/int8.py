"""Weight-only int8 linears for a draft on the CPU: int8 weights, one scale per output channel,
bfloat16 activations, multiplied by torch's int8-weight kernel.

A draft step multiplies one row per request by every weight: it costs what reading the weights
costs. Half the bytes of fp16 halve that (the shipped draft's linears at one row, one core:
1.41 ms in fp16, 0.78 ms in int8; docs/bench/history.md, "A lean forward for the draft"). The
draft's precision changes its q, never the output's law (docs/design.md, section 1).

torch's CPU kernel reads a row's inputs 16 at a time and gives wrong sums (or crashes) for other
widths, so only linears whose input width is a multiple of 16 are converted (:func:`packable`);
the rest stay in bfloat16.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

ACTIVATION_DTYPE = torch.bfloat16  # the kernel's fast path (fp16 and fp32 inputs run 10-20x slower)
INPUT_MULTIPLE = 16


def packable(in_features: int) -> bool:
    return in_features >= INPUT_MULTIPLE and in_features % INPUT_MULTIPLE == 0


@functools.cache
def int8_available() -> bool:
    """torch has the CPU int8-weight kernel and it computes a small product right."""
    kernel = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if kernel is None:
        return False
    weight = torch.tensor([[1, -2] * 8, [3, 0] * 8], dtype=torch.int8)  # [2, 16]
    scales = torch.tensor([0.5, 2.0], dtype=ACTIVATION_DTYPE)
    rows = torch.ones(1, 16, dtype=ACTIVATION_DTYPE)
    try:
        product = kernel(rows, weight, scales)
    except RuntimeError:
        return False
    return torch.equal(product.float(), torch.tensor([[-4.0, 48.0]]))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int8 ``[out, in]`` and scales ``[out]`` (symmetric, one per
    output channel: a row's largest magnitude maps to 127)."""
    rows = weight.detach().float()
    scales = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
    quantized = torch.round(rows / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scales.to(ACTIVATION_DTYPE)


class Int8Linear(nn.Module):
    """``inputs [..., in] -> [..., out]`` in bfloat16 from int8 weights."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if not packable(weight.shape[1]):
            raise ValueError(
                f"in_features must be a multiple of {INPUT_MULTIPLE}, got {weight.shape[1]}"
            )
        self.register_buffer("weight", weight)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out]
        self.register_buffer("bias", bias)  # [out] or None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """From a float ``weight`` ``[out, in]`` (and ``bias`` ``[out]``)."""
        quantized, scales = quantize_rows(weight)
        return cls(quantized, scales, None if bias is None else bias.detach().to(ACTIVATION_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def side_by_side(cls, linears: list[Int8Linear]) -> Int8Linear:
        """One linear computing ``linears``' outputs concatenated (a layer's q, k and v)."""
        biases = [linear.bias for linear in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    linear.scales.new_zeros(linear.out_features) if b is None else b
                    for linear, b in zip(linears, biases, strict=True)
                ]
            )
        weight = torch.cat([linear.weight for linear in linears])
        return cls(weight, torch.cat([linear.scales for linear in linears]), bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = inputs.reshape(-1, self.in_features).to(ACTIVATION_DTYPE)  # [rows, in]
        product = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        if self.bias is not None:
            product = product + self.bias
        return product.view(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(module: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` under ``module`` by an :class:`Int8Linear`; the
    others go to bfloat16. Returns how many were converted."""
    converted = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if packable(child.in_features):
                setattr(parent, name, Int8Linear.from_linear(child))
                converted += 1
            else:
                child.to(ACTIVATION_DTYPE)
    return converted
