"""Enumeration proof of the verification rules (docs/design.md 1, proof obligation (a) and (c)).

For a tiny vocabulary (3-6 tokens) and k = 1..3 draft tokens we compute the *exact*
distribution of the tokens committed by one stochastic verify round, by driving the real
``verify_batch`` with chosen uniforms, and show that it equals the target distribution to 1e-9.

Method. The committed tokens are a piecewise-constant function of each uniform, with
breakpoints that this file derives on its own from the rule's formulas:

  - acceptance uniform at position j: one breakpoint, ``a_j = min(1, p_j(d_j) / q_j(d_j))``;
  - residual uniform at the first rejected j: the cumulative sums of
    ``normalize(max(0, p_j - q_j))``;
  - bonus uniform (all k accepted): the cumulative sums of ``p_k``.

Only the first rejection matters, so the round's sample space splits into cells "draft block
d, first rejection at j (or none), final uniform in interval t". The implementation is called
at the midpoint of each cell's intervals, and the outcome is weighted by the cell's exact
probability ``prod_j q_j(d_j) * prod_{i<j} a_i * (1 - a_j) * len(t)``. It is also called near
both ends of each cell (1e-8 of its length inside) and must give the same outcome there: so
the implementation's breakpoints are shown to be the rule's, not merely its midpoint values.
A cell where they differ is counted (the proof requires none) and integrated on a grid, so a
wrong rule also shows as a wrong law.

The verifier is fed the pipeline's rows renormalised in float64, so what is checked to 1e-9
is the rule itself; a separate case feeds the float32 rows unchanged (verify_batch renormalises
them itself).

A round commits m <= k + 1 tokens; each outcome is extended to length k + 1 with the target's
exact conditionals and compared, sequence by sequence, with the target's own sequence
distribution ``prod_j p_j(y_j | y_<j)``.

Every p_j and q_j comes from ``LogitsPipeline.probs`` with the history *at that position*
(prompt, committed output, candidate prefix): raw logits are a fixed pseudo-random function of
the candidate prefix, different for the target and the draft, so history-dependent options
(penalties) really change the distributions along the block.

Negative controls (wrong rules, wrong history) run through the same harness and must miss the
target by more than 1e-3, so the harness is shown able to fail.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from specray.sampling import (
    PLACEHOLDER_TOKEN_ID,
    BatchVerifyResult,
    DraftProbsEncoding,
    LogitsPipeline,
    SamplingParams,
    VerifyUniforms,
    quantize_draft_probs,
    sample_from_probs,
    verify_batch,
    verify_batch_greedy,
    verify_block,
)
from specray.sampling.verify import DEGENERATE_RESIDUAL_MASS

Prefix = tuple[int, ...]
LogitsFn = Callable[[int, Prefix], torch.Tensor]  # (vocab, candidate prefix) -> [vocab]
VerifyFn = Callable[..., BatchVerifyResult]  # verify_batch's signature

TOLERANCE = 1e-9  # exactness: max |spec - target| over all length-(k+1) sequences
NEGATIVE_CONTROL_GAP = 1e-3  # a wrong rule must miss the target by more than this
PROMPT_TOKEN_IDS = (0, 2)  # history for the repetition penalty
OUTPUT_TOKEN_IDS = (1, 2, 1)  # committed output before the round (penalty history)
UNUSED_ACCEPT_UNIFORM = 1e-12  # after the first rejection: would accept, must be ignored
UNUSED_UNIFORM = 0.999  # residual / bonus draws that the round must not consume
TARGET_ROLE, DRAFT_ROLE = 1, 2


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny tensors: one torch thread avoids OpenMP spin-waits on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Raw logits: fixed pseudo-random functions of (role, vocab, candidate prefix).


@functools.cache
def _random_logits(role: int, vocab: int, prefix: Prefix, scale: float = 1.5) -> torch.Tensor:
    seed = role * 1_000_003 + vocab
    for token_id in prefix:
        seed = seed * (vocab + 1) + token_id + 1
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=generator) * scale  # [vocab] float32


def target_logits(vocab: int, prefix: Prefix) -> torch.Tensor:
    return _random_logits(TARGET_ROLE, vocab, prefix)


def draft_logits(vocab: int, prefix: Prefix) -> torch.Tensor:
    return _random_logits(DRAFT_ROLE, vocab, prefix)


def _one_hot_logits(logits: torch.Tensor) -> torch.Tensor:
    """0 at the argmax, -inf elsewhere: the pipeline turns it into a one-hot distribution."""
    out = torch.full_like(logits, float("-inf"))
    out[logits.argmax()] = 0.0
    return out


def one_hot_target_logits(vocab: int, prefix: Prefix) -> torch.Tensor:
    return _one_hot_logits(target_logits(vocab, prefix))


def one_hot_draft_logits(vocab: int, prefix: Prefix) -> torch.Tensor:
    return _one_hot_logits(draft_logits(vocab, prefix))


def peaked_target_logits(vocab: int, prefix: Prefix) -> torch.Tensor:
    """Very peaked p: the runners-up get probabilities down to ~1e-30."""
    return target_logits(vocab, prefix) * 25.0


def peaked_draft_logits(vocab: int, prefix: Prefix) -> torch.Tensor:
    """Very peaked q: fp16 flushes its small entries to zero."""
    return draft_logits(vocab, prefix) * 12.0


def draft_logits_zero_at_target_mode(vocab: int, prefix: Prefix) -> torch.Tensor:
    """q = 0 on the target's most likely token (where p is largest), positive elsewhere."""
    out = draft_logits(vocab, prefix).clone()
    out[target_logits(vocab, prefix).argmax()] = float("-inf")
    return out


