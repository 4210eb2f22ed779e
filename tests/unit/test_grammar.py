"""Grammar masks (specray.sampling.grammar): a request's matcher follows whatever histories it
is asked about (drafts, rollbacks after a rejection, refused tokens) and gives exactly the mask
a fresh matcher fed that history gives; specs are checked with errors that say what is wrong."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specray.sampling import LogitsPipeline, SamplingParams, SamplingParamsError
from specray.sampling.grammar import Grammars, check_compiles, unpack_masks
from specray.sampling.grammar_spec import GrammarError, check_spec

TEXTS = ["(", "0", ")", "1", "x", "{", "}", '"', "a", ":", ",", "<eos>"]
EOS = len(TEXTS) - 1
SPECS = [
    ("regex", r"(\(0*\)|1|x)*"),
    ("choice", json.dumps(["(0)", "1x", "11"])),
    ("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    ("grammar", 'root ::= "(" inner ")" | "1"\ninner ::= "0" | "0" inner'),
]


@pytest.fixture(scope="module")
def grammars():
    return Grammars.for_vocab(TEXTS, [EOS])


def fresh_masks(grammars, spec, history):
    """The mask after ``history`` from a matcher that saw nothing else (None: refused, or
    past the stop token)."""
    matcher = grammars.matcher(*spec)
    for token_id in history:
        if matcher._matcher.is_terminated() or not matcher._matcher.accept_token(token_id):
            return None
    if matcher._matcher.is_terminated():  # past the stop token: the request has ended
        return None
    out = torch.zeros(1, grammars.words, dtype=torch.int32)
    matcher._matcher.fill_next_token_bitmask(out, 0)
    return unpack_masks(out, len(TEXTS))[0]


def valid_walk(grammars, spec, history, length, rng) -> list[int]:
    walk: list[int] = []
    for _ in range(length):
        mask = fresh_masks(grammars, spec, history + walk)
        if mask is None or not mask.any():  # (a dead end of this tiny vocabulary)
            break
        walk.append(rng.choice(mask.nonzero().flatten().tolist()))
    return walk


@pytest.mark.parametrize("spec", SPECS, ids=[kind for kind, _ in SPECS])
def test_masks_follow_any_order_of_histories(grammars, spec):
    """500 calls with random histories (extensions, rollbacks, random drafts) on one matcher
    give, row by row, the mask of a fresh matcher fed that row's history; a row after a
    refused token is never sampled from and only has to be a valid mask. A row where the
    grammar allows nothing (this tiny vocabulary cannot spell what it wants) is left unmasked
    and reported as the matcher's dead end."""
    rng = random.Random(5)
    matcher = grammars.matcher(*spec)
    history: list[int] = []
    checked = deeper = 0  # rows checked; of them, rows after a candidate
    for _ in range(500):
        allowed = unpack_masks(matcher.masks(history, [], 1), len(TEXTS))[0]
        if rng.random() < 0.3 and history:  # a rejection took tokens away
            del history[rng.randrange(len(history)) :]
        elif allowed.any():
            choices = allowed.nonzero().flatten().tolist()
            history.append(rng.choice([c for c in choices if c != EOS] or choices))
        if EOS in history:
            history.remove(EOS)
        candidates = [rng.randrange(len(TEXTS)) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.5:  # a draft that follows the grammar, as a masked q gives
            candidates = valid_walk(grammars, spec, history, len(candidates), rng)
        rows = unpack_masks(matcher.masks(history, candidates, len(candidates) + 1), len(TEXTS))
        for j in range(len(candidates) + 1):
            expected = fresh_masks(grammars, spec, history + candidates[:j])
            if expected is None:  # refused: the later rows are unread
                break
            if expected.any():
                assert torch.equal(rows[j], expected), (history, candidates, j)
            else:
                assert rows[j].all() and matcher.dead_end == j, (history, candidates, j)
            checked += 1
            deeper += j > 0
    assert checked >= 500 and deeper >= 100, (checked, deeper)


def test_a_complete_grammar_allows_only_the_stop_token(grammars):
    matcher = grammars.matcher("choice", json.dumps(["1x"]))
    rows = unpack_masks(matcher.masks([], [3, 4], 3), len(TEXTS))
    assert rows[0].nonzero().flatten().tolist() == [3]
    assert rows[1].nonzero().flatten().tolist() == [4]
    assert rows[2].nonzero().flatten().tolist() == [EOS]


def test_the_pipeline_masks_p_before_every_other_step(grammars):
    """Forbidden tokens get probability 0 whatever the bias; greedy takes the best allowed."""
    spec = ("regex", r"1+")
    logits = torch.zeros(2, len(TEXTS))
    logits[:, 0] = 10.0  # "(" is the model's favourite, the grammar forbids it
    sampled = LogitsPipeline(
        SamplingParams(structured_outputs=spec, logit_bias={4: 50.0}),
        len(TEXTS),
        [],
        None,
        grammars,
    )
    probs = sampled.probs(logits, [], [3])
    assert torch.equal(probs[0], torch.nn.functional.one_hot(torch.tensor(3), len(TEXTS)).float())
    assert probs[1, 3] > 0 and probs[1, EOS] > 0 and probs[1, [0, 4]].sum() == 0
    greedy = LogitsPipeline(
        SamplingParams(temperature=0, structured_outputs=spec), len(TEXTS), [], None, grammars
    )
    assert greedy.greedy_token_ids(logits, [], [3]).tolist()[0] == 3


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("yaml", "a: 1", "kind must be one of"),
        ("json", "{not json", "is not JSON"),
        ("json", "[1, 2]", "a JSON schema is an object"),
        ("choice", '["a", ""]', "non-empty list of non-empty strings"),
        ("choice", "[]", "non-empty list"),
        ("regex", "", "must not be empty"),
        ("regex", "(ab", "not usable"),
        ("grammar", "root ::= ", "not usable"),
        ("json", '{"type": "bogus"}', "not usable"),
    ],
)
def test_bad_specs_say_what_is_wrong(kind, spec, message):
    with pytest.raises(GrammarError, match=message):
        check_compiles(kind, spec)


