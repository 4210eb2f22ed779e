"""Property tests of :class:`SamplingParams`: any combination of values is either rejected with
:class:`SamplingParamsError` naming a parameter that was given, or accepted, and then the one
logits pipeline turns random logits rows into valid distributions (finite, non-negative, rows
summing to 1, zero on banned / not-allowed tokens, one-hot when greedy).

Bugs this found (huge ints, NaN rows, odd logit_bias keys) are fixed; the regression tests at
the bottom pin them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from specray.sampling import LogitsPipeline, SamplingParams, SamplingParamsError, sample_from_probs
from specray.sampling.params import MAX_SEED
from tests.fuzz.budget import fuzz_settings

VOCAB = 8
ROW_SUM_TOLERANCE = 1e-4

# ---- strategies ----------------------------------------------------------------------------
HUGE = [2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308]
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-3, 3), max_size=2),
    st.sampled_from(HUGE + SPECIAL_FLOATS),
    st.integers(),
    st.floats(),
)


def number(low: float, high: float, boundary: list) -> st.SearchStrategy:
    """Mostly values in ``[low, high]`` (so that combinations are often accepted), then values
    just outside it, the given boundary values, and junk."""
    inside = st.one_of(st.floats(low, high), st.integers(math.ceil(low), math.floor(high)))
    outside = st.one_of(st.floats(low - 1, high + 1), st.integers(int(low) - 2, int(high) + 2))
    return st.one_of(inside, inside, inside, outside, st.sampled_from(boundary), junk)


token_id = st.one_of(st.integers(-2, VOCAB + 2), st.sampled_from(HUGE), junk)
token_ids = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB + 2),
    st.lists(token_id, max_size=4),
    st.frozensets(st.integers(-1, VOCAB + 1), max_size=4),
    st.tuples(st.integers(0, VOCAB - 1)),
    st.sampled_from([[], list(range(10_000)), "12", b"\x01"]),
    junk,
)
bias_key = st.one_of(
    st.integers(-2, VOCAB + 2),
    st.integers(0, VOCAB + 2).map(str),
    st.sampled_from([*HUGE, "-1", "1.5", "", " 3", "\u0663", "\u00b2", "9" * 5000]),
    st.text(max_size=3),
    st.booleans(),
)
logit_bias = st.one_of(
    st.dictionaries(bias_key, number(-100, 100, [100, -100, 100.0001, -100.0001]), max_size=4),
    junk,
)

FIELDS = {
    "temperature": number(0, 3, [0, 1e-5, 9.99e-6, 1e38, 3.4e38, 3.5e38, 1e300]),
    "top_k": st.one_of(
        st.integers(0, VOCAB + 1), st.integers(0, VOCAB + 1), st.sampled_from([-1, *HUGE]), junk
    ),
    "top_p": number(0, 1, [0, 5e-324, 1e-300, 1, 1 + 2**-52, 0.5]),
    "min_p": number(0, 1, [0, 5e-324, 1, 1 + 2**-52, 0.999999]),
    "repetition_penalty": number(0, 3, [0, 5e-324, 1e-300, 1e-39, 1e-30, 1, 1e30, 1e300]),
    "presence_penalty": number(-2, 2, [-2, 2, 2 + 2**-51, -2 - 2**-51]),
    "frequency_penalty": number(-2, 2, [-2, 2, 2 + 2**-51, -2 - 2**-51]),
    "logit_bias": logit_bias,
    "allowed_token_ids": st.one_of(st.none(), token_ids),
    "banned_token_ids": st.one_of(st.none(), token_ids),
    "stop_token_ids": st.one_of(st.none(), token_ids),
    "ignore_eos": st.one_of(st.booleans(), st.booleans(), junk),
    "max_tokens": st.one_of(st.integers(1, 64), st.integers(-2, 0), st.sampled_from(HUGE), junk),
    "seed": st.one_of(
        st.none(), st.integers(-2, 2**64), st.sampled_from([MAX_SEED, MAX_SEED + 1]), junk
    ),
}
UNKNOWN_KEYS = ["max_token", "topk", "n", "stop", "Temperature", "", "\x00"]
# A few fields at a time (so that a good share of combinations is accepted), now and then
# with an unknown key.
param_dicts = (
    st.lists(st.sampled_from([*FIELDS, *FIELDS, "unknown"]), max_size=4, unique=True)
    .flatmap(
        lambda names: st.fixed_dictionaries(
            {
                name: FIELDS[name] if name in FIELDS else st.sampled_from(UNKNOWN_KEYS)
                for name in names
            }
        )
    )
    .map(lambda values: {values.pop("unknown"): 1, **values} if "unknown" in values else values)
)

logits_rows = st.integers(1, 3).flatmap(
    lambda rows: st.lists(
        st.lists(st.floats(-50, 50, width=32), min_size=VOCAB, max_size=VOCAB),
        min_size=rows,
        max_size=rows,
    )
)
history = st.lists(st.integers(0, VOCAB - 1), max_size=6)


# ---- the properties ------------------------------------------------------------------------
def _assert_names_a_given_parameter(error: SamplingParamsError, given: dict) -> None:
    assert error.param in given, f"{error} names {error.param!r}, not one of {sorted(given)}"
    assert error.param in str(error) or repr(error.param) in str(error), str(error)


NUMBER_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")  # fmt: skip


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _assert_valid_distribution(params: SamplingParams, probs: torch.Tensor, rows: int) -> None:
    assert probs.shape == (rows, VOCAB) and probs.dtype == torch.float32
    assert bool(torch.isfinite(probs).all()), (params, probs)
    assert bool((probs >= 0).all()), (params, probs)
    sums = probs.double().sum(dim=-1)
    assert bool(((sums - 1).abs() <= ROW_SUM_TOLERANCE).all()), (params, sums)
    if params.banned_token_ids:
        assert bool((probs[:, list(params.banned_token_ids)] == 0).all()), (params, probs)
    if params.allowed_token_ids is not None:
        outside = [t for t in range(VOCAB) if t not in params.allowed_token_ids]
        assert bool((probs[:, outside] == 0).all()), (params, probs)
    if params.greedy:
        assert bool(((probs == 0) | (probs == 1)).all()) and bool((probs.sum(-1) == 1).all())


@fuzz_settings(300)
@given(
    values=param_dicts,
    logits=logits_rows,
    prompt=history,
    output=history,
    candidates=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=2),
)
@example(
    values={"temperature": 0.0, "top_k": VOCAB + 5, "top_p": 5e-324, "min_p": 1.0},
    logits=[[0.0] * VOCAB],
    prompt=[],
    output=[],
    candidates=[0, 0],
)
@example(values={"max_tokens": 2**63, "seed": MAX_SEED}, logits=[[1.0] * VOCAB], prompt=[0],
         output=[], candidates=[1, 2])  # fmt: skip
@example(values={"temperature": 2**64}, logits=[[1.0] * VOCAB], prompt=[], output=[],
         candidates=[0, 0])  # fmt: skip
@example(values={"repetition_penalty": 10**400}, logits=[[1.0] * VOCAB], prompt=[], output=[],
         candidates=[0, 0])  # fmt: skip
def test_any_values_are_accepted_or_rejected_by_name(
    tally, values, logits, prompt, output, candidates
):
    tally.case()
    try:
        params = SamplingParams.from_dict(values)
    except SamplingParamsError as error:
        _assert_names_a_given_parameter(error, values)
        event(f"rejected: {error.param}")
        return
    assert SamplingParams.from_dict({name: getattr(params, name) for name in FIELDS}) == params, (
        "an accepted value re-validates to itself"
    )
    hash(params)
    try:
        params.check_vocab(VOCAB)
    except SamplingParamsError as error:
        _assert_names_a_given_parameter(error, values)
        event(f"rejected by check_vocab: {error.param}")
        return
    event("accepted (greedy)" if params.greedy else "accepted")
    rows = len(logits)
    pipeline = LogitsPipeline(params, VOCAB, prompt)
    # Row j's history is the prompt, the output and the candidates before row j.
    probs = pipeline.probs(torch.tensor(logits), output, candidates[: rows - 1])
    _assert_valid_distribution(params, probs, rows)


# ---- boundary values, one by one -----------------------------------------------------------
NAN, INF = math.nan, math.inf
BOUNDARIES = [
    # (field, value, None = accepted, else the parameter the error names)
    ("temperature", 0, None),
    ("temperature", -0.0, None),
    ("temperature", -1e-300, "temperature"),
    ("temperature", NAN, "temperature"),
    ("temperature", INF, "temperature"),
    ("temperature", True, "temperature"),
    ("temperature", "1", "temperature"),
    ("top_k", 0, None),
    ("top_k", -1, "top_k"),
    ("top_k", VOCAB + 1, None),
    ("top_k", 10**400, None),
    ("top_k", 1.0, "top_k"),
    ("top_p", 0, "top_p"),
    ("top_p", 5e-324, None),
    ("top_p", 1 + 2**-52, "top_p"),
    ("top_p", NAN, "top_p"),
    ("min_p", 1, None),
    ("min_p", -0.0, None),
    ("min_p", -5e-324, "min_p"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("repetition_penalty", -1, "repetition_penalty"),
    ("presence_penalty", 2, None),
    ("presence_penalty", 2.0000001, "presence_penalty"),
    ("frequency_penalty", -INF, "frequency_penalty"),
    ("logit_bias", {"3": 100}, None),
    ("logit_bias", {3: -100.0001}, "logit_bias"),
    ("logit_bias", {-1: 1}, "logit_bias"),
    ("logit_bias", {"-1": 1}, "logit_bias"),
    ("logit_bias", {True: 1}, "logit_bias"),
    ("logit_bias", {1: NAN}, "logit_bias"),
    ("logit_bias", {VOCAB: 1}, "logit_bias"),  # by check_vocab
    ("logit_bias", [1, 2], "logit_bias"),
    ("allowed_token_ids", [], "allowed_token_ids"),
    ("allowed_token_ids", [VOCAB], "allowed_token_ids"),  # by check_vocab
    ("allowed_token_ids", "123", "allowed_token_ids"),
    ("banned_token_ids", [], None),
    ("banned_token_ids", [-1], "banned_token_ids"),
    ("stop_token_ids", [], None),
    ("stop_token_ids", list(range(100_000)), "stop_token_ids"),  # by check_vocab
    ("stop_token_ids", [1.0], "stop_token_ids"),
    ("ignore_eos", 1, "ignore_eos"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 2**63, None),
    ("max_tokens", 16.0, "max_tokens"),
    ("seed", MAX_SEED, None),
    ("seed", MAX_SEED + 1, "seed"),
    ("seed", -1, "seed"),
]


@pytest.mark.parametrize(("field", "value", "rejected_as"), BOUNDARIES)
def test_boundary_value(field, value, rejected_as):
    try:
        params = SamplingParams.from_dict({field: value})
        params.check_vocab(VOCAB)
    except SamplingParamsError as error:
        assert error.param == rejected_as, str(error)
        assert field in str(error), str(error)
        return
    assert rejected_as is None, f"{field}={value!r} was accepted"


def test_allowed_inside_banned_is_rejected_by_name():
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(allowed_token_ids=[1, 2], banned_token_ids=[2, 1, 3])
    assert raised.value.param == "banned_token_ids"


# ---- fixed bugs: regression tests ----------------------------------------------------------
@pytest.mark.parametrize("key", ["\u00b2", "9" * 5000])
def test_unicode_digit_bias_key_is_named(key):
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(logit_bias={key: 1.0})
    assert raised.value.param == "logit_bias"


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
@pytest.mark.parametrize("value", [2**64, 10**400])
def test_huge_int_number_is_named(field, value):
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**{field: value})
    assert raised.value.param == field and field in str(raised.value)


@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_int_numbers_are_stored_as_floats(field):
    params = SamplingParams(**{field: 1 if field not in ("min_p",) else 0})
    assert type(getattr(params, field)) is float


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 1e39), ("temperature", 1e4 * (1 + 2**-52)), ("repetition_penalty", 1e-39),
     ("repetition_penalty", 1e39), ("repetition_penalty", 9.9e-5)],
)  # fmt: skip
def test_nan_prone_values_are_rejected_by_name(field, value):
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**{field: value}, banned_token_ids=[0])
    assert raised.value.param == field and field in str(raised.value)


@pytest.mark.parametrize(
    "values",
    [{"temperature": 1e4}, {"repetition_penalty": 1e-4}, {"repetition_penalty": 1e4}],
)
def test_bounds_give_finite_rows(values):
    params = SamplingParams(**values, banned_token_ids=[0])
    probs = LogitsPipeline(params, VOCAB, [1]).probs(torch.arange(VOCAB, dtype=torch.float32)[None])
    assert bool(torch.isfinite(probs).all()), probs
    assert float(probs[0, 0]) == 0


def test_subnormal_top_p_keeps_the_top_token():
    params = SamplingParams(top_p=5e-324)
    probs = LogitsPipeline(params, VOCAB).probs(torch.arange(VOCAB, dtype=torch.float32)[None])
    assert bool(torch.isfinite(probs).all()), probs
    assert float(probs[0, VOCAB - 1]) == 1.0


def test_banning_every_token_is_rejected_by_name():
    params = SamplingParams(banned_token_ids=list(range(VOCAB)))
    with pytest.raises(SamplingParamsError) as raised:
        params.check_vocab(VOCAB)
    assert raised.value.param == "banned_token_ids"


@pytest.mark.parametrize("row", [[math.nan, 1.0], [0.0, 0.0], [math.inf, 0.0]])
def test_sampling_refuses_rows_without_a_distribution(row):
    with pytest.raises(ValueError, match="sample_from_probs"):
        sample_from_probs(torch.tensor([row]), torch.tensor([0.5], dtype=torch.float64))
