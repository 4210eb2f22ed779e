"""The lean decoder's reach and the weight-only int8 linears a CPU draft runs.

The lean forward's logits against recomputation from scratch are tested with the runner's
schedules (tests/unit/test_runner.py, ``test_lean_decoder_matches_recompute``); here: which
models it takes, and the int8 linears it fuses.
"""

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from specray.models import lean
from specray.models.int8 import (
    ACTIVATION_DTYPE,
    Int8Linear,
    int8_available,
    quantize_linears,
    quantize_rows,
)
from specray.models.lean import lean_eligible
from specray.models.runner import ModelRunner
from tests.helpers.tiny_models import TINY_DECODER


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER)).eval()


def test_this_torch_has_the_int8_kernel():
    assert int8_available()


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_computes_the_dequantized_product(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    quantized = Int8Linear.from_linear(linear)
    inputs = torch.randn(2, rows, 64)
    weight, scales = quantize_rows(linear.weight)
    expected = inputs @ (weight.float() * scales.float()[:, None]).t() + linear.bias
    got = quantized(inputs)
    assert got.shape == (2, rows, 48) and got.dtype == ACTIVATION_DTYPE
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)
    # ... and that product is close to the float one (one scale per output channel)
    torch.testing.assert_close(got.float(), linear(inputs), atol=0.08, rtol=0.05)


def test_int8_linear_refuses_an_input_width_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="in_features must be a multiple of 16, got 24"):
        Int8Linear.from_linear(nn.Linear(24, 8))


def test_quantize_linears_keeps_unpackable_ones_in_bfloat16():
    block = nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 32))
    assert quantize_linears(block) == 1
    assert type(block[0]) is Int8Linear
    assert type(block[1]) is nn.Linear and block[1].weight.dtype == ACTIVATION_DTYPE


def test_side_by_side_int8_linears_compute_their_outputs_concatenated():
    torch.manual_seed(1)
    parts = [
        Int8Linear.from_linear(nn.Linear(32, out, bias=bias))
        for out, bias in ((8, True), (4, False))
    ]
    inputs = torch.randn(3, 32, dtype=ACTIVATION_DTYPE)
    fused = Int8Linear.side_by_side(parts)
    torch.testing.assert_close(fused(inputs), torch.cat([part(inputs) for part in parts], dim=-1))


def test_lean_int8_runner_matches_the_models_own_forward_with_the_same_linears():
    model = _llama()
    model.to(ACTIVATION_DTYPE)
    for layer in model.model.layers:
        quantize_linears(layer)
    lean, plain = ModelRunner(model, lean=True), ModelRunner(model, lean=False)
    assert lean._lean is not None and plain._lean is None
    feeds = [{"a": [1, 2, 3, 4, 5], "b": [6, 7]}, {"a": [8], "b": [9]}, {"a": [3, 4]}]
    for feed in feeds:
        wanted = {seq_id: len(tokens) for seq_id, tokens in feed.items()}
        got, expected = lean.forward(feed, wanted), plain.forward(feed, wanted)
        for seq_id in feed:
            torch.testing.assert_close(got[seq_id], expected[seq_id], atol=2e-2, rtol=2e-2)


def test_int8_logits_stay_close_to_the_float_models():
    """Quantisation changes the draft's q a little, not its character: total variation
    distance to the float model's next-token law under 0.05 on average (measured here ~0.01)."""
    model = _llama(seed=2)
    quantized = copy.deepcopy(model).to(ACTIVATION_DTYPE)
    for layer in quantized.model.layers:
        quantize_linears(layer)
    tokens = {"a": list(range(1, 40))}
    reference = ModelRunner(model).forward(tokens, {"a": 39})["a"].softmax(-1)
    approx = ModelRunner(quantized, lean=True).forward(tokens, {"a": 39})["a"].softmax(-1)
    distance = 0.5 * (reference - approx).abs().sum(-1)  # [39]
    assert float(distance.mean()) < 0.05, distance


