"""ModelRunner against the oracle of recomputing each sequence from scratch.

A random schedule of appends (new and existing sequences, ragged widths, random subsets of the
rows), rollbacks and removals must give the same logits as a full forward of each sequence
alone, computed by an untouched copy of the model with transformers' eager attention.
"""

import copy
import random

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specray.models import slot_cache
from specray.models.runner import ModelRunner
from specray.models.slot_cache import SlotCache
from tests.helpers.tiny_models import TINY_DECODER

VOCAB = 50
TINY = TINY_DECODER


def _build(model_class, config):
    torch.manual_seed(0)
    return model_class(config).eval()


@pytest.fixture(scope="module")
def tiny_model():
    return _build(LlamaForCausalLM, LlamaConfig(**TINY))


def _eager(model):
    """An independent copy for reference logits: transformers' own masks and attention."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return reference


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]  # [len, vocab]


class _Counting:
    """Counts the cache's row moves and reallocations (the schedule must exercise both)."""

    def __init__(self, monkeypatch):
        self.moves = self.reallocations = 0
        reorder, reallocate = SlotCache.reorder, SlotCache._reallocate

        def counting_reorder(cache, order, used_slots):
            self.moves += any(row != i for i, row in enumerate(order))
            reorder(cache, order, used_slots)

        def counting_reallocate(cache, *args):
            self.reallocations += 1
            reallocate(cache, *args)

        monkeypatch.setattr(SlotCache, "reorder", counting_reorder)
        monkeypatch.setattr(SlotCache, "_reallocate", counting_reallocate)


