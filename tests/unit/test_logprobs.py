"""Log-probabilities of committed and prompt tokens (specray.sampling.logprobs), read from the
target's rows at verification: against a plain transformers forward of the same tokens, with
and without speculation, in both modes, and the rule that computes them.

Tiny random-weight models (vocabulary 96, raw logits of standard deviation 1.5): a token's
log-probability is read from one row of ``[n + 1, vocab]``, so taking the wrong row (off by one
position) or the wrong distribution moves it by far more than the tolerances; each comparison
has such a negative control.
"""

from __future__ import annotations

import pytest
import torch

from specray import Engine
from specray.sampling import LogitsPipeline, SamplingParams, SamplingParamsError
from specray.sampling.logprobs import TokenLogprob, token_logprobs
from tests.helpers.logprob_gaps import largest_gap
from tests.helpers.tiny_models import perturbed_copy, tiny_llama

VOCAB_SIZE = 96
PROMPTS = [[5, 17, 3, 60, 2, 41, 9], [88, 1, 1, 30], [12, 70, 44, 23, 8, 19, 50, 61, 2, 33]]
MAX_TOKENS = 24
TOLERANCE = 1e-5  # the bound between speculation on and off; fp32 on these models


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB_SIZE, seed=11, num_hidden_layers=2, hidden_size=32)


@pytest.fixture(scope="module")
def engines(target):
    draft = perturbed_copy(target, seed=12, noise=0.15)
    return (
        Engine(target=target, draft=draft, num_speculative_tokens=4),
        Engine(target=target, draft=None),
    )


@torch.inference_mode()
def full_logits(model, token_ids) -> torch.Tensor:
    """Raw logits at every position of ``token_ids`` (no cache): ``[len, vocab]``."""
    return model(torch.tensor([list(token_ids)])).logits[0].float()


def test_token_logprobs_gives_rank_and_most_likely():
    rows = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, -1.0]]), -1)
    first, second = token_logprobs(rows, [2, 0], [2, 0])
    assert first.token_id == 2 and first.rank == 3  # two tokens strictly more likely
    assert first.logprob == pytest.approx(float(rows[0, 2]))
    assert set(first.top_ids) == {1, 3} and first.top_logprobs[0] == pytest.approx(
        float(rows[0, 1])
    )
    assert second == TokenLogprob(0, pytest.approx(float(rows[1, 0])), 1, (), ())


def test_raw_logprobs_match_a_plain_forward(engines, target):
    speculative, _ = engines
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, logprobs=2, seed=7, top_k=20),
    ]
    checked, shifted_worst = 0, 0.0
    for request_params in params:
        for output in speculative.generate(PROMPTS, request_params):
            tokens = output.prompt_token_ids + output.token_ids
            reference = torch.log_softmax(full_logits(target, tokens), -1)  # [len, vocab]
            start = len(output.prompt_token_ids) - 1  # the row predicting output token 0
            assert len(output.logprobs) == len(output.token_ids)
            for j, (token_id, entry) in enumerate(
                zip(output.token_ids, output.logprobs, strict=True)
            ):
                row = reference[start + j]
                assert entry.token_id == token_id
                assert entry.logprob == pytest.approx(float(row[token_id]), abs=TOLERANCE)
                assert entry.rank == int((row > row[token_id]).sum()) + 1
                top = row.topk(request_params.logprobs)
                assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=TOLERANCE)
                # negative control: the row one position later is another distribution
                shifted = reference[start + j + 1] if start + j + 1 < len(tokens) else None
                if shifted is not None:
                    gap = abs(entry.logprob - float(shifted[token_id]))
                    shifted_worst = max(shifted_worst, gap)
                checked += 1
            if request_params.prompt_logprobs is not None:
                prompt = output.prompt_token_ids
                assert output.prompt_logprobs[0] is None
                assert len(output.prompt_logprobs) == len(prompt)
                for i in range(1, len(prompt)):
                    expected = float(reference[i - 1, prompt[i]])
                    assert output.prompt_logprobs[i].logprob == pytest.approx(
                        expected, abs=TOLERANCE
                    )
                    assert len(output.prompt_logprobs[i].top_ids) == 3
    assert checked > 100
    assert shifted_worst > 100 * TOLERANCE


