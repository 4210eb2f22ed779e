"""Deterministic unit tests of the exactness core: params, pipeline, keyed RNG, verify, wire.

Every case uses one-hot / +-inf logits or exact numbers, except the uniformity checks of the
keyed RNG, which state their sample size, significance level and seeds.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import stats

import specray.sampling.rng as rng_module
from specray.sampling import (
    MAX_SPEC_LEN,
    DraftProbsEncoding,
    KeyedRandom,
    LogitsPipeline,
    Purpose,
    SamplingParams,
    SamplingParamsError,
    VerifyUniforms,
    WireTensor,
    decode_draft_probs,
    encode_draft_probs,
    greedy_committed,
    keyed_uniform,
    quantize_draft_probs,
    sample_from_probs,
    verify_batch,
    verify_batch_greedy,
    verify_batch_greedy_ids,
    verify_block,
)

NAN, INF, NEG_INF = float("nan"), float("inf"), float("-inf")
MAX_SEED = 2**63 - 1

# ---------------------------------------------------------------------------------------------
# SamplingParams

INVALID_PARAMS = [
    # (keyword arguments, parameter named, text of the bad value in the message)
    ({"temperature": -1}, "temperature", "-1"),
    ({"temperature": NAN}, "temperature", "nan"),
    ({"temperature": INF}, "temperature", "inf"),
    ({"temperature": "a"}, "temperature", "'a'"),
    ({"top_k": -1}, "top_k", "-1"),
    ({"top_k": 1.5}, "top_k", "1.5"),
    ({"top_k": True}, "top_k", "True"),
    ({"top_p": 0}, "top_p", "got 0"),
    ({"top_p": 1.5}, "top_p", "1.5"),
    ({"top_p": NAN}, "top_p", "nan"),
    ({"min_p": -0.1}, "min_p", "-0.1"),
    ({"min_p": 2}, "min_p", "got 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "got 0"),
    ({"repetition_penalty": -1}, "repetition_penalty", "-1"),
    ({"presence_penalty": 3}, "presence_penalty", "got 3"),
    ({"presence_penalty": -3}, "presence_penalty", "-3"),
    ({"presence_penalty": INF}, "presence_penalty", "inf"),
    ({"frequency_penalty": 3}, "frequency_penalty", "got 3"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
    ({"frequency_penalty": INF}, "frequency_penalty", "inf"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias", "'a'"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias", "1.5"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "-1"),
    ({"logit_bias": {3: 101}}, "logit_bias", "101"),
    ({"logit_bias": {3: -100.5}}, "logit_bias", "-100.5"),
    ({"logit_bias": {3: NAN}}, "logit_bias", "nan"),
    ({"logit_bias": [1, 2]}, "logit_bias", "[1, 2]"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": (1, 2), "banned_token_ids": (1, 2, 3)}, "banned_token_ids", "[1, 2]"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "-1"),
    ({"banned_token_ids": [2, -5]}, "banned_token_ids", "-5"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
    ({"stop_token_ids": "abc"}, "stop_token_ids", "'abc'"),
    ({"max_tokens": 0}, "max_tokens", "got 0"),
    ({"max_tokens": 2.0}, "max_tokens", "2.0"),
    ({"seed": -1}, "seed", "-1"),
    ({"seed": 2**63}, "seed", str(2**63)),
    ({"ignore_eos": "yes"}, "ignore_eos", "'yes'"),
]


@pytest.mark.parametrize(
    ("kwargs", "param", "bad_value"), INVALID_PARAMS, ids=[repr(c[0]) for c in INVALID_PARAMS]
)
def test_invalid_params_name_the_parameter_and_value(kwargs, param: str, bad_value: str) -> None:
    """Each invalid field raises SamplingParamsError naming the parameter and the bad value."""
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**kwargs)
    assert isinstance(error.value, ValueError)
    assert error.value.param.split("[")[0] == param
    assert param in str(error.value)
    assert bad_value in str(error.value)


def test_valid_edge_values_are_accepted() -> None:
    """The closed ends of every range are valid; JSON-style string keys of logit_bias too."""
    params = SamplingParams(
        temperature=0,
        top_p=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={"5": 100, 0: -100},
        seed=MAX_SEED,
        max_tokens=1,
    )
    assert dict(params.logit_bias) == {5: 100.0, 0: -100.0}
    assert params.greedy
    assert SamplingParams(seed=0).seed == 0


@pytest.mark.parametrize(
    "field_name", ["logit_bias", "allowed_token_ids", "banned_token_ids", "stop_token_ids"]
)
def test_check_vocab_rejects_out_of_vocabulary_ids(field_name: str) -> None:
    """check_vocab names the field holding an id >= vocab_size; vocab_size - 1 is fine."""
    value = {9: 1.0} if field_name == "logit_bias" else (0, 9)
    params = SamplingParams(**{field_name: value})
    params.check_vocab(10)
    with pytest.raises(SamplingParamsError) as error:
        params.check_vocab(9)
    assert error.value.param == field_name
    assert field_name in str(error.value) and "9" in str(error.value)
    with pytest.raises(SamplingParamsError):
        LogitsPipeline(params, 9)  # the pipeline checks the vocabulary on construction


def test_from_dict_rejects_unknown_keys() -> None:
    """Unknown keys are errors naming the key; known keys build the same params."""
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 0.5})
    assert error.value.param == "temprature"
    assert "'temprature'" in str(error.value)
    assert SamplingParams.from_dict({"top_k": 3, "logit_bias": {"2": 1.0}}) == SamplingParams(
        top_k=3, logit_bias={2: 1.0}
    )


def test_params_are_frozen() -> None:
    """No field can be reassigned, the bias mapping is read-only, and id lists are copied."""
    allowed = [3, 1, 3]
    params = SamplingParams(allowed_token_ids=allowed, logit_bias={1: 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5
    with pytest.raises(TypeError):
        params.logit_bias[1] = 5.0
    allowed.append(7)
    assert params.allowed_token_ids == (1, 3)  # sorted, deduplicated, detached from the input
    reseeded = params.with_seed(42)
    assert reseeded.seed == 42 and params.seed is None
    assert dataclasses.replace(reseeded, seed=None) == params


# ---------------------------------------------------------------------------------------------
# LogitsPipeline


def probs_of(params: SamplingParams, logits: list[float], **history) -> torch.Tensor:
    """Distribution of one row of raw logits (history: output_token_ids, candidate_token_ids)."""
    return LogitsPipeline(params, len(logits)).probs(torch.tensor([logits]), **history)[0]


def support(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


def test_greedy_is_one_hot_at_argmax_ties_to_lowest_id() -> None:
    """temperature 0: one-hot at the argmax after bias and masks, ties to the lowest id."""
    greedy = SamplingParams(temperature=0)
    assert probs_of(greedy, [1.0, 3.0, 3.0, 2.0]).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs_of(greedy, [NEG_INF, 0.0, 0.0]).tolist() == [0.0, 1.0, 0.0]
    banned = SamplingParams(temperature=0, banned_token_ids=(1,))
    assert probs_of(banned, [1.0, 3.0, 3.0, 2.0]).tolist() == [0.0, 0.0, 1.0, 0.0]
    biased = SamplingParams(temperature=0, logit_bias={3: 1.0})
    assert probs_of(biased, [1.0, 3.0, 3.0, 2.0]).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_token_ids_are_the_argmax_of_the_one_hot_rows() -> None:
    """The greedy fast path (ids, no [rows, vocab] one-hot) picks what probs' one-hot picks,
    ties to the lowest id, after bias, masks and penalties, row j seeing its candidates."""
    generator = torch.Generator().manual_seed(7)
    settings = [
        {},
        {"banned_token_ids": (1, 4)},
        {"logit_bias": {3: 2.5}},
        {"repetition_penalty": 1.7},
        {"frequency_penalty": 0.8, "presence_penalty": 0.5},
    ]
    for extra in settings:
        params = SamplingParams(temperature=0, **extra)
        pipeline = LogitsPipeline(params, 8, prompt_token_ids=[2, 3])
        for _ in range(20):
            logits = torch.randint(-2, 3, (4, 8), generator=generator).float()  # many ties
            history = {"output_token_ids": [5, 5, 1], "candidate_token_ids": [3, 5, 6]}
            ids = pipeline.greedy_token_ids(logits, **history)
            assert ids.dtype == torch.int64 and ids.shape == (4,)
            assert ids.tolist() == pipeline.probs(logits, **history).argmax(dim=-1).tolist()


def test_temperature_scales_logits() -> None:
    """probs = softmax(logits / temperature)."""
    logits = [0.5, -1.0, 2.0]
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
        got = probs_of(SamplingParams(temperature=temperature), logits)
        torch.testing.assert_close(got, expected)


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    """top_k = 2 over [3, 2, 2, 1]: both tokens tied at the 2nd value are kept."""
    probs = probs_of(SamplingParams(top_k=2), [3.0, 2.0, 2.0, 1.0])
    assert support(probs) == [0, 1, 2]
    torch.testing.assert_close(probs[:3], torch.softmax(torch.tensor([3.0, 2.0, 2.0]), dim=-1))
    assert support(probs_of(SamplingParams(top_k=1), [0.0, 5.0, 1.0])) == [1]
    assert support(probs_of(SamplingParams(top_k=9), [0.0, 5.0, 1.0])) == [0, 1, 2]  # >= vocab


def test_top_p_keeps_the_smallest_set_reaching_top_p() -> None:
    """probs [0.5, 0.3, 0.15, 0.05]: top_p 0.75 keeps {0, 1}, 0.85 keeps {0, 1, 2}."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    kept = probs_of(SamplingParams(top_p=0.75), logits)
    assert support(kept) == [0, 1]
    torch.testing.assert_close(kept[:2], torch.tensor([0.5, 0.3]) / 0.8)
    assert support(probs_of(SamplingParams(top_p=0.85), logits)) == [0, 1, 2]
    assert support(probs_of(SamplingParams(top_p=0.96), logits)) == [0, 1, 2, 3]
    assert support(probs_of(SamplingParams(top_p=1e-6), logits)) == [0]  # first always kept
    shuffled = [logits[2], logits[0], logits[3], logits[1]]  # order in the vocabulary is free
    assert support(probs_of(SamplingParams(top_p=0.75), shuffled)) == [1, 3]


