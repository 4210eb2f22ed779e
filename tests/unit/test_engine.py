"""The offline engine, deterministically: greedy identity, the draft == target oracle, bad
input, metrics and finish reasons (docs/design.md 1, proof obligation (c)).

Two kinds of model:
  - the real default pair (SmolLM2-135M-Instruct from the bundled GGUF; the first use converts
    it, ~40 s, cached afterwards), for greedy identity with every drafter;
  - tiny random-weight Llamas (``tests.helpers.tiny_models``), for everything that needs many
    cases or an exact oracle computed without the engine.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from specray.engine import Engine
from specray.models.runner import ModelRunner
from specray.sampling import LogitsPipeline, SamplingParams
from tests.helpers.tiny_models import last_logits, perturbed_copy, tiny_llama


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for this module: on a busy 2-core machine, OpenMP wake-ups cost
    milliseconds per tensor op (measured: 3 greedy prompts on the default model took 62 s with 2
    threads under load, 4.6 s with 1). Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# The real default model: greedy identity

CHAT_PROMPTS = [
    "What is the capital of France?",  # answered in a few tokens, then end-of-sequence
    "Write a haiku about the sea.",
    "Repeat exactly: red green blue red green blue red green blue",  # n-gram friendly
]
REAL_MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=REAL_MAX_TOKENS)


@pytest.fixture(scope="module")
def reference_engine():
    """Target-only engine on the default model (built once: loading is the slow part)."""
    return Engine("default")


@pytest.fixture(scope="module")
def reference_outputs(reference_engine):
    """Target-only greedy outputs, one prompt per call."""
    return [reference_engine.generate(prompt, GREEDY)[0] for prompt in CHAT_PROMPTS]


def test_reference_is_transformers_greedy(reference_engine, reference_outputs):
    """The target-only engine (batched runner, own KV cache) reproduces transformers' own greedy
    decoding token for token, and stops at end-of-sequence with the token included."""
    model, tokenizer = reference_engine.target.model, reference_engine.tokenizer
    for prompt, output in zip(CHAT_PROMPTS[:2], reference_outputs[:2], strict=True):
        prompt_ids = torch.tensor([reference_engine.encode_prompt(prompt)])
        generated = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=REAL_MAX_TOKENS,
            do_sample=False,
        )[0, prompt_ids.shape[1] :].tolist()
        assert output.token_ids == generated[: len(output.token_ids)]
        assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True)
    first = reference_outputs[0]
    assert first.finish_reason == "stop"
    assert first.token_ids[-1] in reference_engine.eos_token_ids
    assert "Paris" in first.text
    assert reference_outputs[1].finish_reason == "length"
    assert len(reference_outputs[1].token_ids) == REAL_MAX_TOKENS


@pytest.mark.slow  # loads the default model once per drafter
@pytest.mark.parametrize("draft", [None, "ngram", "default"])
def test_speculative_greedy_equals_target_only(draft, reference_outputs):
    """k = 4 with each drafter, the three prompts in ONE batched generate call: token ids equal
    the target-only single-prompt outputs exactly (draft None: batching alone changes nothing)."""
    engine = Engine("default", draft, num_speculative_tokens=4)
    outputs = engine.generate(CHAT_PROMPTS, GREEDY)
    for output, expected in zip(outputs, reference_outputs, strict=True):
        assert output.token_ids == expected.token_ids
        assert output.finish_reason == expected.finish_reason
        assert output.text == expected.text
    if draft is None:
        assert all(output.metrics.num_drafts == 0 for output in outputs)
    else:
        assert sum(output.metrics.num_drafts for output in outputs) > 0
        assert outputs[2].metrics.num_accepted_tokens > 0  # the repetitive prompt


@pytest.mark.slow  # loads the default model again, and its fp32 copy as the draft
def test_fp32_self_draft_is_always_accepted(reference_outputs):
    """draft='self:fp32' is the target itself: greedy acceptance 1.0, output unchanged."""
    engine = Engine("default", "self:fp32", num_speculative_tokens=4)
    outputs = engine.generate(CHAT_PROMPTS, GREEDY)
    for output, expected in zip(outputs, reference_outputs, strict=True):
        assert output.token_ids == expected.token_ids
        assert output.metrics.num_drafts > 0
        assert output.metrics.acceptance_rate == 1.0


# ---------------------------------------------------------------------------------------------
# Tiny models

VOCAB_SIZE = 8


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(VOCAB_SIZE, seed=3, num_hidden_layers=2, hidden_size=32)


@pytest.fixture(scope="module")
def tiny_draft(tiny_target):
    return perturbed_copy(tiny_target, seed=4, noise=0.2)


def oracle_greedy(model, prompt, params: SamplingParams) -> list[int]:
    """Target-only greedy decoding without the engine: full forward (no cache) per token."""
    pipeline = LogitsPipeline(params, VOCAB_SIZE, prompt)
    output: list[int] = []
    for _ in range(params.max_tokens):
        probs = pipeline.probs(last_logits(model, [*prompt, *output])[None], output)
        output.append(int(probs[0].argmax()))
        if output[-1] in (params.stop_token_ids or ()):
            break
    return output


TINY_PROMPTS = [[5], [1, 2, 3, 1, 2], [7, 0, 7, 0, 7, 0, 6, 6, 2]]  # lengths 1, 5, 9


@pytest.mark.parametrize(
    "options",
    [{}, {"repetition_penalty": 1.3, "presence_penalty": 0.5}, {"banned_token_ids": [0, 1]}],
    ids=["plain", "penalties", "banned"],
)
@pytest.mark.parametrize(
    ("draft", "k"),
    [(None, 0), ("ngram", 3), ("model", 1), ("model", 3), ("model", 6)],
    ids=["none", "ngram-k3", "model-k1", "model-k3", "model-k6"],
)
def test_tiny_greedy_identity(draft, k, options, tiny_target, tiny_draft, monkeypatch):
    """Greedy output equals an engine-free greedy oracle for every drafter and k, prompts of
    length 1, 5 and 9 batched together; rejected drafts are rolled back along the way."""
    rollbacks = []
    original_rollback = ModelRunner.rollback

    def counting_rollback(self, seq_id, num_tokens):
        rollbacks.append(num_tokens)
        return original_rollback(self, seq_id, num_tokens)

    monkeypatch.setattr(ModelRunner, "rollback", counting_rollback)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **options)
    engine = Engine(
        target=tiny_target,
        draft=tiny_draft if draft == "model" else draft,
        num_speculative_tokens=k,
    )
    outputs = engine.generate(TINY_PROMPTS, params)
    for prompt, output in zip(TINY_PROMPTS, outputs, strict=True):
        assert output.token_ids == oracle_greedy(tiny_target, prompt, params), prompt
    if draft == "model" and k >= 3:
        assert any(rollbacks), "expected the runner to roll back rejected drafts"


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_tiny_greedy_shortest_generations(max_tokens, tiny_target, tiny_draft):
    """max_tokens 1 and 2 leave no room (k = 0) or one draft token (k = 1) per round."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = Engine(target=tiny_target, draft=tiny_draft, num_speculative_tokens=4)
    for prompt, output in zip(TINY_PROMPTS, engine.generate(TINY_PROMPTS, params), strict=True):
        assert output.token_ids == oracle_greedy(tiny_target, prompt, params)
        assert output.metrics.num_draft_tokens == max_tokens - 1