def _random_schedule(
    model, seed: int, steps: int = 50, long_feeds: bool = False, lean: bool = True
) -> None:
    """``long_feeds``: some feeds are prompt-sized (10-40 tokens) beside the others' few, so
    packed forwards split into several attention segments (models/packing.py). ``lean``: the
    runner computes through its lean decoder (models/lean.py, the default), else through the
    model's own forward."""
    reference = _eager(model)
    runner = ModelRunner(model, lean=lean)
    assert (runner._lean is not None) == lean
    schedule = random.Random(seed)
    sequences: dict[str, list[int]] = {}
    for step in range(steps):
        feed = {}
        candidates = list(sequences) + ([f"s{step}"] if step % 6 == 0 else [])
        for seq_id in candidates:
            if schedule.random() < 0.6:
                count = schedule.randint(1, 5)
                if long_feeds and schedule.random() < 0.15:
                    count = schedule.randint(10, 40)
                feed[seq_id] = [schedule.randrange(VOCAB) for _ in range(count)]
        num_logits = {seq_id: schedule.randint(1, len(tokens)) for seq_id, tokens in feed.items()}
        logits = runner.forward(feed, num_logits)
        for seq_id, tokens in feed.items():
            sequences.setdefault(seq_id, []).extend(tokens)
            expected = _reference_logits(reference, sequences[seq_id])[-num_logits[seq_id] :]
            torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)
        for seq_id in list(sequences):
            if schedule.random() < 0.3 and len(sequences[seq_id]) > 2:
                count = schedule.randint(1, len(sequences[seq_id]) - 1)
                runner.rollback(seq_id, count)
                del sequences[seq_id][-count:]
            if schedule.random() < 0.05:
                runner.remove([seq_id])
                del sequences[seq_id]
        for seq_id, tokens in sequences.items():
            assert runner.length(seq_id) == len(tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_schedule_matches_recompute(tiny_model, monkeypatch, seed):
    monkeypatch.setattr(slot_cache, "MIN_SLOTS", 4)  # grow (and copy) often
    monkeypatch.setattr(slot_cache, "MIN_ROWS", 1)
    counts = _Counting(monkeypatch)
    _random_schedule(tiny_model, seed)
    assert counts.moves > 0, "the schedule must run rows that are not one block"
    assert counts.reallocations > 2, "the schedule must grow the cache"


@pytest.mark.parametrize("seed", [4, 5])
def test_random_schedule_with_prompts_beside_decoding_matches_recompute(tiny_model, seed):
    _random_schedule(tiny_model, seed, steps=30, long_feeds=True)


WINDOWED_FAMILIES = [
    (MistralForCausalLM, MistralConfig(**TINY, sliding_window=4)),
    (
        Qwen2ForCausalLM,
        Qwen2Config(
            **TINY,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
]
WINDOWED_IDS = ["mistral-window-4", "qwen2-bias-full-and-window-3"]


@pytest.mark.parametrize(("model_class", "config"), WINDOWED_FAMILIES, ids=WINDOWED_IDS)
def test_sliding_windows_match_the_family(model_class, config, monkeypatch):
    """Sequences longer than the window: the runner's own masks apply the window where the
    family's mask functions do (one window for Mistral; per layer type for Qwen2)."""
    monkeypatch.setattr(slot_cache, "MIN_SLOTS", 4)
    _random_schedule(_build(model_class, config), seed=3, steps=30, long_feeds=True)


@pytest.mark.parametrize(
    ("model_class", "config"),
    [(LlamaForCausalLM, LlamaConfig(**TINY)), *WINDOWED_FAMILIES],
    ids=["llama", *WINDOWED_IDS],
)
def test_the_models_own_forward_matches_recompute(model_class, config, monkeypatch):
    """With ``lean=False`` (and for families without a lean forward) the runner calls the
    model's own decoder: the same schedules give the family's logits through it."""
    monkeypatch.setattr(slot_cache, "MIN_SLOTS", 4)
    _random_schedule(_build(model_class, config), seed=6, steps=30, long_feeds=True, lean=False)


def test_window_changes_the_logits():
    """Negative control for the test above: the window is visible in the logits at these
    lengths (the same weights without a window disagree)."""
    windowed = _build(MistralForCausalLM, MistralConfig(**TINY, sliding_window=4))
    unwindowed = _build(MistralForCausalLM, MistralConfig(**TINY, sliding_window=None))
    tokens = list(range(1, 12))
    runner = ModelRunner(unwindowed)
    logits = runner.forward({"a": tokens}, {"a": len(tokens)})["a"]
    assert not torch.allclose(logits, _reference_logits(_eager(windowed), tokens), atol=1e-3)


def test_unsupported_family_is_refused():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelRunner(model)


def test_rollback_more_than_cached_is_an_error(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward({"a": [1, 2, 3]}, {"a": 1})
    with pytest.raises(ValueError, match="cannot roll back 4 tokens of a 3-token sequence"):
        runner.rollback("a", 4)


def test_bad_num_logits_changes_nothing(tiny_model):
    runner = ModelRunner(tiny_model)
    with pytest.raises(ValueError, match=r"num_logits for 'a' must be in \[1, 2\]"):
        runner.forward({"a": [1, 2]}, {"a": 3})
    assert runner.seq_ids == []


def test_remove_frees_rows(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward({"a": [1, 2], "b": [3]}, {"a": 1, "b": 1})
    runner.remove(["a", "b"])
    assert runner.seq_ids == [] and runner.cache is None and runner.num_slots == 0


def test_memory_is_given_back_after_a_long_sequence_leaves(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward({"long": list(range(1, 48)) * 30, "short": [1, 2]}, {})
    grown = runner.cache.slot_capacity
    runner.remove(["long"])
    assert grown >= 1410 and runner.cache.slot_capacity <= 128
    expected = _reference_logits(_eager(tiny_model), [1, 2, 3])[-1:]
    torch.testing.assert_close(runner.forward({"short": [3]}, {"short": 1})["short"], expected)


def _take_turns(runner, reference, sequences, halves, *, first_token: int, turns: int):
    """Two micro-batches taking turns, one token each a turn, checked against recomputation."""
    for turn in range(turns):
        feed = {seq_id: [first_token + turn] for seq_id in halves[turn % 2]}
        logits = runner.forward(feed, dict.fromkeys(feed, 1))
        for seq_id, tokens in feed.items():
            sequences[seq_id] += tokens
            expected = _reference_logits(reference, sequences[seq_id])[-1:]
            torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)


def test_only_the_rows_fed_run_as_one_block(tiny_model, monkeypatch):
    """A forward over some sequences computes only their rows (a prefill beside decoding
    requests, or one micro-batch of two, does not pay for the others as padding), and two
    micro-batches taking turns are each one block of rows after the first turn: no rows move
    per step."""
    reference = _eager(tiny_model)
    counts = _Counting(monkeypatch)
    runner = ModelRunner(tiny_model)
    batch_sizes = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(
        lambda _module, args, _out: batch_sizes.append(args[0].shape[0])
    )
    sequences = {f"d{i}": [1, 2, 3 + i] for i in range(6)}  # distinct: none shares a row
    try:
        runner.forward(dict(sequences), {})
        sequences["new"] = list(range(1, 20))
        runner.forward({"new": sequences["new"]}, {"new": 1})  # a prefill beside 6 others
        halves = (["d0", "d2", "d4"], ["d1", "d3", "d5", "new"])
        _take_turns(runner, reference, sequences, halves, first_token=4, turns=6)
    finally:
        hook.remove()
    assert batch_sizes == [6, 1, 3, 4, 3, 4, 3, 4]
    assert counts.moves == 1, "the micro-batches should be placed once, then stay blocks"


def _rows_copied(monkeypatch) -> list[int]:
    """Rows each cache reorder copies."""
    copied, reorder = [], SlotCache.reorder

    def counting(cache, order, used_slots):
        copied.append(sum(row != i for i, row in enumerate(order)))
        reorder(cache, order, used_slots)

    monkeypatch.setattr(SlotCache, "reorder", counting)
    return copied


def test_the_oldest_sequence_leaving_moves_one_row(tiny_model, monkeypatch):
    """After a forward over every row, a freed row is filled from the end (closing the gap
    would copy every row after it); the sequences' logits stay those of recomputation."""
    reference = _eager(tiny_model)
    runner = ModelRunner(tiny_model)
    sequences = {f"s{i}": [1 + i, 2, 3] for i in range(8)}
    runner.forward(dict(sequences), {})
    copied = _rows_copied(monkeypatch)
    runner.remove(["s0"])
    del sequences["s0"]
    assert copied == [1] and runner.seq_ids[0] == "s7"
    feed = {seq_id: [5] for seq_id in sequences}
    logits = runner.forward(feed, dict.fromkeys(feed, 1))
    assert copied == [1], "the rows left are one block: the forward moves none"
    for seq_id, tokens in sequences.items():
        expected = _reference_logits(reference, [*tokens, 5])[-1:]
        torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)


def test_micro_batches_stay_blocks_when_their_sequences_leave(tiny_model, monkeypatch):
    """Two micro-batches taking turns lose a sequence each: a few rows move, and each
    micro-batch is still one block, so their next turns move none."""
    reference = _eager(tiny_model)
    runner = ModelRunner(tiny_model)
    halves = ([f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)])
    sequences = {seq_id: [2, 3 + n] for n, seq_id in enumerate(halves[0] + halves[1])}
    for half in halves:
        runner.forward({seq_id: sequences[seq_id] for seq_id in half}, {})
    copied = _rows_copied(monkeypatch)
    runner.remove(["a1", "b0"])
    for half, gone in zip(halves, ("a1", "b0"), strict=True):
        half.remove(gone)
        del sequences[gone]
    assert copied == [3]  # a3 into a1's row, then b2 and b3 to the front of b's block
    _take_turns(runner, reference, sequences, halves, first_token=7, turns=4)
    assert copied == [3], "each micro-batch is one block: no turn moves rows"