def test_min_p_drops_tokens_below_a_fraction_of_the_max() -> None:
    """probs [0.5, 0.3, 0.15, 0.05]: min_p 0.2 (threshold 0.1) drops token 3; 0.7 keeps 0."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    kept = probs_of(SamplingParams(min_p=0.2), logits)
    assert support(kept) == [0, 1, 2]
    torch.testing.assert_close(kept[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    assert support(probs_of(SamplingParams(min_p=0.7), logits)) == [0]


def test_logit_bias_is_added_to_the_logits() -> None:
    """logit_bias {0: 2, 2: -1} on zero logits: softmax([2, 0, -1])."""
    probs = probs_of(SamplingParams(logit_bias={0: 2.0, 2: -1.0}), [0.0, 0.0, 0.0])
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([2.0, 0.0, -1.0]), dim=-1))


def test_allowed_and_banned_masks() -> None:
    """Tokens outside allowed_token_ids or inside banned_token_ids get exactly 0."""
    logits = [5.0, 1.0, 2.0, 3.0]
    assert support(probs_of(SamplingParams(allowed_token_ids=(1, 2)), logits)) == [1, 2]
    assert support(probs_of(SamplingParams(banned_token_ids=(0, 3)), logits)) == [1, 2]
    both = SamplingParams(allowed_token_ids=(0, 1, 2), banned_token_ids=(0,))
    assert support(probs_of(both, logits)) == [1, 2]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    """repetition_penalty 2 on prompt token 0 and output token 1 (and nothing else)."""
    params = SamplingParams(repetition_penalty=2.0)
    pipeline = LogitsPipeline(params, 4, prompt_token_ids=[0])
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    processed = pipeline.processed_logits(logits, output_token_ids=[1])
    assert processed.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    probs = pipeline.probs(logits, output_token_ids=[1])
    torch.testing.assert_close(probs, torch.softmax(processed, dim=-1))


def test_presence_and_frequency_penalties_use_output_tokens_only() -> None:
    """presence 0.5, frequency 0.25, output [1, 1, 2], prompt [0]: [0, -1, -0.75, 0]."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    pipeline = LogitsPipeline(params, 4, prompt_token_ids=[0])
    processed = pipeline.processed_logits(torch.zeros(1, 4), output_token_ids=[1, 1, 2])
    assert processed.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_row_j_sees_the_candidate_prefix() -> None:
    """Row j's history is the output plus candidate_token_ids[:j] (never later candidates)."""
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
    pipeline = LogitsPipeline(params, 4)
    logits = torch.ones(4, 4)
    processed = pipeline.processed_logits(
        logits, output_token_ids=[0], candidate_token_ids=[2, 2, 3]
    )
    assert processed.tolist() == [
        [-0.5, 1.0, 1.0, 1.0],  # output [0]: 1 / 2 - 1
        [-0.5, 1.0, -0.5, 1.0],  # + candidate 2
        [-0.5, 1.0, -1.5, 1.0],  # + candidate 2 again: 1 / 2 - 2
        [-0.5, 1.0, -1.5, -0.5],  # + candidate 3
    ]
    with pytest.raises(ValueError, match="candidate tokens"):
        pipeline.processed_logits(logits, output_token_ids=[0], candidate_token_ids=[2, 2])


