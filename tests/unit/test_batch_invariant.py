"""Batch-invariant forwards (specray.models.batch_invariant): a token's logits are bitwise the
same whether it is fed alone, in a verified block, or beside other sequences of other lengths;
the products stay the plain ones up to float rounding.

A random Llama with grouped-query attention (8 query heads over 2 KV heads, head size 32) and
a 512-token vocabulary: large enough that the default kernels round differently by shape,
which the negative control shows (the same comparisons on the default runner differ)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specray.bench.gpu_check import fed_logits
from specray.models.batch_invariant import (
    SLOT_CHUNK,
    TILE_ROWS,
    invariant_attention,
    invariant_linear,
    make_batch_invariant,
)
from specray.models.linears import TunedLinear, onednn_available, onednn_pack
from specray.models.runner import ModelRunner
from tests.helpers.tiny_models import tiny_llama

PROMPT = list(range(40, 71))  # 31 tokens
FED = list(range(100, 120))  # 20 tokens fed after it
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def _model():
    return tiny_llama(512, seed=5, **SHAPE)


def _differences(runner: ModelRunner) -> list[float]:
    """Largest |difference| of each way of feeding against one token at a time."""
    alone = fed_logits(runner, PROMPT, FED, 1, others=False)
    ways = [(5, False), (3, False), (5, True), (1, True)]
    return [
        (alone - fed_logits(runner, PROMPT, FED, chunk, others)).abs().max().item()
        for chunk, others in ways
    ]


@torch.inference_mode()
def test_a_token_gets_the_same_logits_in_any_forward():
    assert _differences(ModelRunner(_model(), batch_invariant=True)) == [0.0] * 4
    # Negative control: the default runner's kernels round by shape.
    default = _differences(ModelRunner(_model(), tune=False))
    assert max(default) > 0.0
    assert max(default) < 1e-3  # rounding, not a different computation


@torch.inference_mode()
def test_the_products_are_the_plain_ones_up_to_rounding():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    for rows in (1, TILE_ROWS - 1, TILE_ROWS, 3 * TILE_ROWS + 2):
        inputs = torch.randn(rows, 3, 48)  # any leading shape
        assert torch.allclose(invariant_linear(linear, inputs), linear(inputs), atol=1e-5)
    batch, heads, kv_heads, dim, end = 3, 6, 2, 16, SLOT_CHUNK + 9
    for width in (1, 5):
        query = torch.randn(batch, heads, width, dim)
        key, value = torch.randn(2, batch, kv_heads, end, dim)
        lengths = torch.tensor([end - width, 20, 3])  # cached tokens per row
        positions = lengths[:, None] + torch.arange(width)  # [batch, width]
        mask = torch.arange(end) <= positions[:, None, :, None]  # [batch, 1, width, end]
        got, _ = invariant_attention(None, query, key, value, mask, scaling=dim**-0.5)
        repeated = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value)]
        want = F.scaled_dot_product_attention(query, *repeated, attn_mask=mask)
        assert torch.allclose(got, want.transpose(1, 2), atol=1e-5)


def test_tuned_linears_are_refused_by_name():
    model = _model()
    model.model.layers[0].mlp.up_proj = TunedLinear(model.model.layers[0].mlp.up_proj)
    with pytest.raises(ValueError, match="TunedLinear"):
        make_batch_invariant(model)


def test_the_engine_refuses_a_batch_invariant_that_is_not_a_boolean():
    from specray import Engine
    from specray.engine import EngineInputError

    with pytest.raises(EngineInputError, match="batch_invariant must be True or False, got 'on'"):
        Engine(_model(), draft=None, batch_invariant="on")


@torch.inference_mode()
def test_a_plain_forward_of_the_model_still_works_and_agrees():
    """The model made batch-invariant stays a transformers model: a plain forward over whole
    sequences (no cache, no mask: causal) gives the runner's logits up to rounding."""
    plain = _model()(torch.tensor([PROMPT])).logits[0]
    model = make_batch_invariant(_model())
    assert torch.allclose(model(torch.tensor([PROMPT])).logits[0], plain, atol=1e-4)
    runner = ModelRunner(model, batch_invariant=True)
    fed = runner.forward({"a": PROMPT}, {"a": len(PROMPT)})["a"]
    assert torch.allclose(fed, plain, atol=1e-4)


def test_a_rows_log_sum_exp_does_not_depend_on_the_other_rows():
    """SmolLM2's vocabulary (49152): one row alone is long enough for torch to split its sum
    across threads; row_logsumexp gives it the same bits alone or among up to 40 rows."""
    from specray.sampling.logprobs import row_logsumexp

    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 49152, generator=generator) * 4  # logits-like spread
    alone = torch.cat([row_logsumexp(rows[i : i + 1]) for i in range(len(rows))])
    for count in (2, 3, 5, 17, 40):
        assert torch.equal(row_logsumexp(rows[:count]), alone[:count])
    assert torch.allclose(alone, torch.logsumexp(rows, dim=1, keepdim=True), atol=1e-5)


@pytest.mark.parametrize("kernel", ["dense", "onednn"])
@torch.inference_mode()
def test_a_linears_row_has_the_same_bits_for_any_row_count(kernel):
    """The linears' invariance at the default target's shapes (a decoder projection, the MLP's
    down projection, the head), for both kernels the mode uses: oneDNN's packed kernel over
    rows padded to a multiple of TILE_ROWS, and BLAS one tile of TILE_ROWS rows at a time (on
    CPUs with AMX, MKL rounds a row of an 8-row product unlike one of a 16-row product, so a
    single padded product is not enough there). F.linear computes one row alone with another
    kernel: the control."""
    if kernel == "onednn" and not onednn_available():
        pytest.skip("this torch build has no oneDNN: the mode uses F.linear alone")
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in ((1536, 576), (576, 1536), (49152, 576)):
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
        if kernel == "onednn":  # packed as make_batch_invariant packs it
            linear.invariant_packed = onednn_pack(linear.weight)
        rows = torch.randn(1024, in_features, generator=generator)
        full = invariant_linear(linear, rows)
        for count in (1, 3, TILE_ROWS, 2 * TILE_ROWS, 37 * TILE_ROWS + 5):
            assert torch.equal(invariant_linear(linear, rows[:count]), full[:count])
        assert torch.allclose(full, F.linear(rows, linear.weight), rtol=1e-4, atol=1e-3)
        if kernel == "dense":
            assert not torch.equal(F.linear(rows[:1], linear.weight), full[:1])