# ---- draft == target oracle -----------------------------------------------------------------

ORACLE_K = 3
ORACLE_MAX_TOKENS = 4 * (ORACLE_K + 1)  # four rounds, each with a full block of k drafts

ORACLE_OPTIONS = {
    "greedy": {"temperature": 0},
    "temperature-1": {},
    "temperature-0.7-top_k-top_p": {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
    "min_p-logit_bias-banned": {"min_p": 0.05, "logit_bias": {2: 1.5}, "banned_token_ids": [0]},
    "presence_penalty": {"presence_penalty": 1.0},
    "frequency_penalty": {"frequency_penalty": 1.0},
    "repetition_penalty": {"repetition_penalty": 1.5},
}


@pytest.mark.parametrize("options", list(ORACLE_OPTIONS.values()), ids=list(ORACLE_OPTIONS))
def test_draft_equal_to_target_is_always_accepted(options, tiny_target):
    """Engine(target=m, draft=m): q == p at every position (same pipeline, same history), so
    every draft token is accepted: acceptance 1.0, mean acceptance length k + 1, 4 rounds."""
    engine = Engine(target=tiny_target, draft=tiny_target, num_speculative_tokens=ORACLE_K)
    params = [
        SamplingParams(max_tokens=ORACLE_MAX_TOKENS, ignore_eos=True, seed=seed, **options)
        for seed in range(8)
    ]
    outputs = engine.generate([TINY_PROMPTS[1]] * len(params), params)
    for output in outputs:
        metrics = output.metrics
        assert len(output.token_ids) == ORACLE_MAX_TOKENS
        assert metrics.acceptance_rate == 1.0, (output.seed, metrics)
        assert metrics.mean_acceptance_length == ORACLE_K + 1
        assert metrics.num_drafts == metrics.num_target_steps == 4
        assert metrics.accepted_per_position == [4] * ORACLE_K


# ---------------------------------------------------------------------------------------------
# Bad input: ValueError subclasses whose messages name the parameter and the value


@pytest.mark.parametrize("k", [-1, 33, 1.5, "4", True])
def test_invalid_num_speculative_tokens(k, tiny_target):
    with pytest.raises(ValueError, match="num_speculative_tokens") as error:
        Engine(target=tiny_target, draft="ngram", num_speculative_tokens=k)
    assert repr(k) in str(error.value) or str(k) in str(error.value)


def test_vocabulary_mismatched_draft_is_refused(tiny_target):
    other = tiny_llama(VOCAB_SIZE + 3, seed=0)
    with pytest.raises(ValueError, match="vocabulary") as error:
        Engine(target=tiny_target, draft=other)
    assert str(VOCAB_SIZE) in str(error.value) and str(VOCAB_SIZE + 3) in str(error.value)


@pytest.mark.parametrize("draft", ["self:int3", "medusa"])
def test_unknown_draft_string(draft, tiny_target):
    with pytest.raises(ValueError, match="draft") as error:
        Engine(target=tiny_target, draft=draft)
    assert repr(draft) in str(error.value)


@pytest.mark.parametrize("draft", ["self:bf16", "default"])
def test_self_draft_of_an_in_memory_target_names_the_draft(draft, tiny_target):
    """A self-draft needs the target's files; an in-memory target has none: the error must
    name the draft option the caller gave (not an internal 'None' path)."""
    with pytest.raises(ValueError, match="draft") as error:
        Engine(target=tiny_target, draft=draft)
    assert repr(draft) in str(error.value)
    assert "None" not in str(error.value)


def test_nonexistent_target_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="target") as error:
        Engine(target=missing)
    assert missing in str(error.value)