def test_probs_rows_are_float32_distributions() -> None:
    """Every row is a float32 distribution summing to 1."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.01)
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * 3
    probs = LogitsPipeline(params, 32).probs(logits, candidate_token_ids=[1] * 5)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(6))


def test_tiny_temperature_gives_a_distribution() -> None:
    """Any temperature that SamplingParams accepts yields finite probabilities."""
    probs = probs_of(SamplingParams(temperature=1e-40), [1.0, 2.0, 2.0])
    assert bool(torch.isfinite(probs).all())


# ---------------------------------------------------------------------------------------------
# Keyed randomness


def test_keyed_uniform_is_a_pure_function_in_the_open_unit_interval() -> None:
    """Same key, same value; every value in (0, 1); each key part changes the value."""
    keys = [(0, 0), (1, 0), (0, 1), (MAX_SEED, 0), (7, 10**9), (2**40 + 3, 123)]
    for seed, position in keys:
        for purpose in Purpose:
            value = keyed_uniform(seed, position, purpose)
            assert 0.0 < value < 1.0
            assert value == keyed_uniform(seed, position, purpose)
    base = keyed_uniform(7, 3, Purpose.ACCEPT)
    assert base != keyed_uniform(8, 3, Purpose.ACCEPT)
    assert base != keyed_uniform(7, 4, Purpose.ACCEPT)
    assert len({keyed_uniform(7, 3, purpose) for purpose in Purpose}) == len(Purpose)


def test_keyed_random_matches_keyed_uniform() -> None:
    """KeyedRandom.uniforms is keyed_uniform at each position, float64, fresh instance or not."""
    positions = [0, 5, 2, 5]
    values = KeyedRandom(11).uniforms(positions, Purpose.RESIDUAL)
    assert values.dtype == torch.float64
    assert values.tolist() == [keyed_uniform(11, i, Purpose.RESIDUAL) for i in positions]
    assert torch.equal(values, KeyedRandom(11).uniforms(positions, Purpose.RESIDUAL))


@pytest.mark.parametrize("axis", ["position", "seed"])
def test_keyed_uniform_is_uniform(axis: str) -> None:
    """KS test against U(0, 1): n = 20000 draws, alpha = 0.001, purpose ACCEPT.

    axis "position": seed 12345, positions 0..19999; axis "seed": seeds 0..19999, position 0.
    """
    n, alpha = 20_000, 1e-3
    if axis == "position":
        draws = [keyed_uniform(12345, i, Purpose.ACCEPT) for i in range(n)]
    else:
        draws = [keyed_uniform(i, 0, Purpose.ACCEPT) for i in range(n)]
    assert stats.kstest(draws, "uniform").pvalue > alpha


def test_keyed_uniform_extreme_bits_stay_inside_the_open_interval(monkeypatch) -> None:
    """The largest and smallest 64-bit draws map strictly inside (0, 1)."""
    for bits in (0, 2**64 - 1):
        monkeypatch.setattr(rng_module, "_splitmix64", lambda _z, bits=bits: bits)
        assert 0.0 < keyed_uniform(0, 0, Purpose.ACCEPT) < 1.0


def test_verify_uniforms_are_keyed_by_output_position() -> None:
    """draw(KeyedRandom): draft position j is output position first_position + j."""
    uniforms = VerifyUniforms.draw(KeyedRandom(5), k=3, first_position=10)
    assert uniforms.accept.tolist() == [
        [keyed_uniform(5, 10 + j, Purpose.ACCEPT) for j in range(3)]
    ]
    assert uniforms.residual.tolist() == [
        [keyed_uniform(5, 10 + j, Purpose.RESIDUAL) for j in range(3)]
    ]
    assert uniforms.bonus.tolist() == [keyed_uniform(5, 13, Purpose.BONUS)]
    drawn = VerifyUniforms.draw(torch.Generator().manual_seed(0), k=3)
    assert drawn.accept.shape == (1, 3) and drawn.residual.shape == (1, 3)
    assert drawn.bonus.shape == (1,) and drawn.bonus.dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# sample_from_probs


def sample(probs: list[float], uniform: float) -> int:
    uniforms = torch.tensor([uniform], dtype=torch.float64)
    return int(sample_from_probs(torch.tensor([probs], dtype=torch.float64), uniforms)[0])


def test_zero_probability_tokens_are_never_chosen_at_the_edges() -> None:
    """u next to 0 and next to 1 pick the first / last token of positive mass, never a zero."""
    probs = [0.0, 0.5, 0.0, 0.5, 0.0]
    assert sample(probs, 2.0**-54) == 1
    assert sample(probs, math.nextafter(1.0, 0.0)) == 3
    assert sample(probs, 1.0) == 3  # u * total rounding up to total falls back to the last
    assert sample([0.3, 0.7, 0.0], 1.0) == 1
    assert sample([0.0, 0.0, 1.0], 2.0**-54) == 2


def test_interval_boundaries_belong_to_the_upper_token() -> None:
    """Token i iff cdf[i-1] <= u * total < cdf[i]: exact boundaries go up."""
    probs = [0.25, 0.25, 0.5]
    assert sample(probs, math.nextafter(0.25, 0.0)) == 0
    assert sample(probs, 0.25) == 1
    assert sample(probs, math.nextafter(0.5, 0.0)) == 1
    assert sample(probs, 0.5) == 2
    assert sample([1.0, 3.0], 0.25) == 1  # unnormalised: total 4, boundary at u = 0.25
    assert sample([1.0, 3.0], math.nextafter(0.25, 0.0)) == 0
    assert sample([0.5, 0.0, 0.5], 0.5) == 2  # the zero-width cell of token 1 is skipped


def test_sample_from_probs_frequencies_on_a_grid() -> None:
    """On a grid of 1000 midpoint uniforms each token is chosen exactly 1000 * p times."""
    probs = torch.tensor([0.125, 0.0, 0.5, 0.375])
    uniforms = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    token_ids = sample_from_probs(probs.expand(1000, -1), uniforms)
    assert torch.bincount(token_ids, minlength=4).tolist() == [125, 0, 500, 375]


# ---------------------------------------------------------------------------------------------
# verify_block / verify_batch (stochastic rule)


def block_inputs(k: int = 3, vocab: int = 6, seed: int = 0):
    """Draft ids sampled from q, q = softmax(draft logits), p = softmax(target logits)."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=generator), dim=-1)
    target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=generator), dim=-1)
    draft_ids = torch.multinomial(draft_probs, 1, generator=generator).flatten()
    return draft_ids, draft_probs, target_probs