# ---------------------------------------------------------------------------------------------
# Distributions at every prefix, from real pipeline calls.


@dataclass(frozen=True)
class Case:
    """One pipeline configuration: params, raw logits of both models, q's wire encoding."""

    params: SamplingParams
    target_logits: LogitsFn = target_logits
    draft_logits: LogitsFn = draft_logits
    draft_encoding: str | None = None  # q = quantize_draft_probs(q, encoding) when set


def probs_table(
    pipeline: LogitsPipeline, logits_fn: LogitsFn, vocab: int, num_rows: int
) -> dict[Prefix, torch.Tensor]:
    """``{prefix: probs}`` for every candidate prefix of length < num_rows.

    Each call scores a whole block: ``num_rows`` logits rows with the candidate block as
    history, exactly as a verifier does; row i is stored under ``block[:i]``. A prefix reached
    from several blocks must get bit-identical rows (row i sees ``candidates[:i]`` only).
    """
    table: dict[Prefix, torch.Tensor] = {}
    for block in itertools.product(range(vocab), repeat=num_rows - 1):
        logits = torch.stack([logits_fn(vocab, block[:i]) for i in range(num_rows)])
        rows = pipeline.probs(logits, OUTPUT_TOKEN_IDS, block)  # [num_rows, vocab]
        for i in range(num_rows):
            if block[:i] in table:
                assert torch.equal(table[block[:i]], rows[i]), f"row {i} depends on the future"
            else:
                table[block[:i]] = rows[i]
    return table


def history_free_table(
    pipeline: LogitsPipeline, logits_fn: LogitsFn, vocab: int, num_rows: int
) -> dict[Prefix, torch.Tensor]:
    """Like :func:`probs_table` but each row ignores the candidate prefix (a wrong history)."""
    return {
        prefix: pipeline.probs(logits_fn(vocab, prefix)[None], OUTPUT_TOKEN_IDS, ())[0]
        for length in range(num_rows)
        for prefix in itertools.product(range(vocab), repeat=length)
    }


def normalized(probs: torch.Tensor) -> torch.Tensor:
    probs = probs.double()
    return probs / probs.sum()


