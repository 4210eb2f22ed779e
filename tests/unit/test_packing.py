"""Packed forwards (specray/models/packing.py): rows fed different numbers of tokens run their
fed tokens only through the linears, and attend per segment of rows; the logits are those of
a padded forward and of recomputing each sequence alone."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specray.models.packing import segment_layout, segment_rows, should_pack
from specray.models.runner import ModelRunner
from tests.helpers.tiny_models import TINY_DECODER

TINY = TINY_DECODER
# a, b, c decode; d is a new 40-token prompt; e verifies 3 tokens
CONTEXTS = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8, 9], "e": [10, 11, 12, 13, 14]}
FEEDS = {"a": [15], "b": [16], "c": [17], "d": [(7 * i) % 50 for i in range(40)], "e": [1, 2, 3]}


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def _rows_through_the_mlp(runner, model) -> list[int]:
    """Token rows the first layer's MLP multiplied, per forward."""
    seen = []
    linear = model.model.layers[0].mlp.gate_proj
    handle = linear.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0].numel()))
    try:
        for seq_id, tokens in CONTEXTS.items():
            runner.forward({seq_id: tokens}, {})
        seen.clear()
        logits = runner.forward(FEEDS, {seq_id: len(feed) for seq_id, feed in FEEDS.items()})
    finally:
        handle.remove()
    return [count // TINY["hidden_size"] for count in seen], logits


def test_a_prompt_beside_decoding_rows_computes_only_the_fed_tokens():
    model = _model()
    # The model's own forward (lean=False): the count is a hook on its MLP's linear, which the
    # lean forward's fused product does not call (it runs the same rows: test_runner.py).
    packed_rows, packed = _rows_through_the_mlp(ModelRunner(model, lean=False), model)
    padded_rows, padded = _rows_through_the_mlp(ModelRunner(model, pack=False, lean=False), model)
    fed = sum(len(feed) for feed in FEEDS.values())  # 46
    assert packed_rows == [fed]
    assert padded_rows == [len(FEEDS) * 40]  # the control: every row padded to the prompt
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    for seq_id, feed in FEEDS.items():
        torch.testing.assert_close(packed[seq_id], padded[seq_id], atol=1e-5, rtol=1e-5)
        with torch.inference_mode():
            whole = torch.tensor([[*CONTEXTS.get(seq_id, []), *feed]])
            expected = reference(whole).logits[0, -len(feed) :]
        torch.testing.assert_close(packed[seq_id], expected, atol=1e-5, rtol=1e-5)


def test_segments_split_where_padding_would_cost_more_than_the_tokens():
    assert segment_rows([1, 1, 40]) == [(0, 2), (2, 3)]
    assert segment_rows([1, 1, 1, 40, 3]) == [(0, 3), (3, 5)]  # 80 padded for 43 tokens: kept
    assert segment_rows([5, 1, 1, 3]) == [(0, 4)]  # 20 padded: under SMALL_SEGMENT
    assert segment_rows([4] * 16) == [(0, 16)]
    assert segment_rows([]) == []
    assert segment_layout([2, 1], 0, 2) == [0, 1, 2]
    assert segment_layout([1, 1, 40, 3], 2, 4) == [*range(40), 40, 41, 42]
    assert segment_layout([1, 1, 40], 0, 2) is None  # every row fed the width: no scatter
    assert should_pack([1, 1, 40]) and not should_pack([5, 5]) and not should_pack([1])


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
def test_a_token_decoded_beside_a_prompt_matches_it_decoded_alone(batch_invariant):
    """Packing joins the runner's batch invariance: a batch-invariant runner gives a decoding
    row the same bits beside a new prompt as alone (the default runner: close)."""
    model = _model()
    runner = ModelRunner(model, batch_invariant=batch_invariant)
    runner.forward({"a": CONTEXTS["a"]}, {})
    alone = runner.forward({"a": [15]}, {"a": 1})["a"]
    runner.rollback("a", 1)
    beside = runner.forward({"a": [15], "d": FEEDS["d"]}, {"a": 1})["a"]
    if batch_invariant:
        assert torch.equal(alone, beside)
    else:
        torch.testing.assert_close(alone, beside, atol=1e-5, rtol=1e-5)