def test_sampling_params_check_the_spec_by_name():
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(structured_outputs=("choice", "[]"))
    assert caught.value.param == "structured_outputs"
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(structured_outputs="regex")
    assert caught.value.param == "structured_outputs" and "'regex'" in str(caught.value)
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(structured_outputs=("regex", "a+"), min_tokens=1)
    assert caught.value.param == "min_tokens"
    for name in ("allowed_token_ids", "banned_token_ids"):  # could leave no token to draw
        with pytest.raises(SamplingParamsError) as caught:
            SamplingParams(structured_outputs=("regex", "a+"), **{name: [3]})
        assert caught.value.param == name
    check_spec("json_object", "")
    assert SamplingParams(structured_outputs=["regex", "a+"]).structured_outputs == ("regex", "a+")


def test_a_dead_end_is_reported_and_left_unmasked(grammars):
    """ "1" then a letter this vocabulary lacks: after "1" nothing is allowed. The row is left
    unmasked (no empty distribution) and its index reported; rows before it are exact."""
    matcher = grammars.matcher("regex", r"1[bc]")
    rows = unpack_masks(matcher.masks([], [3], 2), len(TEXTS))
    assert rows[0].nonzero().flatten().tolist() == [3]
    assert rows[1].all() and matcher.dead_end == 1
    matcher.masks([], [], 1)
    assert matcher.dead_end is None  # recomputed per call


def test_a_request_commits_up_to_its_dead_end_then_ends_with_an_error(grammars):
    from specray.core import RequestState

    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=("regex", "1[bc]"))
    state = RequestState.create("r", [0], params, 0, len(TEXTS), frozenset([EOS]), lambda: grammars)
    state.pipeline.grammar.masks([], [3], 2)  # what the round's verification asked
    assert state.commit_verified([3, 4]) == [3]  # "x" came from the dead row: not committed
    assert state.output_token_ids == [3] and state.finish_reason == "error"
    assert state.error.startswith("structured_outputs: after 1 output tokens")
    state = RequestState.create("s", [0], params, 0, len(TEXTS), frozenset([EOS]), lambda: grammars)
    state.pipeline.grammar.masks([], [3], 2)
    assert state.commit_verified([3]) == [3]  # the dead row was not drawn from: goes on
    assert state.finish_reason is None and state.error is None


def test_the_engine_refuses_a_grammar_its_vocabulary_cannot_finish():
    """Through Engine.generate, drafting with a model: a grammar that needs a token after "1"
    that this vocabulary lacks fails the call naming structured_outputs (its dead-end rows,
    left unmasked, gave no NaN on the way); the request beside it is unaffected next call."""
    from specray import Engine
    from specray.engine import EngineInputError
    from tests.helpers.tiny_models import tiny_llama

    engine = Engine(
        target=tiny_llama(len(TEXTS), 0), draft=tiny_llama(len(TEXTS), 1), num_speculative_tokens=2
    )
    engine.grammars = lambda: Grammars.for_vocab(TEXTS, [EOS])
    dead = SamplingParams(max_tokens=4, seed=1, structured_outputs=("regex", "1[bc]"))
    fine = SamplingParams(max_tokens=4, seed=1, structured_outputs=("regex", "1x"))
    with pytest.raises(EngineInputError, match="prompt 1: structured_outputs: after 1 output"):
        engine.generate([[0, 1], [0, 1]], [fine, dead])
    (output,) = engine.generate([[0, 1]], [fine])
    assert output.token_ids[:3] == [3, 4, EOS]  # (EOS is the grammar's, not the model's)