@dataclass
class RoundModel:
    """One round's distributions: exact conditionals for the formulas, and the verifier's rows."""

    vocab: int
    k: int
    target: dict[Prefix, torch.Tensor]  # p at prefixes of length <= k, float64, sums to 1
    draft: dict[Prefix, torch.Tensor]  # q at prefixes of length < k, float64, sums to 1
    target_fed: dict[Prefix, torch.Tensor]  # p rows as the verifier receives them
    draft_fed: dict[Prefix, torch.Tensor]  # q rows as the verifier receives them


def build_model(case: Case, vocab: int, k: int, *, float64_inputs: bool = True) -> RoundModel:
    """p and q at every prefix from the real pipelines.

    ``float64_inputs``: feed the verifier the exact float64 conditionals (the pipeline's rows
    renormalised); otherwise feed it the pipeline's float32 rows unchanged.
    """
    target_pipeline = LogitsPipeline(case.params, vocab, PROMPT_TOKEN_IDS)
    draft_pipeline = LogitsPipeline(case.params, vocab, PROMPT_TOKEN_IDS)
    target = probs_table(target_pipeline, case.target_logits, vocab, k + 1)
    draft = probs_table(draft_pipeline, case.draft_logits, vocab, k)
    if case.draft_encoding is not None:
        encoding = DraftProbsEncoding.parse(case.draft_encoding)
        draft = {key: quantize_draft_probs(row[None], encoding)[0] for key, row in draft.items()}
    exact_target = {key: normalized(row) for key, row in target.items()}
    exact_draft = {key: normalized(row) for key, row in draft.items()}
    return RoundModel(
        vocab=vocab,
        k=k,
        target=exact_target,
        draft=exact_draft,
        target_fed=exact_target if float64_inputs else target,
        draft_fed=exact_draft if float64_inputs else draft,
    )


# ---------------------------------------------------------------------------------------------
# The enumeration.

EDGE_INSET = 1e-8  # edge probes sit this fraction of a cell's length inside its ends
MIN_PROBED_LENGTH = 1e-5  # narrower intervals get the midpoint only (float rounding at ends)
GRID_POINTS = 64  # a cell whose outcome is not constant is integrated on this grid


def intervals(probs: torch.Tensor) -> list[tuple[int, float, float]]:
    """``(token, lo, hi)`` for every token of positive mass: inverse-CDF cells of ``probs``."""
    cdf = (probs.double() / probs.double().sum()).cumsum(0).tolist()
    cdf[-1] = 1.0
    cells, lo = [], 0.0
    for token_id, hi in enumerate(cdf):
        if hi > lo:
            cells.append((token_id, lo, hi))
        lo = max(lo, hi)
    return cells


def residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) (unnormalised); p itself when that has no mass (docs/design.md 1.3 guard)."""
    diff = (target_row.double() - draft_row.double()).clamp(min=0.0)
    return diff if diff.sum() > DEGENERATE_RESIDUAL_MASS else target_row.double()


@dataclass(frozen=True)
class Cell:
    """A box of the round's uniforms on which the rule's outcome is constant."""

    block: Prefix  # the draft tokens d_1..d_k
    first_rejection: int  # 0..k-1, or k when every draft token is accepted
    accept: tuple[tuple[float, float], ...]  # interval of each acceptance uniform that is used
    final: tuple[float, float]  # interval of the residual (after a rejection) or bonus uniform
    probability: float  # q(block) * prod(acceptance interval lengths) * final interval length


def enumerate_cells(model: RoundModel) -> list[Cell]:
    """Every cell of positive probability, from the rule's formulas (not the implementation)."""
    vocab, k = model.vocab, model.k
    cells = []
    for block in itertools.product(range(vocab), repeat=k):
        proposal = math.prod(float(model.draft[block[:j]][block[j]]) for j in range(k))
        if proposal == 0.0:
            continue  # the draft never proposes a q = 0 token
        accept_at = [  # a_j = min(1, p_j(d_j) / q_j(d_j))
            min(1.0, float(model.target[prefix][token]) / float(model.draft[prefix][token]))
            for prefix, token in ((block[:j], block[j]) for j in range(k))
        ]
        for first_rejection in range(k + 1):
            accept = [(0.0, a) for a in accept_at[:first_rejection]]
            if first_rejection < k:
                accept.append((accept_at[first_rejection], 1.0))
                prefix = block[:first_rejection]
                final = residual(model.target[prefix], model.draft[prefix])
            else:
                final = model.target[block]
            weight = proposal * math.prod(hi - lo for lo, hi in accept)
            if weight == 0.0:
                continue
            for _token_id, lo, hi in intervals(final):
                cells.append(
                    Cell(block, first_rejection, tuple(accept), (lo, hi), weight * (hi - lo))
                )
    return cells