def test_models_the_lean_forward_does_not_cover_keep_their_own():
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**TINY_DECODER, head_dim=8)).eval()  # q/k norms
    assert not lean_eligible(qwen3) and ModelRunner(qwen3, lean=True)._lean is None
    hooked = _llama()
    hooked.model.layers[0].mlp.down_proj.register_forward_hook(lambda *args: None)
    assert not lean_eligible(hooked)  # a tensor-parallel shard's all-reduce lives in a hook
    assert lean_eligible(_llama())


def test_a_decoder_too_large_to_copy_runs_each_product_on_its_own_weights(monkeypatch):
    """Above MAX_FUSED_BYTES the q/k/v and gate/up products are not fused: no weight is
    concatenated (a small decoder's are: the control), and the logits are the model's own."""
    model = _llama(seed=3)
    concatenated = []
    cat = torch.cat
    monkeypatch.setattr(
        torch, "cat", lambda *args, **kw: concatenated.append(1) or cat(*args, **kw)
    )
    lean.LeanDecoder(model)
    fused_cats = len(concatenated)
    monkeypatch.setattr(lean, "MAX_FUSED_BYTES", 0)
    concatenated.clear()
    lean.LeanDecoder(model)
    assert fused_cats == 2 * TINY_DECODER["num_hidden_layers"] and concatenated == []
    monkeypatch.setattr(torch, "cat", cat)
    separate, plain = ModelRunner(model), ModelRunner(model, lean=False)
    assert separate._lean is not None
    for feed in ({"a": [1, 2, 3, 4], "b": [5, 6]}, {"a": [7], "b": [8]}):
        wanted = {seq_id: len(tokens) for seq_id, tokens in feed.items()}
        got, expected = separate.forward(feed, wanted), plain.forward(feed, wanted)
        for seq_id in feed:
            torch.testing.assert_close(got[seq_id], expected[seq_id], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_attends_in_float32_on_a_cpu(dtype):
    """A half-precision decoder (a draft) attends, and caches keys and values, in float32 on a
    CPU (whose attention kernels emulate half-precision sums), its other products in its own
    dtype; the logits stay within half precision of the model's own forward and of the float32
    model's. The model's own forward keeps its dtype in the cache
    (the control), and an accelerator would keep it too. A cache adopted from a float32
    runner (a self-draft's prompt, ``import_rows``) lands in float32."""
    assert lean.attention_dtype(dtype, torch.device("cpu")) == torch.float32
    assert lean.attention_dtype(dtype, torch.device("meta")) == dtype
    assert lean.attention_dtype(torch.float32, torch.device("cpu")) == torch.float32
    exact = _llama(seed=4)
    model = copy.deepcopy(exact).to(dtype)
    lean_runner, plain = ModelRunner(model, lean=True), ModelRunner(model, lean=False)
    reference = ModelRunner(exact)
    feeds = [{"a": list(range(1, 30)), "b": [6, 7]}, {"a": [8], "b": [9]}, {"a": [3, 4]}]
    for feed in feeds:
        wanted = {seq_id: len(tokens) for seq_id, tokens in feed.items()}
        got, own = lean_runner.forward(feed, wanted), plain.forward(feed, wanted)
        exact_logits = reference.forward(feed, wanted)
        for seq_id in feed:
            torch.testing.assert_close(got[seq_id], own[seq_id], atol=5e-2, rtol=5e-2)
            torch.testing.assert_close(got[seq_id], exact_logits[seq_id], atol=5e-2, rtol=5e-2)
    assert lean_runner.cache.layers[0].keys.dtype == torch.float32
    assert plain.cache.layers[0].keys.dtype == dtype
    source = ModelRunner(exact)
    source.forward({"p": [5, 4, 3, 2]}, {"p": 1})
    lean_runner.import_rows(source, ["p"])
    step = lean_runner.forward({"p": [1]}, {"p": 1})["p"]
    expected = reference.forward({"p": [5, 4, 3, 2, 1]}, {"p": 1})["p"]
    torch.testing.assert_close(step, expected, atol=5e-2, rtol=5e-2)