def test_verify_block_same_generator_seed_same_result() -> None:
    """A torch.Generator seeded the same gives the same round."""
    inputs = block_inputs()
    for seed in range(20):
        first = verify_block(*inputs, rng=torch.Generator().manual_seed(seed))
        again = verify_block(*inputs, rng=torch.Generator().manual_seed(seed))
        assert torch.equal(first.token_ids, again.token_ids)
        assert first.num_accepted == again.num_accepted


def test_verify_block_same_key_same_result() -> None:
    """KeyedRandom: same seed and first_position give the same round; it equals verify_batch
    fed with the keyed uniforms drawn at those positions."""
    draft_ids, draft_probs, target_probs = block_inputs()
    results = set()
    for first_position in range(30):
        first = verify_block(
            draft_ids, draft_probs, target_probs, rng=KeyedRandom(9), first_position=first_position
        )
        again = verify_block(
            draft_ids, draft_probs, target_probs, rng=KeyedRandom(9), first_position=first_position
        )
        assert first.token_ids.tolist() == again.token_ids.tolist()
        uniforms = VerifyUniforms.draw(KeyedRandom(9), 3, first_position)
        batch = verify_batch(
            draft_ids[None], torch.tensor([3]), draft_probs[None], target_probs[None], uniforms
        )
        assert batch.row(0).token_ids.tolist() == first.token_ids.tolist()
        results.add(tuple(first.token_ids.tolist()))
    assert len(results) > 1  # the position is part of the key