def run_probes(
    model: RoundModel,
    probes: list[tuple[Cell, float]],
    verify_fn: VerifyFn,
    pad_to: int | None,
) -> list[tuple[int, ...]]:
    """Committed tokens for each ``(cell, fraction)``, in one batched verifier call.

    Every uniform the cell uses is set to ``lo + fraction * (hi - lo)`` of its interval; the
    uniforms it must not consume get fixed values unrelated to the cell.
    ``pad_to``: run the round in a wider batch (k_max = pad_to) whose extra draft slots hold
    PLACEHOLDER_TOKEN_ID and garbage probabilities, with ``num_draft_tokens = k``.
    """
    vocab, k = model.vocab, model.k
    width = k if pad_to is None else pad_to
    draft_ids, accept_rows, residual_rows, bonus_rows = [], [], [], []
    for cell, fraction in probes:
        accept = [lo + fraction * (hi - lo) for lo, hi in cell.accept]
        final_u = cell.final[0] + fraction * (cell.final[1] - cell.final[0])
        residual_u = [UNUSED_UNIFORM] * width
        if cell.first_rejection < k:
            residual_u[cell.first_rejection] = final_u
        draft_ids.append(list(cell.block) + [PLACEHOLDER_TOKEN_ID] * (width - k))
        accept_rows.append(accept + [UNUSED_ACCEPT_UNIFORM] * (width - len(accept)))
        residual_rows.append(residual_u)
        bonus_rows.append(final_u if cell.first_rejection == k else UNUSED_UNIFORM)

    dtype = model.target_fed[()].dtype  # float64, or the pipeline's float32 rows unchanged
    garbage = [torch.full((vocab,), 1.0 / vocab, dtype=dtype)] * (width - k)
    blocks = sorted({cell.block for cell, _ in probes})
    index = {block: i for i, block in enumerate(blocks)}
    targets = torch.stack(  # [blocks, width + 1, vocab]
        [torch.stack([model.target_fed[b[:i]] for i in range(k + 1)] + garbage) for b in blocks]
    )
    drafts = torch.stack(  # [blocks, width, vocab]
        [torch.stack([model.draft_fed[b[:i]] for i in range(k)] + garbage) for b in blocks]
    )
    rows = torch.tensor([index[cell.block] for cell, _ in probes])  # [probes]
    result = verify_fn(
        torch.tensor(draft_ids, dtype=torch.int64),
        torch.full((len(probes),), k, dtype=torch.int64),
        drafts[rows],
        targets[rows],
        VerifyUniforms(
            accept=torch.tensor(accept_rows, dtype=torch.float64),
            residual=torch.tensor(residual_rows, dtype=torch.float64),
            bonus=torch.tensor(bonus_rows, dtype=torch.float64),
        ),
    )
    token_ids, num_tokens = result.token_ids.tolist(), result.num_tokens.tolist()
    return [tuple(row[:count]) for row, count in zip(token_ids, num_tokens, strict=True)]


