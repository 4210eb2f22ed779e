"""Tuned small-batch linears: the plan rule, each kernel against F.linear, and a tuned model
against the untuned one (logits, and the runner's multi-token forward)."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specray.models import linears
from specray.models.linears import (
    DENSE,
    DENSE_T,
    ONEDNN,
    TunedLinear,
    choose_plan,
    onednn_available,
    tune_decoder_linears,
    tune_head,
)
from specray.models.runner import ModelRunner

KERNELS = [DENSE, DENSE_T] + ([ONEDNN] if onednn_available() else [])


def test_plan_takes_the_cheapest_kernel_and_padding_that_pays():
    costs = {DENSE: [34.7, 49.8, 57.9, 45.2], ONEDNN: [19.3, 21.4, 17.0, 16.3]}
    plan = choose_plan(costs)
    # 3 rows stay 3: padding to 4 would save only 4%.
    assert plan[1:] == ((ONEDNN, 4), (ONEDNN, 4), (ONEDNN, 3), (ONEDNN, 4))


def test_large_row_counts_take_the_kernel_that_won_at_the_next_count_measured():
    fast = KERNELS[-1]  # oneDNN where torch has it
    small = ((DENSE, 0), (fast, 1), (fast, 2))
    costs = {DENSE: [50.0, 90.0, 100.0], fast: [30.0, 88.0, 60.0]}  # at 4, 8 and 16 rows
    plan = linears.extend_plan(small, costs, [4, 8, 16])
    assert plan[3:5] == ((fast, 3), (fast, 4))
    assert plan[5:9] == tuple((DENSE, rows) for rows in range(5, 9))  # 2% cheaper: noise
    assert plan[9:] == tuple((fast, rows) for rows in range(9, 17))
    layer = TunedLinear(torch.nn.Linear(8, 8), plan)
    with torch.inference_mode():  # past the last count: the last count's kernel, unpadded
        inputs = torch.randn(20, 8)
        torch.testing.assert_close(layer(inputs), F.linear(inputs, layer.weight, layer.bias))


def test_plan_keeps_dense_unless_clearly_cheaper():
    costs = {DENSE: [10.0, 20.0, 30.0], ONEDNN: [9.5, 19.0, 28.0]}  # 5% cheaper: noise
    assert choose_plan(costs, min_gain=0.08)[1:] == ((DENSE, 1), (DENSE, 2), (DENSE, 3))
    # Padding 2 rows to 3 pays only when it is min_gain cheaper than 2 rows as they are.
    costs = {DENSE: [10.0, 20.0, 19.0]}
    assert choose_plan(costs)[1:] == ((DENSE, 1), (DENSE, 2), (DENSE, 3))
    costs = {DENSE: [10.0, 20.0, 15.0]}
    assert choose_plan(costs)[1:] == ((DENSE, 1), (DENSE, 3), (DENSE, 3))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_and_padding_matches_f_linear(kernel, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=bias)
    plan = [(DENSE, 0)] + [(kernel, rows + 2) for rows in range(1, 7)]  # pad 2 extra rows
    tuned = TunedLinear(linear, tuple(plan))
    with torch.inference_mode():
        for shape in [(1, 48), (3, 48), (2, 3, 48), (1, 6, 48), (9, 48)]:  # 9 rows: past plan
            inputs = torch.randn(shape)
            torch.testing.assert_close(tuned(inputs), F.linear(inputs, linear.weight, linear.bias))
    assert tuned.weight is linear.weight  # the parameter itself: state dicts, tied weights


def _small_llama():
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_tuned_runner_matches_untuned_and_caches_its_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linears, "MIN_TUNED_BYTES", 0)  # tune even this small model
    monkeypatch.setattr(linears, "MAX_TUNED_ROWS", 4)
    monkeypatch.setattr(linears, "LARGE_ROW_COUNTS", (8,))
    reference = ModelRunner(_small_llama(), tune=False)
    tuned_model = _small_llama()
    state_keys = set(tuned_model.state_dict())
    tuned = ModelRunner(tuned_model)
    assert tuned.linear_tuning is not None and tuned._tuned_head is not None
    assert len(tuned.linear_tuning["plan"]) == 9  # rows 0..4 one by one, 5..8 as 8
    assert set(tuned_model.state_dict()) == state_keys  # same names: saving still works
    assert tuned_model.lm_head.weight is tuned_model.model.embed_tokens.weight  # still tied
    assert sum(isinstance(m, TunedLinear) for m in tuned_model.modules()) == 2 * 7
    files = list((tmp_path / "linear-tuning").glob("*.json"))
    assert len(files) == 2  # decoder and head, one file each
    assert set(json.loads(files[0].read_text())["measured"]) <= set(KERNELS)

    prompt = {"a": [5, 6, 7, 8, 9], "b": [10, 11]}
    for runner in (reference, tuned):
        runner.forward(prompt, {"a": 1, "b": 1})
    for width in (1, 3, 6, 11):  # a decode step, blocks (padded, unpadded, past the plan)
        block = {"a": list(range(20, 20 + width)), "b": list(range(40, 40 + width))}
        wanted = {"a": width, "b": width}
        expected, got = reference.forward(block, wanted), tuned.forward(block, wanted)
        for seq_id in block:
            torch.testing.assert_close(got[seq_id], expected[seq_id], atol=1e-4, rtol=1e-4)

    def no_measuring(*_args, **_kwargs):
        raise AssertionError("calibration must come from the cache")

    monkeypatch.setattr(linears, "measure_costs", no_measuring)
    again = ModelRunner(_small_llama())
    assert again.linear_tuning["plan"] == tuned.linear_tuning["plan"]


def test_small_models_and_hooked_linears_are_left_alone():
    model = _small_llama()
    assert tune_decoder_linears(model.get_decoder()) is None  # < MIN_TUNED_BYTES: in cache
    hooked = torch.nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *_: None)  # e.g. a tensor-parallel all-reduce
    assert tune_head(hooked, min_bytes=0) is None
    assert tune_head(torch.nn.Linear(4, 4).to(torch.bfloat16), min_bytes=0) is None  # fp32 only
