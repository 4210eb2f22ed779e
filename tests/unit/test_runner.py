"""ModelRunner against the oracle of recomputing each sequence from scratch.

A random schedule of appends (new and existing sequences, ragged widths), rollbacks, removals
and compactions must give the same logits as a full forward of each sequence alone.
"""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specray.models import runner as runner_module
from specray.models.runner import ModelRunner

VOCAB = 50


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]  # [len, vocab]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_schedule_matches_recompute(tiny_model, monkeypatch, seed):
    monkeypatch.setattr(runner_module, "COMPACT_MIN_WASTED_SLOTS", 4)  # compact often
    runner = ModelRunner(tiny_model)
    schedule = random.Random(seed)
    sequences: dict[str, list[int]] = {}
    compactions = 0
    original_compact = runner._compact

    def counting_compact(width):
        nonlocal compactions
        compactions += 1
        original_compact(width)

    runner._compact = counting_compact
    for step in range(50):
        feed = {}
        candidates = list(sequences) + ([f"s{step}"] if step % 6 == 0 else [])
        for seq_id in candidates:
            if schedule.random() < 0.8:
                count = schedule.randint(1, 5)
                feed[seq_id] = [schedule.randrange(VOCAB) for _ in range(count)]
        num_logits = {seq_id: schedule.randint(1, len(tokens)) for seq_id, tokens in feed.items()}
        logits = runner.forward(feed, num_logits)
        for seq_id, tokens in feed.items():
            sequences.setdefault(seq_id, []).extend(tokens)
            expected = _reference_logits(tiny_model, sequences[seq_id])[-num_logits[seq_id] :]
            torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)
        for seq_id in list(sequences):
            if schedule.random() < 0.3 and len(sequences[seq_id]) > 2:
                count = schedule.randint(1, len(sequences[seq_id]) - 1)
                runner.rollback(seq_id, count)
                del sequences[seq_id][-count:]
            if schedule.random() < 0.05:
                runner.remove([seq_id])
                del sequences[seq_id]
        runner._shrink()
        for seq_id, tokens in sequences.items():
            assert runner.length(seq_id) == len(tokens)
    assert compactions > 0, "the schedule must exercise compaction"


def test_rollback_more_than_cached_is_an_error(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward({"a": [1, 2, 3]}, {"a": 1})
    with pytest.raises(ValueError, match="cannot roll back 4 tokens of a 3-token sequence"):
        runner.rollback("a", 4)


def test_remove_frees_rows(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward({"a": [1, 2], "b": [3]}, {"a": 1, "b": 1})
    runner.remove(["a", "b"])
    assert runner.seq_ids == [] and runner.cache is None and runner.num_slots == 0


def test_only_the_rows_fed_run(tiny_model, monkeypatch):
    """A forward over some sequences computes only their rows: a prefill beside decoding
    requests, or one micro-batch of two, does not pay for the others as padding; the masked
    slots it leaves the others are compacted away at once (later steps would copy and attend
    over them)."""
    monkeypatch.setattr(runner_module, "COMPACT_MIN_WASTED_SLOTS", 1)
    monkeypatch.setattr(runner_module, "COMPACT_MIN_WASTED_FRACTION", 0.0)
    runner = ModelRunner(tiny_model)
    batch_sizes = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(
        lambda _module, args, _out: batch_sizes.append(args[0].shape[0])
    )
    try:
        runner.forward({f"d{i}": [1, 2, 3] for i in range(6)}, {})
        runner.forward({"new": list(range(1, 20))}, {"new": 1})  # a prefill beside 6 others
        slots_after_prefill = runner.num_slots  # 3 + 19 before compaction
        runner.forward({"d0": [4], "d1": [5]}, {"d0": 1, "d1": 1})  # one micro-batch
    finally:
        hook.remove()
    assert batch_sizes == [6, 1, 2]
    assert slots_after_prefill == 19
    # The rows that did not run are intact: each continues as if computed alone.
    for seq_id, tokens in (
        ("d2", [1, 2, 3, 7]),
        ("new", [*range(1, 20), 7]),
        ("d0", [1, 2, 3, 4, 7]),
    ):
        logits = runner.forward({seq_id: [7]}, {seq_id: 1})[seq_id]
        expected = _reference_logits(tiny_model, tokens)[-1:]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