def committed_distribution(
    model: RoundModel, verify_fn: VerifyFn = verify_batch, pad_to: int | None = None
) -> tuple[dict[tuple[int, ...], float], int]:
    """Exact law of the committed tokens of one round, and the number of non-constant cells.

    Each cell is run at its midpoint and, where its intervals are wide enough, near both ends
    (EDGE_INSET inside). Each decision of the rule is a threshold (acceptance) or an inverse
    CDF (final token) of its own uniform, so equal outcomes at both ends mean the outcome is
    constant on the cell and the midpoint's outcome carries the cell's whole probability.
    A cell whose probes disagree (the implementation's breakpoints are not the rule's) is
    integrated on a GRID_POINTS grid instead, so a wrong rule shows as a wrong law.
    """
    cells = enumerate_cells(model)
    probes: list[tuple[int, float]] = []
    for index, cell in enumerate(cells):
        probes.append((index, 0.5))
        if min(hi - lo for lo, hi in (*cell.accept, cell.final)) >= MIN_PROBED_LENGTH:
            probes += [(index, EDGE_INSET), (index, 1.0 - EDGE_INSET)]
    outcomes = run_probes(model, [(cells[i], f) for i, f in probes], verify_fn, pad_to)
    seen: dict[int, set[tuple[int, ...]]] = {}
    for (index, _), outcome in zip(probes, outcomes, strict=True):
        seen.setdefault(index, set()).add(outcome)
    nonconstant = [index for index, found in seen.items() if len(found) > 1]

    mass: dict[tuple[int, ...], float] = {}
    for index, cell in enumerate(cells):
        if index not in nonconstant:
            (outcome,) = seen[index]
            mass[outcome] = mass.get(outcome, 0.0) + cell.probability
    if nonconstant:
        grid = [(i + 0.5) / GRID_POINTS for i in range(GRID_POINTS)]
        fine = [(cells[index], fraction) for index in nonconstant for fraction in grid]
        for (cell, _), outcome in zip(
            fine, run_probes(model, fine, verify_fn, pad_to), strict=True
        ):
            mass[outcome] = mass.get(outcome, 0.0) + cell.probability / GRID_POINTS
    return mass, len(nonconstant)


def sequence_distributions(
    model: RoundModel, mass: dict[tuple[int, ...], float]
) -> tuple[dict[Prefix, float], dict[Prefix, float]]:
    """(speculative, target) probabilities of every length-(k+1) sequence.

    Speculative: the round's committed tokens, then the target's exact conditionals up to
    length k + 1. Target: ``prod_j p_j(y_j | y_<j)``.
    """
    speculative, target = {}, {}
    for sequence in itertools.product(range(model.vocab), repeat=model.k + 1):
        conditionals = [float(model.target[sequence[:j]][sequence[j]]) for j in range(model.k + 1)]
        target[sequence] = math.prod(conditionals)
        speculative[sequence] = sum(
            mass.get(sequence[:m], 0.0) * math.prod(conditionals[m:]) for m in range(1, model.k + 2)
        )
    return speculative, target


def max_error(
    model: RoundModel, verify_fn: VerifyFn = verify_batch, *, pad_to: int | None = None
) -> tuple[float, int]:
    """(max |speculative - target| over all length-(k+1) sequences, non-constant cells)."""
    mass, nonconstant = committed_distribution(model, verify_fn, pad_to)
    invalid = [tokens for tokens in mass if not 1 <= len(tokens) <= model.k + 1]
    assert not invalid, f"rounds must commit 1..k+1 tokens, got {invalid}"
    assert abs(sum(mass.values()) - 1.0) < TOLERANCE, "the cells must cover the sample space"
    speculative, target = sequence_distributions(model, mass)
    return max(abs(speculative[seq] - target[seq]) for seq in target), nonconstant


# ---------------------------------------------------------------------------------------------
# The proof: every pipeline option, every q variant.

