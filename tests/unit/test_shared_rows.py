"""Rows that would compute the same run once (models/shared_rows.py): the history ids' rules,
and the runner against the oracle of recomputing each sequence alone while groups of rows
start from one prompt, stay twins for a while (chunked prompts, greedy siblings) and diverge
(different tokens, a rollback, a row fed alone)."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specray.models.runner import ModelRunner
from specray.models.shared_rows import EMPTY, Histories, widened
from tests.helpers.tiny_models import TINY_DECODER
from tests.unit.test_runner import VOCAB, _eager, _reference_logits


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER)).eval()


def test_rows_share_only_the_same_history_and_feed():
    histories = Histories()
    feed = {"a": [1, 2], "b": [1, 2], "c": [1, 3], "d": [1, 2]}
    assert histories.plan(feed) == {"b": "a", "d": "a"}
    histories.advance(list(feed), {"b": "a", "d": "a"})
    assert histories.of("a") == histories.of("b") == histories.of("d") != EMPTY
    assert histories.of("c") not in (EMPTY, histories.of("a"))
    # a and b fed alike stay twins; d fed alone leaves them
    histories.advance(["d"], {})
    assert histories.plan({"a": [5], "b": [5], "d": [5]}) == {"b": "a"}
    histories.diverge("b")  # a rollback: b shares with nothing
    assert histories.plan({"a": [5], "b": [5]}) == {}
    histories.forget(["a"])  # removed: a new "a" starts from nothing
    assert histories.of("a") == EMPTY and histories.plan({"a": [7], "z": [7]}) == {"z": "a"}


def test_features_must_match_to_share():
    histories = Histories()
    rows = torch.zeros(2, 3)
    features = {"a": rows, "b": rows.clone(), "c": rows + 1}
    assert histories.plan({key: [4, 4] for key in "abc"}, features) == {"b": "a"}


def test_computed_rows_ask_for_what_their_copies_ask():
    assert widened({"a": 1, "b": 3, "c": 2}, {"b": "a"}) == {"a": 3, "c": 2}
    assert widened({"b": 2}, {"b": "a"}) == {"a": 2}  # the source asked for nothing itself


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_of_one_prompt_match_recompute(tiny_model, seed):
    reference = _eager(tiny_model)
    runner = ModelRunner(tiny_model)
    schedule = random.Random(seed)
    sequences: dict[str, list[int]] = {}
    twins: dict[str, list[str]] = {}  # a group started from one prompt, fed alike for now
    for step in range(40):
        feed = {}
        if step % 5 == 0:  # a new group of 1-4 rows with one prompt, in 1-3 chunks
            group = [f"g{step}-{i}" for i in range(schedule.randint(1, 4))]
            twins[group[0]] = group
        for members in twins.values():
            if schedule.random() < 0.7:
                tokens = [schedule.randrange(VOCAB) for _ in range(schedule.randint(1, 12))]
                for seq_id in members:
                    feed[seq_id] = list(tokens)
        for seq_id in sequences:  # the rest: each its own tokens, sometimes
            if seq_id not in feed and schedule.random() < 0.4:
                feed[seq_id] = [schedule.randrange(VOCAB) for _ in range(schedule.randint(1, 3))]
        if not feed:
            continue
        num_logits = {}
        for seq_id, tokens in feed.items():
            if schedule.random() < 0.8:  # some rows ask for no logits; copies may ask more
                num_logits[seq_id] = schedule.randint(1, len(tokens))
        logits = runner.forward(feed, num_logits)
        assert set(logits) == set(num_logits)
        for seq_id, tokens in feed.items():
            sequences.setdefault(seq_id, []).extend(tokens)
            if seq_id in num_logits:
                expected = _reference_logits(reference, sequences[seq_id])[-num_logits[seq_id] :]
                torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)
        for head, members in list(twins.items()):  # groups break up: a rollback, a split
            if schedule.random() < 0.15 and len(sequences[members[-1]]) > 2:
                runner.rollback(members[-1], 1)
                del sequences[members[-1]][-1]
                twins[head] = members[:-1]
            elif schedule.random() < 0.1:
                twins[head] = members[:1]
            if not twins[head]:
                del twins[head]
        for seq_id, tokens in sequences.items():
            assert runner.length(seq_id) == len(tokens)
    assert runner.tokens_shared > 0


def test_a_shared_prompt_is_computed_once(tiny_model):
    runner = ModelRunner(tiny_model)
    prompt = list(range(3, 40))
    logits = runner.forward({f"choice-{i}": prompt for i in range(5)}, {})
    assert logits == {}
    assert runner.tokens_fed == 5 * len(prompt) and runner.tokens_shared == 4 * len(prompt)
    # the choices then sample different tokens: each row decodes from its own copy
    feed = {f"choice-{i}": [i + 1] for i in range(5)}
    logits = runner.forward(feed, dict.fromkeys(feed, 1))
    reference = _eager(tiny_model)
    for seq_id, tokens in feed.items():
        expected = _reference_logits(reference, prompt + tokens)[-1:]
        torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)
    assert runner.tokens_shared == 4 * len(prompt)


def test_calibration_times_every_row(tiny_model):
    runner = ModelRunner(tiny_model, tune=False)
    runner.time_forward(4, 3, repeats=1)
    assert runner.tokens_shared == 0


def test_twins_filling_the_slot_capacity_share_one_forward(tiny_model):
    """Two rows fed the same prompt of exactly the cache's slot capacity (64): the copied
    source spans whole rows, which torch refuses to write from a view of the same storage."""
    prompt = [1 + index % (VOCAB - 1) for index in range(64)]
    runner = ModelRunner(tiny_model)
    logits = runner.forward({"a": prompt, "b": prompt}, {"a": 1, "b": 1})
    assert runner.cache.slot_capacity == 64 and runner.tokens_shared == 64
    expected = _reference_logits(_eager(tiny_model), prompt)[-1:]
    for seq_id in "ab":
        torch.testing.assert_close(logits[seq_id], expected, atol=1e-5, rtol=1e-5)
    step = runner.forward({"a": [3], "b": [3]}, {"a": 1, "b": 1})
    torch.testing.assert_close(step["a"], step["b"])