def test_verify_block_commits_one_to_k_plus_one_tokens() -> None:
    """Each round commits the accepted prefix of the draft plus one token: 1..k+1, all seen."""
    k = 3
    draft_ids = torch.tensor([0, 0, 0])
    draft_probs = torch.tensor([[0.5, 0.3, 0.2]]).repeat(k, 1)
    target_probs = torch.tensor([[0.35, 0.4, 0.25]]).repeat(k + 1, 1)  # accept with 0.7
    lengths = set()
    for seed in range(400):
        result = verify_block(
            draft_ids, draft_probs, target_probs, rng=torch.Generator().manual_seed(seed)
        )
        assert len(result.token_ids) == result.num_accepted + 1
        assert 1 <= len(result.token_ids) <= k + 1
        assert (
            result.token_ids[: result.num_accepted].tolist()
            == draft_ids[: result.num_accepted].tolist()
        )
        lengths.add(len(result.token_ids))
    assert lengths == {1, 2, 3, 4}


def test_verify_block_leaves_the_global_rng_alone() -> None:
    """Neither a Generator nor a KeyedRandom touches torch's global RNG state."""
    inputs = block_inputs()
    state = torch.get_rng_state()
    verify_block(*inputs, rng=torch.Generator().manual_seed(1))
    verify_block(*inputs, rng=KeyedRandom(1))
    assert torch.equal(state, torch.get_rng_state())


def test_deterministic_corner_cases() -> None:
    """p == q accepts everything; p(d) = 0 always rejects, recovering from the residual."""
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    same = torch.cat([draft_probs, torch.tensor([[0.0, 0.0, 1.0]])])
    for seed in range(20):
        result = verify_block(torch.tensor([1, 2]), draft_probs, same, rng=KeyedRandom(seed))
        assert result.token_ids.tolist() == [1, 2, 2]
    target = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    for seed in range(20):
        result = verify_block(torch.tensor([1, 2]), draft_probs, target, rng=KeyedRandom(seed))
        assert result.token_ids.tolist() == [0]  # residual max(0, p - q) = [0.5, 0, 0]