CASES = {
    "temperature_0.7": Case(SamplingParams(temperature=0.7)),
    "temperature_1.3": Case(SamplingParams(temperature=1.3)),
    "top_k_2": Case(SamplingParams(top_k=2)),
    "top_p_0.6": Case(SamplingParams(top_p=0.6)),
    "min_p_0.3": Case(SamplingParams(min_p=0.3)),
    "repetition_penalty_1.8": Case(SamplingParams(repetition_penalty=1.8)),
    "repetition_penalty_0.6": Case(SamplingParams(repetition_penalty=0.6)),
    "presence_penalty_1.5": Case(SamplingParams(presence_penalty=1.5)),
    "frequency_penalty_1.2": Case(SamplingParams(frequency_penalty=1.2)),
    "negative_penalties": Case(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.7)),
    "logit_bias": Case(SamplingParams(logit_bias={0: 1.5, 2: -2.0})),
    "allowed_token_ids": Case(SamplingParams(allowed_token_ids=(0, 2))),
    "banned_token_ids": Case(SamplingParams(banned_token_ids=(1,))),
    "everything_at_once": Case(
        SamplingParams(
            temperature=0.9,
            top_k=3,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={1: 1.0},
            banned_token_ids=(2,),
        )
    ),
    "greedy_params": Case(SamplingParams(temperature=0)),
    "q_top2": Case(SamplingParams(), draft_encoding="top2"),
    "q_top1": Case(SamplingParams(frequency_penalty=0.8), draft_encoding="top1"),
    "q_fp16_peaked": Case(
        SamplingParams(), draft_logits=peaked_draft_logits, draft_encoding="fp16"
    ),
    "q_bf16": Case(SamplingParams(presence_penalty=1.0), draft_encoding="bf16"),
    "q_zero_where_p_positive": Case(
        SamplingParams(), draft_logits=draft_logits_zero_at_target_mode
    ),
    "p_equals_q": Case(SamplingParams(frequency_penalty=0.9), draft_logits=target_logits),
    "p_equals_q_fp16": Case(SamplingParams(), draft_logits=target_logits, draft_encoding="fp16"),
    "p_one_hot": Case(SamplingParams(), target_logits=one_hot_target_logits),
    "p_peaked": Case(SamplingParams(), target_logits=peaked_target_logits),
    "q_one_hot": Case(SamplingParams(), draft_logits=one_hot_draft_logits),
    "p_and_q_one_hot": Case(
        SamplingParams(), target_logits=one_hot_target_logits, draft_logits=one_hot_draft_logits
    ),
}
VOCAB_AND_K = [(3, 1), (4, 2), (5, 2), (3, 3), (6, 3)]


@pytest.mark.parametrize(("vocab", "k"), VOCAB_AND_K, ids=lambda value: str(value))
@pytest.mark.parametrize("case_name", list(CASES))
def test_one_round_commits_the_target_distribution(case_name: str, vocab: int, k: int) -> None:
    """One stochastic round, extended by the target, equals the target's sequence law to 1e-9."""
    error, nonconstant = max_error(build_model(CASES[case_name], vocab, k))
    assert nonconstant == 0, "the implementation's breakpoints are not the rule's"
    assert error <= TOLERANCE


@pytest.mark.parametrize("case_name", ["temperature_0.7", "frequency_penalty_1.2", "q_top2"])
@pytest.mark.parametrize(("vocab", "k", "pad_to"), [(4, 1, 3), (3, 2, 4)])
def test_padded_batch_rows_are_exact(case_name: str, vocab: int, k: int, pad_to: int) -> None:
    """Rows with num_draft_tokens < k_max (placeholder ids, garbage q and p past the block)."""
    error, nonconstant = max_error(build_model(CASES[case_name], vocab, k), pad_to=pad_to)
    assert nonconstant == 0
    assert error <= TOLERANCE


def test_penalty_cases_make_history_matter() -> None:
    """The penalty cases are meaningful: p at a prefix depends on the candidate tokens in it."""
    vocab, k = 4, 2
    for name in ("repetition_penalty_1.8", "presence_penalty_1.5", "frequency_penalty_1.2"):
        case = CASES[name]
        pipeline = LogitsPipeline(case.params, vocab, PROMPT_TOKEN_IDS)
        with_history = probs_table(pipeline, case.target_logits, vocab, k + 1)
        without = history_free_table(pipeline, case.target_logits, vocab, k + 1)
        gap = max(float((with_history[key] - without[key]).abs().max()) for key in with_history)
        assert gap > 0.05, name


