"""Exactness with the drafts ``specray distill`` makes, through ``Engine.generate``.

A reduced-vocabulary head gives q = 0 outside its tokens; the rule must still produce the
target's exact law (tokens the draft cannot propose come from the residual). The n-gram-first
chain mixes point-mass blocks and model blocks. Same harness and oracle as
``test_engine_distribution``: N = 2000 generations (seeds 0..1999) of L = 3 tokens, k = 2,
Pearson chi-square against the enumerated sequence law, cells below 5 expected pooled,
ALPHA = 0.001, and no sequence of probability 0 may appear.

Negative control: a drafter that samples from its q but sends another (q mixed half-and-half
with the uniform distribution, i.e. it misreports what it sampled from) must be rejected.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specray.distill.student import build_student, quantize_draft
from specray.drafters import FirstFoundDrafter, ModelDrafter, NgramDrafter
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding
from specray.sampling.encoding import dense_draft_probs
from tests.helpers.tiny_models import tiny_llama
from tests.statistical.test_engine_distribution import (
    ALPHA,
    NGRAM_PROMPT,
    NUM_SAMPLES,
    VOCAB_SIZE,
    Case,
    _one_thread,  # noqa: F401  (autouse fixture: one torch thread for this module too)
    _pooled_metrics,
    run_case,
)

HEAD_TOKENS = [0, 1, 3]  # the reduced head: q(2) = q(4) = 0


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB_SIZE, 0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def student(target):
    """A 1-layer student of the 2-layer target with a 3-token head, perturbed so it differs
    from its initialisation (acceptance is partial)."""
    model = build_student(target, 1, torch.tensor(HEAD_TOKENS))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and "norm" not in name:
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(0.5 * parameter.std() * noise)
    return model.eval()


def _model_drafter(student) -> ModelDrafter:
    return ModelDrafter(ModelRunner(student), DraftProbsEncoding.parse("fp32"))


def _int8_lean_drafter(student) -> ModelDrafter:
    """The student as a CPU draft runs by default here: weight-only int8 linears and head,
    computed by the lean decoder (models/int8.py, models/lean.py)."""
    runner = ModelRunner(quantize_draft(copy.deepcopy(student)), lean=True)
    assert runner._lean is not None
    return ModelDrafter(runner, DraftProbsEncoding.parse("fp32"))


DRAFTERS = {"fp32": _model_drafter, "int8-lean": _int8_lean_drafter}


class MisreportingDrafter:
    """WRONG: samples from its q, sends (q + uniform) / 2."""

    def __init__(self, inner):
        self.inner, self.vocab_size = inner, inner.vocab_size

    def propose(self, requests):
        blocks = self.inner.propose(requests)
        for block in blocks:
            q = dense_draft_probs(block.draft_probs)  # [n, vocab]
            block.draft_probs = 0.5 * q + 0.5 * torch.full_like(q, 1.0 / self.vocab_size)
            block.encoded = None
        return blocks

    def release(self, request_ids):
        self.inner.release(request_ids)


def test_reduced_head_puts_no_mass_outside(student):
    logits = student(torch.tensor([[0, 3, 1]])).logits[0, -1]  # [vocab]
    assert torch.isinf(logits[[2, 4]]).all() and torch.isfinite(logits[HEAD_TOKENS]).all()


@pytest.mark.parametrize(
    "name, options",
    [
        ("temperature-1.0", {}),
        ("top_p-0.8", {"top_p": 0.8}),
        ("banned-1", {"banned_token_ids": [1]}),
    ],
)
def test_reduced_vocabulary_draft_is_exact(name, options, target, student, record_property):
    outputs, fit = run_case(Case(name, options), target, _model_drafter(student))
    record_property("fit", fit.describe())
    assert fit.impossible_count == 0, fit.describe()
    assert fit.p_value >= ALPHA, f"{name}: rejected; {fit.describe()}"
    drafted, accepted, full_blocks = _pooled_metrics(outputs)
    assert 0 < accepted < drafted and full_blocks > 0, (drafted, accepted, full_blocks)
    # Tokens outside the head were committed (from the residual), so that path ran.
    committed = {token for output in outputs for token in output.token_ids}
    assert committed & {2, 4}, committed


def test_int8_lean_draft_is_exact(target, student, record_property):
    outputs, fit = run_case(Case("int8-lean"), target, _int8_lean_drafter(student))
    record_property("fit", fit.describe())
    assert fit.impossible_count == 0, fit.describe()
    assert fit.p_value >= ALPHA, f"int8-lean: rejected; {fit.describe()}"
    drafted, accepted, full_blocks = _pooled_metrics(outputs)
    assert 0 < accepted < drafted and full_blocks > 0, (drafted, accepted, full_blocks)


def test_ngram_then_model_chain_is_exact(target, student, record_property):
    ngram, model = NgramDrafter(VOCAB_SIZE), _model_drafter(student)
    blocks = {"ngram": 0, "model": 0}  # non-empty blocks each proposer made

    def counted(name, propose):
        def wrapper(requests):
            made = propose(requests)
            blocks[name] += sum(1 for block in made if block.token_ids)
            return made

        return wrapper

    ngram.propose = counted("ngram", ngram.propose)
    model.propose = counted("model", model.propose)
    _, fit = run_case(
        Case("chain", prompt=tuple(NGRAM_PROMPT)), target, FirstFoundDrafter(ngram, model)
    )
    record_property("fit", fit.describe())
    assert fit.impossible_count == 0 and fit.p_value >= ALPHA, fit.describe()
    assert blocks["ngram"] > 0 and blocks["model"] > 0, blocks  # both proposers ran


@pytest.mark.parametrize("draft", sorted(DRAFTERS))
def test_negative_control_misreported_q_is_rejected(draft, target, student, record_property):
    wrong = MisreportingDrafter(DRAFTERS[draft](student))
    _, fit = run_case(Case("misreported-q"), target, wrong)
    record_property("fit", fit.describe())
    assert fit.p_value < ALPHA, f"a misreported q was not detected: {fit.describe()}"


def test_sample_size_is_as_documented():
    assert NUM_SAMPLES == 2000