def test_target_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="target") as error:
        Engine(target=str(tmp_path))
    assert str(tmp_path) in str(error.value)


def test_nonexistent_draft_path(tmp_path, tiny_target):
    missing = str(tmp_path / "no-such-draft")
    with pytest.raises(ValueError, match="draft") as error:
        Engine(target=tiny_target, draft=missing)
    assert missing in str(error.value)


def test_target_of_the_wrong_type():
    with pytest.raises(ValueError, match="target") as error:
        Engine(target=42)
    assert "42" in str(error.value)


@pytest.mark.parametrize("encoding", ["fp8", "top0", "top", "int8"])
def test_invalid_draft_probs_encoding(encoding, tiny_target):
    with pytest.raises(ValueError, match="draft_probs_encoding") as error:
        Engine(target=tiny_target, draft="ngram", draft_probs_encoding=encoding)
    assert repr(encoding) in str(error.value)


@pytest.mark.parametrize("size", [0, -3, 2.5])
def test_invalid_max_batch_size(size, tiny_target):
    with pytest.raises(ValueError, match="max_batch_size") as error:
        Engine(target=tiny_target, max_batch_size=size)
    assert str(size) in str(error.value)


@pytest.fixture(scope="module")
def tiny_engine(tiny_target):
    return Engine(target=tiny_target, draft="ngram", num_speculative_tokens=2)


