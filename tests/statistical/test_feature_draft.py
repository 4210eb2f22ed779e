"""Exactness with a feature-conditioned (EAGLE-style) draft, through ``Engine.generate``.

The draft reads the target's final-norm hidden states (features) beside the tokens; whatever
it reads, it samples from exactly the q it returns, so the output must follow the target's
exact law. Same harness and oracle as ``test_engine_distribution``: target
``tiny_llama(5, seed=0, 2 layers)``, N = 2000 generations (seeds 0..1999, all in one batch) of
L = 3 tokens from the prompt [0, 3, 1], k = 2, Pearson chi-square against the enumerated
sequence law, cells below 5 expected pooled, ALPHA = 0.001, and no sequence of probability 0
may appear.

Drafts: 1-layer feature-conditioned students of the target (``FeatureDraftModel``) with random
perturbations (seed 7: every trained weight plus noise of half its standard deviation, and the
feature half of ``fc`` random, so the features move q and acceptance is partial). Cases:
temperature 1 with a reduced 3-token head ({0, 1, 3}: q(2) = q(4) = 0), top-p 0.8 with the
full head.

Negative control: a feature drafter that samples from its q but reports (q + uniform) / 2 must
be rejected. The drafter is shown to read the target's features: it counts the target rows it
fed, and the same run with the features zeroed drafts differently.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specray.distill.student import FeatureDraftModel, build_student
from specray.drafters import FeatureDrafter
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding
from specray.sampling.encoding import dense_draft_probs
from tests.helpers.tiny_models import tiny_llama
from tests.statistical.test_engine_distribution import (
    ALPHA,
    NUM_SAMPLES,
    VOCAB_SIZE,
    Case,
    _one_thread,  # noqa: F401  (autouse fixture: one torch thread for this module too)
    _pooled_metrics,
    run_case,
)

HEAD_TOKENS = [0, 1, 3]  # the reduced head: q(2) = q(4) = 0
DRAFT_SEED = 7


def random_feature_draft(target, head_tokens=None, *, seed: int = DRAFT_SEED, noise: float = 0.5):
    """A 1-layer feature-conditioned student of ``target`` (head over ``head_tokens``, all when
    None), every trained weight plus Gaussian noise of ``noise`` times its standard deviation
    and the feature half of ``fc`` random (so features change q); eval mode."""
    vocab_ids = None if head_tokens is None else torch.tensor(head_tokens)
    model = FeatureDraftModel(build_student(target, 1, vocab_ids))
    hidden_size = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and "norm" not in name and "fc" not in name:
                scale = noise * parameter.std()
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
        feature_half = torch.randn(hidden_size, hidden_size, generator=generator)
        model.fc.weight[:, hidden_size:] = feature_half / hidden_size**0.5
    return model.eval()


def _drafter(model, drafter_class=FeatureDrafter) -> FeatureDrafter:
    return drafter_class(ModelRunner(model), DraftProbsEncoding.parse("fp32"))


class MisreportingFeatureDrafter(FeatureDrafter):
    """WRONG: samples from its q, reports (q + uniform) / 2."""

    def propose(self, requests):
        blocks = super().propose(requests)
        for block in blocks:
            q = dense_draft_probs(block.draft_probs)  # [n, vocab]
            block.draft_probs = 0.5 * q + 0.5 * torch.full_like(q, 1.0 / self.vocab_size)
        return blocks


class ZeroFeatureDrafter(FeatureDrafter):
    """Reads zeros instead of the target's features (still exact: only q changes)."""

    def _sync(self, request):
        zeros = torch.zeros_like(request.target_features)
        return super()._sync(dataclasses.replace(request, target_features=zeros))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB_SIZE, 0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def reduced_draft(target):
    return random_feature_draft(target, HEAD_TOKENS)


@pytest.fixture(scope="module")
def full_draft(target):
    return random_feature_draft(target)


@pytest.mark.parametrize(
    "name, options, head",
    [("temperature-1.0", {}, "reduced"), ("top_p-0.8", {"top_p": 0.8}, "full")],
)
def test_feature_draft_is_exact(
    name, options, head, target, reduced_draft, full_draft, record_property
):
    drafter = _drafter(reduced_draft if head == "reduced" else full_draft)
    outputs, fit = run_case(Case(name, options), target, drafter)
    record_property("fit", fit.describe())
    assert fit.impossible_count == 0, fit.describe()
    assert fit.p_value >= ALPHA, f"{name}: rejected; {fit.describe()}"
    drafted, accepted, full_blocks = _pooled_metrics(outputs)
    assert 0 < accepted < drafted and full_blocks > 0, (drafted, accepted, full_blocks)
    # Prompt features for each request, then the accepted drafts' and bonus tokens' ones.
    assert drafter.target_rows_fed >= 2 * NUM_SAMPLES, drafter.target_rows_fed
    if head == "reduced":  # tokens outside the head came from the residual
        committed = {token for output in outputs for token in output.token_ids}
        assert committed & {2, 4}, committed


def test_features_change_the_draft(target, reduced_draft):
    """Zeroed features give other draft tokens (different acceptance), exact all the same."""
    real, _ = run_case(Case("temperature-1.0"), target, _drafter(reduced_draft))
    zeroed, fit = run_case(
        Case("temperature-1.0"), target, _drafter(reduced_draft, ZeroFeatureDrafter)
    )
    assert fit.p_value >= ALPHA, fit.describe()
    assert _pooled_metrics(real) != _pooled_metrics(zeroed)


def test_negative_control_misreported_q_is_rejected(target, reduced_draft, record_property):
    wrong = _drafter(reduced_draft, MisreportingFeatureDrafter)
    _, fit = run_case(Case("misreported-q"), target, wrong)
    record_property("fit", fit.describe())
    assert fit.p_value < ALPHA, f"a misreported q was not detected: {fit.describe()}"


def test_sample_size_is_as_documented():
    assert NUM_SAMPLES == 2000