def test_batch_rows_do_not_depend_on_each_other() -> None:
    """A request's round is the same alone or inside a batch (docs/design.md 1.6)."""
    rows = [block_inputs(seed=seed) for seed in range(3)]
    uniforms = [VerifyUniforms.draw(KeyedRandom(seed), 3, 7) for seed in range(3)]
    batch = verify_batch(
        torch.stack([row[0] for row in rows]),
        torch.tensor([3, 1, 0]),
        torch.stack([row[1] for row in rows]),
        torch.stack([row[2] for row in rows]),
        VerifyUniforms(
            torch.cat([u.accept for u in uniforms]),
            torch.cat([u.residual for u in uniforms]),
            torch.cat([u.bonus for u in uniforms]),
        ),
    )
    for index, (row, u) in enumerate(zip(rows, uniforms, strict=True)):
        num_draft = [3, 1, 0][index]
        alone = verify_batch(row[0][None], torch.tensor([num_draft]), row[1][None], row[2][None], u)
        assert batch.row(index).token_ids.tolist() == alone.row(0).token_ids.tolist()


def test_zero_draft_tokens_is_target_sampling_with_the_bonus_draw() -> None:
    """num_draft_tokens = 0: the committed token is sample(p_0, bonus); no other draw counts."""
    draft_ids, draft_probs, target_probs = block_inputs()
    for bonus in (0.01, 0.3, 0.6, 0.99):
        for accept in (1e-9, 0.999):
            uniforms = VerifyUniforms(
                torch.full((1, 3), accept, dtype=torch.float64),
                torch.full((1, 3), 0.5, dtype=torch.float64),
                torch.tensor([bonus], dtype=torch.float64),
            )
            result = verify_batch(
                draft_ids[None], torch.tensor([0]), draft_probs[None], target_probs[None], uniforms
            )
            expected = sample_from_probs(target_probs[:1], torch.tensor([bonus]))
            assert result.row(0).token_ids.tolist() == expected.tolist()


def test_verify_block_rejects_a_draft_token_with_zero_draft_probability() -> None:
    """q(d) = 0 for a drafted d is an invalid proposal: ValueError."""
    draft_ids, draft_probs, target_probs = block_inputs()
    draft_probs[1, draft_ids[1]] = 0.0
    with pytest.raises(ValueError, match=r"q\(d\) > 0"):
        verify_block(draft_ids, draft_probs, target_probs, rng=KeyedRandom(0))


@pytest.mark.parametrize(
    "mutation",
    [
        "target_k_rows",
        "target_wrong_vocab",
        "draft_wrong_vocab",
        "draft_k_plus_1_rows",
        "draft_id_too_large",
        "draft_id_negative",
    ],
)
def test_verify_block_shape_and_range_checks(mutation: str) -> None:
    """Inconsistent shapes and out-of-range draft ids raise ValueError before any sampling."""
    draft_ids, draft_probs, target_probs = block_inputs(k=3, vocab=6)
    if mutation == "target_k_rows":
        target_probs = target_probs[:3]
    elif mutation == "target_wrong_vocab":
        target_probs = torch.cat([target_probs, torch.zeros(4, 1)], dim=1)
    elif mutation == "draft_wrong_vocab":
        draft_probs = draft_probs[:, :5]
    elif mutation == "draft_k_plus_1_rows":
        draft_probs = torch.cat([draft_probs, draft_probs[:1]])
    elif mutation == "draft_id_too_large":
        draft_ids = torch.tensor([0, 6, 1])
    else:
        draft_ids = torch.tensor([0, -1, 1])
    with pytest.raises(ValueError):
        verify_block(draft_ids, draft_probs, target_probs, rng=KeyedRandom(0))


def test_verify_batch_rejects_bad_num_draft_tokens() -> None:
    """num_draft_tokens must be [batch] with values in [0, k]."""
    draft_ids, draft_probs, target_probs = block_inputs()
    uniforms = VerifyUniforms.draw(KeyedRandom(0), 3)
    for num_draft in ([4], [-1], [3, 3]):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            verify_batch(
                draft_ids[None],
                torch.tensor(num_draft),
                draft_probs[None],
                target_probs[None],
                uniforms,
            )


def test_k_above_max_spec_len_is_rejected() -> None:
    """k = MAX_SPEC_LEN is allowed, k = MAX_SPEC_LEN + 1 raises ValueError naming it."""
    for k in (MAX_SPEC_LEN, MAX_SPEC_LEN + 1):
        draft_probs = torch.full((k, 4), 0.25)
        target_probs = torch.full((k + 1, 4), 0.25)
        draft_ids = torch.zeros(k, dtype=torch.int64)
        if k <= MAX_SPEC_LEN:
            result = verify_block(draft_ids, draft_probs, target_probs, rng=KeyedRandom(0))
            assert result.num_accepted == k
        else:
            with pytest.raises(ValueError, match="MAX_SPEC_LEN"):
                verify_block(draft_ids, draft_probs, target_probs, rng=KeyedRandom(0))


