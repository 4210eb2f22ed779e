"""Whole generations through ``Engine.generate`` follow the target's exact sequence
distribution (docs/design.md 1, proof obligation (b), in-process path).

Setup. Target: ``tiny_llama(5, seed=0)``; draft: a *different* tiny Llama over the same five
tokens, the target's weights plus Gaussian noise of half each tensor's standard deviation
(``perturbed_copy(target, seed=1, 0.5)``), so acceptance is partial (~0.6) and every branch of
the rule runs: accepted drafts, recovered tokens from the residual, bonus tokens.
Each case generates ``NUM_SAMPLES`` = 2000 continuations of one fixed prompt of token ids, all
in ONE ``generate`` call (``max_batch_size`` = N, so they run batched), request i seeded with i
(seeds 0..N-1), ``max_tokens`` = L, ``ignore_eos=True``. L = 3 with k = 2 (k is capped at
``remaining - 1``, so a k = 3 case needs L = 4).

Oracle. The exact probability of each of the 5**L sequences, by enumeration:
``prod_j LogitsPipeline(params, 5, prompt).probs(target_logits(prompt + y_<j)[None], y_<j)``,
the engine's own pipeline with the history at each position (``exact_sequence_probs``).

Test. Pearson chi-square goodness of fit on the sequence counts (``scipy.stats.chisquare``),
cells of expected count < 5 pooled into one cell, rejected at ALPHA = 0.001; a sequence of
probability 0 must never appear. The total variation distance is reported with each result.
Seeds are fixed, so every outcome here is deterministic.

Negative controls. The same harness with a deliberately wrong verification rule patched into
the engine ("accept every draft token", "resample from p instead of the residual") must be
rejected (p < ALPHA): the harness is shown able to fail.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest
import scipy.stats
import torch

import specray.core
from specray.engine import Engine
from specray.sampling import (
    PLACEHOLDER_TOKEN_ID,
    BatchVerifyResult,
    LogitsPipeline,
    SamplingParams,
    VerifyUniforms,
    sample_from_probs,
)
from specray.sampling.encoding import dense_draft_probs
from specray.sampling.grammar import Grammars
from tests.helpers.tiny_models import exact_sequence_probs, perturbed_copy, tiny_llama

VOCAB_SIZE = 5
NUM_SAMPLES = 2000  # N: generations per case, seeds 0..N-1
ALPHA = 1e-3  # significance level of every chi-square test in this file
MIN_EXPECTED_COUNT = 5.0  # cells expected below this are pooled
PROMPT = [0, 3, 1]  # token ids
# Structured outputs: the tokens' texts, and a regex whose mask depends on the history
VOCAB_TEXTS = ["(", "0", ")", "1", "x"]
GRAMMAR = ("regex", r"(\(0*\)|1|x)*")
NGRAM_PROMPT = [0, 1, 2, 0, 1]  # repeats, so prompt lookup proposes [2, 0] at once
TARGET_SEED, DRAFT_SEED = 0, 1
DRAFT_NOISE = 0.5  # draft = target + noise of half each weight's std: acceptance ~0.6


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Thousands of tiny tensor ops: one intra-op thread avoids OpenMP wake-ups (milliseconds
    per op on a busy 2-core machine) and keeps this file fast. Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB_SIZE, TARGET_SEED)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, DRAFT_SEED, DRAFT_NOISE)


@pytest.fixture(scope="module")
def generations() -> dict:
    """Outputs of the cases already run in this module, by case name (reused, not rerun)."""
    return {}


@pytest.fixture
def base_outputs(generations, target, draft):
    if "temperature-1.0" not in generations:
        generations["temperature-1.0"] = run_case(CASES[0], target, draft)[0]
    return generations["temperature-1.0"]


# ---------------------------------------------------------------------------------------------
# The harness


@dataclass(frozen=True)
class Case:
    name: str
    options: dict = field(default_factory=dict)  # SamplingParams fields
    num_speculative_tokens: int = 2
    length: int = 3  # L = max_tokens
    draft: str = "model"  # "model" (the tiny draft) | "ngram"
    draft_probs_encoding: str = "fp32"
    max_batch_size: int | None = None  # None: all N requests in one batch
    prompt: tuple[int, ...] = tuple(PROMPT)
    # With structured_outputs: where the grammar's mask applies, "both" (the engine: the
    # pipeline target and drafter share), "p" (the target only) or "q" (the drafter only)
    mask_on: str = "both"


@dataclass
class FitResult:
    p_value: float
    statistic: float
    degrees_of_freedom: int
    total_variation: float
    impossible_count: int  # samples of sequences whose exact probability is 0
    counts: Counter

    def describe(self) -> str:
        return (
            f"chi2={self.statistic:.1f} df={self.degrees_of_freedom} p={self.p_value:.3g} "
            f"TV={self.total_variation:.4f} impossible={self.impossible_count}"
        )


def chi_square_fit(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]):
    """Pearson goodness of fit of ``samples`` to ``exact`` (cells pooled below 5 expected)."""
    n = len(samples)
    counts = Counter(samples)
    sequences = list(exact)
    probs = np.array([exact[s] for s in sequences], dtype=np.float64)
    probs = probs / probs.sum()  # float32 pipeline rounding: make the expected counts sum to n
    observed = np.array([counts[s] for s in sequences], dtype=np.float64)
    unknown = n - int(observed.sum())  # not a length-L sequence over the vocabulary at all
    impossible = int(observed[probs == 0].sum()) + unknown
    expected = probs * n
    support = probs > 0
    large = support & (expected >= MIN_EXPECTED_COUNT)
    small = support & ~large
    cells_observed = list(observed[large])
    cells_expected = list(expected[large])
    if small.any():
        pooled_observed, pooled_expected = observed[small].sum(), expected[small].sum()
        if pooled_expected < MIN_EXPECTED_COUNT and cells_expected:
            smallest = int(np.argmin(cells_expected))  # fold the pool into the smallest cell
            cells_observed[smallest] += pooled_observed
            cells_expected[smallest] += pooled_expected
        else:
            cells_observed.append(pooled_observed)
            cells_expected.append(pooled_expected)
    cells_observed, cells_expected = np.array(cells_observed), np.array(cells_expected)
    # Observed counts of impossible sequences are reported separately; rescale so the sums match.
    cells_expected = cells_expected * cells_observed.sum() / cells_expected.sum()
    statistic, p_value = scipy.stats.chisquare(cells_observed, cells_expected)
    total_variation = 0.5 * (np.abs(observed / n - probs).sum() + unknown / n)
    return FitResult(
        float(p_value),
        float(statistic),
        len(cells_observed) - 1,
        float(total_variation),
        impossible,
        counts,
    )


def run_case(case: Case, target, draft, num_samples: int = NUM_SAMPLES):
    """Generate N sequences through the engine; return (outputs, fit against the exact law)."""
    engine = Engine(
        target=target,
        draft=draft if case.draft == "model" else case.draft,
        num_speculative_tokens=case.num_speculative_tokens,
        draft_probs_encoding=case.draft_probs_encoding,
        max_batch_size=case.max_batch_size or num_samples,
    )
    params = [
        SamplingParams(max_tokens=case.length, ignore_eos=True, seed=seed, **case.options)
        for seed in range(num_samples)
    ]
    prompt = list(case.prompt)
    if "structured_outputs" in case.options:
        _mask_grammar(engine, case.mask_on)
    outputs = engine.generate([prompt] * num_samples, params)
    grammars = tiny_grammars() if "structured_outputs" in case.options else None
    exact = exact_sequence_probs(target, prompt, params[0], case.length, grammars)
    fit = chi_square_fit([tuple(output.token_ids) for output in outputs], exact)
    return outputs, fit


@cache
def tiny_grammars() -> Grammars:
    return Grammars.for_vocab(VOCAB_TEXTS)


def _mask_grammar(engine: Engine, mask_on: str) -> None:
    """The grammar's mask on p and q (the engine as it is), on p only, or on q only."""
    engine.grammars = tiny_grammars
    if mask_on == "both":
        return

    def pipeline(request, masked: bool) -> LogitsPipeline:
        grammars = tiny_grammars() if masked else None
        return LogitsPipeline(request.params, VOCAB_SIZE, request.prompt_token_ids, [], grammars)

    make_request, make_draft_request = engine._make_request, engine._draft_request

    def target_request(*args):
        request = make_request(*args)
        request.pipeline = pipeline(request, masked=mask_on == "p")
        return request

    def draft_request(request, k):
        ask = make_draft_request(request, k)
        ask.pipeline = pipeline(request, masked=mask_on == "q")
        return ask

    engine._make_request, engine._draft_request = target_request, draft_request