@pytest.mark.parametrize(
    ("case_name", "vocab", "k"), [("frequency_penalty_1.2", 3, 1), ("q_top2", 6, 3)]
)
def test_float32_pipeline_rows_unchanged_are_exact(case_name: str, vocab: int, k: int) -> None:
    """The pipeline's float32 rows fed as they are: the law must still be normalize(p)."""
    model = build_model(CASES[case_name], vocab, k, float64_inputs=False)
    error, nonconstant = max_error(model)
    assert nonconstant == 0
    assert error <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# Negative controls: the harness must be able to fail.


def accept_every_draft(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms):
    """Wrong rule: keep all k drafts, then a bonus token from p."""
    batch = draft_token_ids.shape[0]
    bonus = sample_from_probs(target_probs[torch.arange(batch), num_draft_tokens], uniforms.bonus)
    token_ids = torch.cat([draft_token_ids, bonus[:, None]], dim=1)
    return BatchVerifyResult(token_ids, num_draft_tokens.clone())


def resample_target_on_rejection(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms
):
    """Wrong rule: the right acceptance test, but the recovered token is drawn from p."""
    result = verify_batch(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms)
    rows = torch.arange(draft_token_ids.shape[0])
    num_accepted = result.num_accepted
    rejected = num_accepted < num_draft_tokens
    at = num_accepted.clamp(max=draft_token_ids.shape[1] - 1)
    final_uniform = torch.where(rejected, uniforms.residual[rows, at], uniforms.bonus)
    final = sample_from_probs(target_probs[rows, num_accepted].double(), final_uniform)
    token_ids = result.token_ids.clone()
    token_ids[rows, num_accepted] = final
    return BatchVerifyResult(token_ids, num_accepted)


@pytest.mark.parametrize("wrong_rule", [accept_every_draft, resample_target_on_rejection])
def test_negative_control_wrong_rule_is_detected(wrong_rule: VerifyFn) -> None:
    """A wrong verification rule misses the target by more than 1e-3 in the same harness."""
    model = build_model(CASES["temperature_1.3"], 4, 2)
    error, _ = max_error(model, wrong_rule)
    assert error > NEGATIVE_CONTROL_GAP


def test_negative_control_wrong_history_is_detected() -> None:
    """Rows computed without the candidate prefix (history ignored) miss the target."""
    case = CASES["frequency_penalty_1.2"]
    vocab, k = 4, 2
    model = build_model(case, vocab, k)
    pipeline = LogitsPipeline(case.params, vocab, PROMPT_TOKEN_IDS)
    wrong = history_free_table(pipeline, case.target_logits, vocab, k + 1)
    model.target_fed = {key: normalized(row) for key, row in wrong.items()}
    error, _ = max_error(model)
    assert error > NEGATIVE_CONTROL_GAP


# ---------------------------------------------------------------------------------------------
# Greedy rule: deterministic unit cases.

NEG_INF = float("-inf")


def one_hot_rows(argmax_ids: list[int], vocab: int = 5) -> torch.Tensor:
    """``[len(argmax_ids), vocab]`` logits: 0 at the given ids, -inf elsewhere."""
    rows = torch.full((len(argmax_ids), vocab), NEG_INF)
    rows[torch.arange(len(argmax_ids)), torch.tensor(argmax_ids)] = 0.0
    return rows


def greedy(draft_ids: list[int], target_rows: torch.Tensor):
    return verify_batch_greedy(
        torch.tensor([draft_ids]), torch.tensor([len(draft_ids)]), target_rows[None]
    ).row(0)


def test_greedy_accepts_all_matching_drafts_then_bonus() -> None:
    """All drafts equal the argmax: k accepted, then the bonus = argmax of row k."""
    result = greedy([3, 1, 4], one_hot_rows([3, 1, 4, 2]))
    assert result.token_ids.tolist() == [3, 1, 4, 2]
    assert result.num_accepted == 3