@pytest.mark.parametrize("token_id", [VOCAB_SIZE, 1000, -1])
def test_out_of_vocabulary_prompt_token(token_id, tiny_engine):
    with pytest.raises(ValueError, match="prompt") as error:
        tiny_engine.generate([1, token_id, 2], SamplingParams(max_tokens=2))
    assert str(token_id) in str(error.value)


def test_non_integer_prompt_token(tiny_engine):
    with pytest.raises(ValueError, match="prompt") as error:
        tiny_engine.generate([[1, 2.0]], SamplingParams(max_tokens=2))
    assert "2.0" in str(error.value)


def test_empty_prompt(tiny_engine):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        tiny_engine.generate([[1, 2], []], SamplingParams(max_tokens=2))


def test_text_prompt_without_tokenizer(tiny_engine):
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_engine.generate("hello", SamplingParams(max_tokens=2))


def test_wrong_number_of_params(tiny_engine):
    params = [SamplingParams(max_tokens=2)] * 3
    with pytest.raises(ValueError, match="params") as error:
        tiny_engine.generate([[1, 2], [3]], params)
    assert "2" in str(error.value) and "3" in str(error.value)


def test_params_of_the_wrong_type(tiny_engine):
    with pytest.raises(ValueError, match="params") as error:
        tiny_engine.generate([1, 2], {"max_tokens": 2})
    assert "max_tokens" in str(error.value)


def test_params_token_ids_outside_the_vocabulary(tiny_engine):
    with pytest.raises(ValueError, match="stop_token_ids") as error:
        tiny_engine.generate([1, 2], SamplingParams(max_tokens=2, stop_token_ids=[VOCAB_SIZE]))
    assert str(VOCAB_SIZE) in str(error.value)


def test_too_long_for_the_model(tiny_engine):
    with pytest.raises(ValueError, match="max_tokens") as error:
        tiny_engine.generate([1, 2, 3], SamplingParams(max_tokens=62))
    assert "62" in str(error.value)