def test_logprobs_are_the_same_with_and_without_speculation(engines):
    speculative, plain = engines
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=4, prompt_logprobs=2)
    worst, accepted = 0.0, 0
    for with_spec, without in zip(
        speculative.generate(PROMPTS, params), plain.generate(PROMPTS, params), strict=True
    ):
        assert with_spec.token_ids == without.token_ids  # greedy: the same tokens
        accepted += with_spec.metrics.num_accepted_tokens
        for a, b in zip(with_spec.logprobs, without.logprobs, strict=True):
            assert (a.token_id, a.rank, a.top_ids) == (b.token_id, b.rank, b.top_ids)
            worst = max(worst, abs(a.logprob - b.logprob))
            worst = max(
                worst, *(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True))
            )
        for a, b in zip(with_spec.prompt_logprobs[1:], without.prompt_logprobs[1:], strict=True):
            worst = max(worst, abs(a.logprob - b.logprob))
    assert accepted > MAX_TOKENS  # speculation did commit drafted tokens
    assert worst <= TOLERANCE


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            temperature=0.7,
            top_k=12,
            top_p=0.9,
            presence_penalty=0.5,
            logit_bias={3: 2.0, 4: -100.0},
            max_tokens=MAX_TOKENS,
            logprobs=20,
            logprobs_mode="processed",
            seed=3,
        ),
        SamplingParams(
            temperature=0,
            repetition_penalty=1.3,
            banned_token_ids=[0, 1],
            max_tokens=MAX_TOKENS,
            logprobs=3,
            logprobs_mode="processed_logprobs",  # vLLM's name
        ),
    ],
    ids=["sampled", "greedy"],
)
def test_processed_logprobs_are_the_distribution_drawn_from(engines, target, params):
    speculative, _ = engines
    assert params.logprobs_mode == "processed"
    worst, raw_gap = 0.0, 0.0
    for output in speculative.generate(PROMPTS, params):
        tokens = output.prompt_token_ids + output.token_ids
        start = len(output.prompt_token_ids) - 1
        logits = full_logits(target, tokens)[start : start + len(output.token_ids)]
        pipeline = LogitsPipeline(params, VOCAB_SIZE, output.prompt_token_ids)
        if params.greedy:  # the argmax of the processed logits: their log_softmax
            processed = pipeline.processed_logits(logits, [], output.token_ids)
            expected = torch.log_softmax(processed, -1)
        else:
            expected = torch.log(pipeline.probs(logits, [], output.token_ids))
        raw = torch.log_softmax(logits, -1)
        for j, entry in enumerate(output.logprobs):
            assert entry.logprob > float("-inf")  # a drawn token was possible
            worst = max(worst, abs(entry.logprob - float(expected[j, entry.token_id])))
            finite = expected[j].topk(params.logprobs).values.tolist()
            assert entry.top_logprobs == pytest.approx(finite, abs=TOLERANCE)
            raw_gap = max(raw_gap, abs(entry.logprob - float(raw[j, entry.token_id])))
    assert worst <= TOLERANCE
    assert raw_gap > 100 * TOLERANCE  # negative control: the raw distribution is another


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", 1.5),
        ("logprobs_mode", "raw_logits"),
    ],
)
def test_bad_logprob_parameters_are_refused_by_name(field, value):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field and repr(value) in str(caught.value)


def _worst_difference_with_and_without_speculation(batch_invariant: bool) -> tuple[float, int]:
    """The largest |difference| between any log-probability (chosen, top, prompt) of the same
    greedy requests with and without speculation, and the drafted tokens accepted."""
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    target = tiny_llama(VOCAB_SIZE, seed=11, num_hidden_layers=2, hidden_size=64, **shape)
    draft = perturbed_copy(target, seed=12, noise=0.15)
    speculative = Engine(target, draft, 4, batch_invariant=batch_invariant)
    plain = Engine(target, None, batch_invariant=batch_invariant)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=4, prompt_logprobs=2)
    pairs, accepted = [], 0
    runs = zip(speculative.generate(PROMPTS, params), plain.generate(PROMPTS, params), strict=True)
    for a, b in runs:
        assert a.token_ids == b.token_ids
        accepted += a.metrics.num_accepted_tokens
        pairs += zip(a.logprobs, b.logprobs, strict=True)
        pairs += zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
    return largest_gap(pairs), accepted


def test_batch_invariant_logprobs_are_equal_with_and_without_speculation():
    """Batch-invariant mode (specray.models.batch_invariant): a verified block's rows are the
    rows one-token steps give, bitwise; the default mode's differ by rounding (the control)."""
    worst, accepted = _worst_difference_with_and_without_speculation(batch_invariant=True)
    assert accepted > MAX_TOKENS  # speculation did commit drafted tokens
    assert worst == 0.0
    control, _ = _worst_difference_with_and_without_speculation(batch_invariant=False)
    assert 0.0 < control <= TOLERANCE