# ---------------------------------------------------------------------------------------------
# Wire encodings


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_wire_tensor_round_trip(dtype: torch.dtype) -> None:
    """from_tensor / to_tensor is the identity, also for a non-contiguous view."""
    tensor = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 7.5).to(dtype)
    for source in (tensor, tensor.transpose(0, 2)):
        wire = WireTensor.from_tensor(source)
        assert len(wire.data) == source.numel() * source.element_size()
        back = wire.to_tensor()
        assert back.dtype == dtype and back.shape == source.shape
        assert torch.equal(back, source)


def test_wire_tensor_is_little_endian() -> None:
    """Raw bytes are little-endian, whatever the host."""
    wire = WireTensor.from_tensor(torch.tensor([1, 256], dtype=torch.int32))
    assert wire.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert wire.dtype == "int32" and wire.shape == (2,)


def test_wire_tensor_rejects_wrong_byte_length_and_unknown_dtype() -> None:
    """to_tensor checks the byte count against dtype and shape, and the dtype name."""
    with pytest.raises(ValueError, match="needs 24 bytes, got 20"):
        WireTensor(b"\x00" * 20, "float32", (2, 3)).to_tensor()
    with pytest.raises(ValueError, match="float64"):
        WireTensor(b"\x00" * 48, "float64", (2, 3)).to_tensor()


def test_wire_tensor_rejects_an_unsupported_dtype_with_value_error() -> None:
    """A dtype the wire does not carry is a ValueError naming it."""
    with pytest.raises(ValueError, match="int64"):
        WireTensor.from_tensor(torch.tensor([1, 2]))


def test_wire_tensor_round_trip_of_an_empty_tensor() -> None:
    """A k = 0 block of q, shape [0, vocab], round trips."""
    empty = torch.zeros(0, 4)
    assert WireTensor.from_tensor(empty).to_tensor().shape == (0, 4)


def draft_rows(vocab: int = 50) -> torch.Tensor:
    """Three rows of q: smooth, peaked (entries down to ~1e-20), and one with a 1e-9 entry."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=generator)
    logits[1] *= 12.0
    rows = torch.softmax(logits, dim=-1)
    rows[2, 7] = 1e-9
    return rows / rows.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "top1", "top8", "top64"])
def test_decoded_rows_are_distributions(name: str) -> None:
    """Every encoding decodes to float32 rows of the right shape summing to 1 within 1e-6,
    and quantize_draft_probs is exactly decode(encode(q))."""
    draft_probs = draft_rows()
    encoding = DraftProbsEncoding.parse(name)
    decoded = decode_draft_probs(encode_draft_probs(draft_probs, encoding))
    assert decoded.dtype == torch.float32 and decoded.shape == draft_probs.shape
    assert bool((decoded >= 0).all())
    assert float((decoded.double().sum(dim=-1) - 1).abs().max()) <= 1e-6
    if name != "fp32":  # fp32 is returned as given (already exact)
        assert torch.equal(quantize_draft_probs(draft_probs, encoding), decoded)


def test_dense_encodings_keep_values_and_sizes() -> None:
    """fp32 is lossless, fp16 / bf16 keep values to their precision; bytes = k * vocab * size."""
    draft_probs = draft_rows()
    k, vocab = draft_probs.shape
    for name, size, rtol in [("fp32", 4, 1e-6), ("fp16", 2, 1e-3), ("bf16", 2, 1e-2)]:
        encoded = encode_draft_probs(draft_probs, DraftProbsEncoding.parse(name))
        assert encoded.num_bytes == k * vocab * size and encoded.token_ids is None
        decoded = decode_draft_probs(encoded)
        big = draft_probs > 1e-3
        torch.testing.assert_close(decoded[big], draft_probs[big], rtol=rtol, atol=0)


def test_fp16_flushes_tiny_values_bf16_keeps_them() -> None:
    """q = 1e-9 is below fp16's smallest subnormal (~6e-8): decoded 0; bf16 keeps it."""
    draft_probs = draft_rows()
    fp16 = quantize_draft_probs(draft_probs, DraftProbsEncoding.parse("fp16"))
    bf16 = quantize_draft_probs(draft_probs, DraftProbsEncoding.parse("bf16"))
    assert fp16[2, 7] == 0.0
    assert bf16[2, 7] > 0.0
    assert bool((fp16[draft_probs < 2e-8] == 0).all())


def test_sparse_encoding_keeps_the_top_m() -> None:
    """top8 keeps exactly the 8 most likely ids of each row, renormalised; bytes = k*M*(4+4)."""
    draft_probs = draft_rows()
    k, _ = draft_probs.shape
    encoded = encode_draft_probs(draft_probs, DraftProbsEncoding.parse("top8"))
    assert encoded.num_bytes == k * 8 * (4 + 4)
    decoded = decode_draft_probs(encoded)
    for row in range(k):
        top = torch.topk(draft_probs[row], 8).indices
        assert set(support(decoded[row])) == set(top.tolist())
        expected = draft_probs[row, top] / draft_probs[row, top].sum()
        torch.testing.assert_close(decoded[row, top], expected, rtol=1e-6, atol=0)
    wide = decode_draft_probs(encode_draft_probs(draft_probs, DraftProbsEncoding.parse("top64")))
    torch.testing.assert_close(wide, draft_probs, rtol=1e-5, atol=1e-12)  # M > vocab: dense