def test_bad_input_leaves_the_engine_usable(tiny_engine):
    """A rejected request admits nothing: the next call runs normally."""
    with pytest.raises(ValueError):
        tiny_engine.generate([[1, 2], [VOCAB_SIZE]], SamplingParams(max_tokens=3))
    outputs = tiny_engine.generate([[1, 2], [3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(output.token_ids) for output in outputs] == [3, 3]
    assert tiny_engine.target.seq_ids == []


# ---------------------------------------------------------------------------------------------
# Outputs: prompt forms, metrics, finish reasons


def test_prompt_forms(tiny_engine):
    """One prompt of ids -> one output; a list of prompts -> one output each; none -> []."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, seed=5)
    single = tiny_engine.generate([1, 2, 3], params)
    several = tiny_engine.generate([[1, 2, 3], (4, 5)], params)
    assert len(single) == 1 and len(several) == 2
    assert single[0].token_ids == several[0].token_ids
    assert single[0].prompt_token_ids == [1, 2, 3]
    assert single[0].text == ""  # no tokenizer
    assert tiny_engine.generate([], params) == []


def _check_metrics_invariants(output):
    metrics = output.metrics
    positions = metrics.accepted_per_position
    assert all(a >= b for a, b in itertools.pairwise(positions)), positions
    assert sum(positions) == metrics.num_accepted_tokens
    assert metrics.num_drafts <= metrics.num_draft_tokens
    assert metrics.num_accepted_tokens <= metrics.num_draft_tokens
    # Each round commits its accepted drafts plus one recovered or bonus token.
    assert len(output.token_ids) == metrics.num_accepted_tokens + metrics.num_target_steps
    if metrics.num_draft_tokens:
        expected_rate = metrics.num_accepted_tokens / metrics.num_draft_tokens
        assert metrics.acceptance_rate == pytest.approx(expected_rate)
        expected_length = 1 + metrics.num_accepted_tokens / metrics.num_drafts
        assert metrics.mean_acceptance_length == pytest.approx(expected_length)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_ngram_metrics_on_a_repetitive_prompt(temperature, tiny_target):
    """Prompt lookup on a repetitive prompt drafts from the first round; accepted counts per
    position never increase with the position; the counters agree with the output."""
    engine = Engine(target=tiny_target, draft="ngram", num_speculative_tokens=4)
    prompt = [1, 2, 3, 4] * 4
    params = [
        SamplingParams(temperature=temperature, max_tokens=30, ignore_eos=True, seed=seed)
        for seed in range(6)
    ]
    outputs = engine.generate([prompt] * len(params), params)
    for output in outputs:
        assert output.metrics.num_drafts > 0
        assert output.finish_reason == "length"
        assert len(output.token_ids) == 30
        _check_metrics_invariants(output)
    assert sum(output.metrics.num_accepted_tokens for output in outputs) > 0


def test_metrics_invariants_with_a_draft_model(tiny_target, tiny_draft):
    engine = Engine(target=tiny_target, draft=tiny_draft, num_speculative_tokens=5)
    params = [SamplingParams(max_tokens=25, ignore_eos=True, seed=seed) for seed in range(6)]
    outputs = engine.generate([TINY_PROMPTS[2]] * len(params), params)
    for output in outputs:
        _check_metrics_invariants(output)
        assert 0 < output.metrics.num_drafts < output.metrics.num_target_steps + 1
    assert (
        0
        < sum(o.metrics.num_accepted_tokens for o in outputs)
        < sum(o.metrics.num_draft_tokens for o in outputs)
    )


def _stop_candidate(token_ids: list[int]) -> tuple[int, int]:
    """A token whose first occurrence is as late as possible but not last: (token, index)."""
    first_index = {}
    for index, token_id in enumerate(token_ids[:-1]):
        first_index.setdefault(token_id, index)
    token_id = max(first_index, key=first_index.get)
    return token_id, first_index[token_id]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", [None, "self", "model"])
def test_finish_reasons(draft, temperature, tiny_target, tiny_draft):
    """'length' after exactly max_tokens; 'stop' at the first stop token, which is included
    as the last token, even in the middle of an accepted draft block. With the same seed the
    stopped output is the unstopped one cut after the stop token (keyed randomness)."""
    drafter = {None: None, "self": tiny_target, "model": tiny_draft}[draft]
    engine = Engine(target=tiny_target, draft=drafter, num_speculative_tokens=4)
    prompt = TINY_PROMPTS[1]
    base = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=9)
    full = engine.generate(prompt, base)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_token, index = _stop_candidate(full.token_ids)
    assert index > 0
    stopped = engine.generate(prompt, replace(base, stop_token_ids=[stop_token]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: index + 1]
    assert stopped.token_ids[-1] == stop_token


def test_model_eos_stops_unless_ignored():
    """The model's end-of-sequence id (generation config) stops a request, token included;
    ignore_eos=True runs to max_tokens."""
    model = tiny_llama(VOCAB_SIZE, seed=3, num_hidden_layers=2, hidden_size=32)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free_run = oracle_greedy(model, TINY_PROMPTS[1], params)
    eos_token, index = _stop_candidate(free_run)
    model.generation_config.eos_token_id = eos_token
    engine = Engine(target=model, draft="ngram", num_speculative_tokens=3)
    stopped = engine.generate(TINY_PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run[: index + 1]
    ignored = engine.generate(TINY_PROMPTS[1], params)[0]
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == free_run