def test_greedy_first_mismatch_emits_argmax_and_stops() -> None:
    """Accept while draft == argmax; at the first mismatch emit the argmax; later rows unused."""
    result = greedy([3, 0, 4], one_hot_rows([3, 1, 4, 2]))
    assert result.token_ids.tolist() == [3, 1]
    assert result.num_accepted == 1
    result = greedy([2, 1, 4], one_hot_rows([3, 1, 4, 2]))
    assert result.token_ids.tolist() == [3]
    assert result.num_accepted == 0


def test_greedy_ties_go_to_lowest_id() -> None:
    """Tied maxima: argmax is the lowest id, for acceptance and for the emitted token."""
    tied = torch.tensor([[0.1, 0.4, 0.1, 0.4], [0.3, 0.3, 0.3, 0.1]])
    assert greedy([3], tied).token_ids.tolist() == [1]
    assert greedy([1], tied).token_ids.tolist() == [1, 0]
    tied_logits = torch.tensor([[NEG_INF, 2.0, 2.0, NEG_INF], [float("inf"), 0.0, float("inf"), 1]])
    assert greedy([1], tied_logits).token_ids.tolist() == [1, 0]
    assert greedy([2], tied_logits).token_ids.tolist() == [1]


def test_greedy_padding_rows() -> None:
    """num_draft_tokens < k: padding ids are ignored (even out-of-range ones); results padded."""
    target = torch.stack(
        [one_hot_rows([1, 2, 3, 4]), one_hot_rows([1, 2, 3, 4]), one_hot_rows([4, 0, 0, 0])]
    )
    draft = torch.tensor([[1, 2, 3], [1, 2, 99], [PLACEHOLDER_TOKEN_ID] * 3])
    result = verify_batch_greedy(draft, torch.tensor([3, 1, 0]), target)
    P = PLACEHOLDER_TOKEN_ID
    assert result.token_ids.tolist() == [[1, 2, 3, 4], [1, 2, P, P], [4, P, P, P]]
    assert result.num_accepted.tolist() == [3, 1, 0]
    assert result.num_tokens.tolist() == [4, 2, 1]
    assert result.row(1).token_ids.tolist() == [1, 2]


def test_verify_block_greedy_matches_batch_rule() -> None:
    """verify_block(greedy=True) is the greedy rule; the rng and q are not consulted."""
    target = one_hot_rows([3, 1, 4, 2])
    draft_probs = torch.full((3, 5), 0.2)
    for draft_ids, expected in [([3, 1, 4], [3, 1, 4, 2]), ([3, 2, 4], [3, 1]), ([0, 1, 4], [3])]:
        result = verify_block(
            torch.tensor(draft_ids), draft_probs, target, rng=torch.Generator(), greedy=True
        )
        assert result.token_ids.tolist() == expected


def test_greedy_identity_with_target_only_decoding() -> None:
    """Greedy speculation commits exactly the target-only greedy tokens, for every draft block.

    History matters (frequency penalty), so the target's greedy continuation is computed
    token by token with the pipeline, and each round must commit its first m tokens, where
    m - 1 is the length of the draft's agreement with it.
    """
    vocab, k = 4, 3
    params = SamplingParams(temperature=0, frequency_penalty=1.5)
    pipeline = LogitsPipeline(params, vocab, PROMPT_TOKEN_IDS)
    reference: list[int] = []
    for _ in range(k + 1):
        row = target_logits(vocab, tuple(reference))[None]
        probs = pipeline.probs(row, OUTPUT_TOKEN_IDS + tuple(reference))
        reference.append(int(probs.argmax()))
    assert len(set(reference)) > 1
    for block in itertools.product(range(vocab), repeat=k):
        logits = torch.stack([target_logits(vocab, block[:i]) for i in range(k + 1)])
        target_probs = pipeline.probs(logits, OUTPUT_TOKEN_IDS, block)  # [k+1, vocab]
        draft_probs = torch.full((k, vocab), 1.0 / vocab)
        result = verify_block(
            torch.tensor(block), draft_probs, target_probs, rng=torch.Generator(), greedy=True
        )
        agreement = next((j for j in range(k) if block[j] != reference[j]), k)
        assert result.num_accepted == agreement
        assert result.token_ids.tolist() == reference[: agreement + 1]