def test_encoding_parse() -> None:
    """Valid names parse; anything else raises ValueError naming draft_probs_encoding."""
    assert DraftProbsEncoding.parse("fp16") == DraftProbsEncoding("fp16")
    assert not DraftProbsEncoding.parse("bf16").sparse
    top = DraftProbsEncoding.parse("top64")
    assert top.sparse and top.top_m == 64
    for bad in ["", "fp8", "FP16", " fp16", "top", "top0", "top-1", "top4x", "int8", "dense"]:
        with pytest.raises(ValueError, match="draft_probs_encoding") as error:
            DraftProbsEncoding.parse(bad)
        assert repr(bad) in str(error.value)


def test_greedy_rule_from_ids_equals_the_rule_from_distributions() -> None:
    """verify_batch_greedy_ids on the argmax ids commits exactly what verify_batch_greedy
    commits on the [batch, k+1, vocab] rows, over random blocks with partial acceptance."""
    generator = torch.Generator().manual_seed(11)
    batch, k, vocab = 6, 4, 5  # a small vocabulary: drafts often match
    for _ in range(200):
        target = torch.randint(-2, 3, (batch, k + 1, vocab), generator=generator).float()
        drafts = torch.randint(0, vocab, (batch, k), generator=generator)
        num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
        dense = verify_batch_greedy(drafts, num_draft, target)
        ids = verify_batch_greedy_ids(drafts, num_draft, target.argmax(dim=-1))
        assert torch.equal(dense.token_ids, ids.token_ids)
        assert torch.equal(dense.num_accepted, ids.num_accepted)


def test_host_greedy_rule_equals_the_batched_rule() -> None:
    """greedy_committed (the host rule a round uses) commits exactly each row's tokens of
    verify_batch_greedy_ids, over random blocks with partial and full acceptance; its worked
    example; a wrong number of argmax ids is named."""
    generator = torch.Generator().manual_seed(12)
    batch, k, vocab = 6, 4, 3  # a small vocabulary: drafts often match, blocks are accepted whole
    whole = 0
    for _ in range(300):
        drafts = torch.randint(0, vocab, (batch, k), generator=generator)
        num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
        argmax = torch.randint(0, vocab, (batch, k + 1), generator=generator)
        batched = verify_batch_greedy_ids(drafts, num_draft, argmax)
        for row in range(batch):
            n = int(num_draft[row])
            expected = batched.row(row).token_ids.tolist()
            assert greedy_committed(drafts[row, :n].tolist(), argmax[row, : n + 1].tolist()) == (
                expected
            )
            whole += n > 0 and len(expected) == n + 1
    assert whole > 50  # the bonus path ran
    assert greedy_committed([5, 7, 9], [5, 7, 2, 4]) == [5, 7, 2]
    assert greedy_committed([5, 7], [5, 7, 3]) == [5, 7, 3]
    assert greedy_committed([], [8]) == [8]
    with pytest.raises(ValueError, match=r"target_argmax must have 3 ids .*, got 2"):
        greedy_committed([1, 2], [1, 2])


def test_greedy_rule_from_ids_names_a_bad_shape() -> None:
    drafts, num_draft = torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 1])
    with pytest.raises(ValueError, match=r"target_argmax must have shape \(2, 4\), got \(2, 3\)"):
        verify_batch_greedy_ids(drafts, num_draft, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[0, 3\]"):
        verify_batch_greedy_ids(drafts, torch.tensor([4, 0]), torch.zeros(2, 4, dtype=torch.int64))


@pytest.mark.parametrize(
    ("options", "eos"),
    [
        ({"allowed_token_ids": [0], "stop_token_ids": [0]}, frozenset()),
        ({"allowed_token_ids": [4]}, frozenset({4})),  # the only allowed token is EOS
        ({"banned_token_ids": [0, 1, 2], "stop_token_ids": [3]}, frozenset({4})),
    ],
)
def test_min_tokens_must_leave_a_token_to_draw(options, eos) -> None:
    """Before min_tokens the stop ids are masked: nothing left to draw is refused by name (a
    NaN row otherwise); the same request without min_tokens, or ignoring EOS, is fine."""
    params = SamplingParams(max_tokens=2, min_tokens=1, **options)
    with pytest.raises(SamplingParamsError) as caught:
        params.check_vocab(5, eos)
    assert caught.value.param == "min_tokens"
    SamplingParams(max_tokens=2, **options).check_vocab(5, eos)
    if not options.get("stop_token_ids"):
        SamplingParams(max_tokens=2, min_tokens=1, ignore_eos=True, **options).check_vocab(5, eos)