def _pooled_metrics(outputs):
    drafted = sum(output.metrics.num_draft_tokens for output in outputs)
    accepted = sum(output.metrics.num_accepted_tokens for output in outputs)
    full_blocks = sum(
        output.metrics.accepted_per_position[-1]
        for output in outputs
        if output.metrics.accepted_per_position
    )
    return drafted, accepted, full_blocks


# ---------------------------------------------------------------------------------------------
# Exactness through every pipeline option and proposal path

CASES = [
    Case("temperature-1.0"),
    Case("temperature-0.6", {"temperature": 0.6}),
    Case("top_k-3", {"top_k": 3}),
    Case("top_p-0.8", {"top_p": 0.8}),
    Case("min_p-0.2", {"min_p": 0.2}),
    Case("repetition_penalty-1.5", {"repetition_penalty": 1.5}),
    Case("presence_penalty-1.0", {"presence_penalty": 1.0}),
    Case("frequency_penalty-1.0", {"frequency_penalty": 1.0}),
    Case("logit_bias", {"logit_bias": {1: 2.0}}),
    Case("allowed_token_ids", {"allowed_token_ids": [0, 2, 3]}),
    Case("banned_token_ids", {"banned_token_ids": [3]}),  # the likeliest first token
    # Stop id 3 (the likeliest first token) masked at positions 0 and 1, allowed at 2 (where
    # it ends the request with its last token).
    Case("min_tokens", {"min_tokens": 2, "stop_token_ids": [3]}),
    # A grammar over the five tokens' texts: after "(" only "0" or ")", else "(", "1" or "x"
    Case("structured_outputs", {"structured_outputs": GRAMMAR}),
    # the drafter unmasked: rejection sampling corrects any q, so still exact
    Case("structured_outputs-mask-on-p-only", {"structured_outputs": GRAMMAR}, mask_on="p"),
    Case(
        "combined",
        {"temperature": 0.8, "top_k": 4, "presence_penalty": 0.5, "banned_token_ids": [2]},
    ),
    Case("encoding-fp16", draft_probs_encoding="fp16"),
    Case("encoding-top2", draft_probs_encoding="top2"),
    Case("ngram", draft="ngram", prompt=tuple(NGRAM_PROMPT)),
    Case("k3-length4", num_speculative_tokens=3, length=4),
    Case("continuous-batching", max_batch_size=64),  # requests join as others finish
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_generations_follow_target_distribution(
    case: Case, target, draft, generations, record_property
):
    """N = 2000 generations (seeds 0..1999) of length L fit the target's exact sequence
    distribution: chi-square p >= ALPHA = 0.001, and no sequence of probability 0."""
    outputs, fit = run_case(case, target, draft)
    generations[case.name] = outputs
    record_property("fit", fit.describe())
    assert [output.seed for output in outputs] == list(range(NUM_SAMPLES))
    stop_ids = set(case.options.get("stop_token_ids", ()))
    assert all(
        output.finish_reason == ("stop" if output.token_ids[-1] in stop_ids else "length")
        for output in outputs
    )
    assert fit.impossible_count == 0, f"{case.name}: impossible sequences sampled; {fit.describe()}"
    assert fit.p_value >= ALPHA, f"{case.name}: rejected; {fit.describe()}"
    # The rule really ran: drafts were proposed, some rejected, some blocks fully accepted.
    drafted, accepted, full_blocks = _pooled_metrics(outputs)
    assert 0 < accepted < drafted, (case.name, drafted, accepted)
    assert full_blocks > 0, case.name


# ---------------------------------------------------------------------------------------------
# Negative controls: wrong rules through the same harness must be rejected


def _committed(draft_token_ids, num_accepted, final_token) -> BatchVerifyResult:
    batch, k = draft_token_ids.shape
    token_ids = torch.full((batch, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    for row in range(batch):
        accepted = int(num_accepted[row])
        token_ids[row, :accepted] = draft_token_ids[row, :accepted]
        token_ids[row, accepted] = final_token[row]
    return BatchVerifyResult(token_ids, num_accepted.clone())


def accept_every_draft(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms: VerifyUniforms
) -> BatchVerifyResult:
    """WRONG: keeps every draft token, then a bonus sampled from the target row after them."""
    rows = torch.arange(draft_token_ids.shape[0])
    bonus_probs = target_probs[rows, num_draft_tokens].double()  # [batch, vocab]
    return _committed(
        draft_token_ids, num_draft_tokens, sample_from_probs(bonus_probs, uniforms.bonus)
    )


def resample_from_target(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms: VerifyUniforms
) -> BatchVerifyResult:
    """WRONG: the right acceptance test, but a rejection resamples from p, not the residual."""
    batch, k = draft_token_ids.shape
    rows = torch.arange(batch)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    if k > 0:
        ids = draft_token_ids.clamp(min=0)[..., None]  # [batch, k, 1]
        target_at = target_probs[:, :k].gather(-1, ids).squeeze(-1).double()  # [batch, k]
        draft_at = draft_probs.gather(-1, ids).squeeze(-1).double().clamp(min=1e-300)
        accepted = uniforms.accept < (target_at / draft_at).clamp(max=1.0)  # [batch, k]
        stop = ~accepted | (torch.arange(k)[None, :] >= num_draft_tokens[:, None])
        num_accepted = torch.where(stop.any(dim=1), stop.to(torch.int8).argmax(dim=1), k)
    rejected = num_accepted < num_draft_tokens
    at = num_accepted.clamp(max=max(k - 1, 0))
    uniform = (
        uniforms.bonus
        if k == 0
        else torch.where(rejected, uniforms.residual[rows, at], uniforms.bonus)
    )
    final_probs = target_probs[rows, num_accepted].double()  # [batch, vocab]
    return _committed(draft_token_ids, num_accepted, sample_from_probs(final_probs, uniform))


WRONG_RULES: dict[str, Callable[..., BatchVerifyResult]] = {
    "accept-every-draft": accept_every_draft,
    "resample-from-target": resample_from_target,
}


def _as_core_rule(rule: Callable[..., BatchVerifyResult]) -> Callable[..., BatchVerifyResult]:
    """``rule`` called as the core calls verify_blocks: per-request q (dense or sparse) and
    target rows, padded here into the dense batch tensors the wrong rules take."""

    def run(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms, **_):
        batch, k = draft_token_ids.shape
        vocab = target_probs[0].shape[-1]
        padded_target = torch.zeros(batch, k + 1, vocab)  # [batch, k+1, vocab]
        padded_draft = torch.zeros(batch, k, vocab)  # [batch, k, vocab]
        for b, (block, rows) in enumerate(zip(draft_probs, target_probs, strict=True)):
            n = rows.shape[0] - 1
            padded_target[b, : n + 1] = rows
            padded_draft[b, :n] = dense_draft_probs(block)
        return rule(draft_token_ids, num_draft_tokens, padded_draft, padded_target, uniforms)

    return run


@pytest.mark.parametrize("rule", list(WRONG_RULES))
def test_negative_control_wrong_rule_is_rejected(rule, target, draft, monkeypatch, record_property):
    """The harness above (N = 2000, seeds 0..1999, ALPHA = 0.001) with a wrong verification
    rule patched into the engine must reject: p < ALPHA."""
    monkeypatch.setattr(specray.core, "verify_blocks", _as_core_rule(WRONG_RULES[rule]))
    _, fit = run_case(Case(rule), target, draft)
    record_property("fit", fit.describe())
    assert fit.p_value < ALPHA, (
        f"{rule}: the harness failed to reject a wrong rule; {fit.describe()}"
    )


def test_min_tokens_is_seen_by_the_fit(target, draft, generations):
    """Negative control of the min_tokens case: its samples tested against the law without
    min_tokens (stop id 3 allowed everywhere) are rejected at ALPHA = 0.001, N = 2000."""
    case = next(case for case in CASES if case.name == "min_tokens")
    if case.name not in generations:
        generations[case.name] = run_case(case, target, draft)[0]
    without = SamplingParams(stop_token_ids=[3], ignore_eos=True, max_tokens=3)
    wrong = exact_sequence_probs(target, PROMPT, without, 3)
    outputs = generations[case.name]
    wrong_fit = chi_square_fit([tuple(output.token_ids) for output in outputs], wrong)
    assert wrong_fit.p_value < ALPHA, wrong_fit.describe()


def test_the_grammar_is_seen_by_the_fit(target, draft, generations):
    """Negative controls of the structured-outputs case, N = 2000, ALPHA = 0.001: its samples
    tested against the law without the grammar are rejected, and so are the samples of an
    engine that masks q only (the target unmasked) against the law with it."""
    case = next(case for case in CASES if case.name == "structured_outputs")
    if case.name not in generations:
        generations[case.name] = run_case(case, target, draft)[0]
    without = SamplingParams(ignore_eos=True, max_tokens=3)
    wrong = exact_sequence_probs(target, PROMPT, without, 3)
    samples = [tuple(output.token_ids) for output in generations[case.name]]
    wrong_fit = chi_square_fit(samples, wrong)
    assert wrong_fit.p_value < ALPHA, wrong_fit.describe()
    q_only = Case("structured_outputs-mask-on-q-only", case.options, mask_on="q")
    _, q_only_fit = run_case(q_only, target, draft)
    assert q_only_fit.p_value < ALPHA or q_only_fit.impossible_count > 0, q_only_fit.describe()


def test_harness_rejects_a_wrong_oracle(target, draft, base_outputs):
    """The temperature-1.0 samples tested against the exact law of temperature 0.6 instead are
    rejected: the chi-square test has power at N = 2000, ALPHA = 0.001."""
    outputs = base_outputs
    wrong = exact_sequence_probs(target, PROMPT, SamplingParams(temperature=0.6), 3)
    wrong_fit = chi_square_fit([tuple(output.token_ids) for output in outputs], wrong)
    assert wrong_fit.p_value < ALPHA, wrong_fit.describe()


# ---------------------------------------------------------------------------------------------
# Keyed randomness: same seed, same output, whatever the batch


INVARIANCE_SEEDS = [11, 12, 13]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("proposal", ["model", "ngram", "none"])
def test_same_seed_same_output_regardless_of_batch(temperature, proposal, target, draft):
    """Requests seeded 11, 12, 13 give the same tokens alone, inside a batch of other requests
    (other prompt lengths, other options, other seeds), and when they join a running batch
    (max_batch_size 2), and the same again on a repeated call."""
    drafter = {"model": draft, "ngram": "ngram", "none": None}[proposal]

    def engine(max_batch_size=32):
        return Engine(
            target=target,
            draft=drafter,
            num_speculative_tokens=3,
            max_batch_size=max_batch_size,
        )

    def params(seed, max_tokens=12, **options):
        return SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed, **options
        )

    probes = [(list(NGRAM_PROMPT), seed) for seed in INVARIANCE_SEEDS]
    alone = [engine().generate(prompt, params(seed))[0].token_ids for prompt, seed in probes]

    others_prompts = [[4], [2, 2, 3, 2, 2, 3, 1], [1, 0], [3, 3, 3, 3]]
    others_params = [
        params(100),
        params(101, presence_penalty=1.0),
        params(102, top_k=2, max_tokens=5),
        SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, seed=103),
    ]
    prompts = [
        others_prompts[0],
        probes[0][0],
        *others_prompts[1:3],
        probes[1][0],
        others_prompts[3],
        probes[2][0],
    ]
    batch_params = [
        others_params[0],
        params(INVARIANCE_SEEDS[0]),
        *others_params[1:3],
        params(INVARIANCE_SEEDS[1]),
        others_params[3],
        params(INVARIANCE_SEEDS[2]),
    ]
    probe_slots = [1, 4, 6]
    for max_batch_size in (32, 2):
        outputs = engine(max_batch_size).generate(prompts, batch_params)
        assert [outputs[slot].token_ids for slot in probe_slots] == alone, max_batch_size
        assert all(
            len(output.token_ids) == p.max_tokens
            for output, p in zip(outputs, batch_params, strict=True)
        )
    again = [engine().generate(prompt, params(seed))[0].token_ids for prompt, seed in probes]
    assert again == alone


def test_engine_chosen_seed_is_reported_and_reproduces(target, draft):
    """Without a seed the engine picks one, reports it, and that seed replays the output."""
    engine = Engine(target=target, draft=draft, num_speculative_tokens=2)
    first = engine.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    replay = engine.generate(
        PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, seed=first.seed)
    )[0]
    assert replay.token_ids == first.token_ids
    assert replay.seed == first.seed


def test_sequence_enumeration_is_a_distribution(target):
    """Sanity of the oracle: the exact law sums to 1, and masks give exact zeros."""
    exact = exact_sequence_probs(target, PROMPT, SamplingParams(banned_token_ids=[4]), 3)
    assert len(exact) == VOCAB_SIZE**3
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)
    for sequence, prob in exact.items():
        assert (prob == 0) == (4 in sequence)
    assert set(itertools.chain.from_iterable(exact)) == set(range(VOCAB_SIZE))
