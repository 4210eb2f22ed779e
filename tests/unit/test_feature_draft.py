"""The feature-conditioned (EAGLE-style) draft in process: the runner's hidden rows, the features
the target core keeps, greedy identity through the engine, the draft cache's re-sync, and
``specray distill --feature-conditioned`` end to end on a tiny target."""

from __future__ import annotations

import json

import pytest
import torch

from specray.distill.config import DistillConfig
from specray.distill.pipeline import run_distill
from specray.distill.student import DRAFT_FILE
from specray.drafters import DraftRequest, FeatureDrafter
from specray.engine import Engine
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding, KeyedRandom, LogitsPipeline, SamplingParams
from tests.helpers.tiny_models import tiny_llama
from tests.statistical.test_engine_distribution import (
    _one_thread,  # noqa: F401  (autouse fixture: tiny ops, one torch thread on a busy machine)
)
from tests.statistical.test_feature_draft import random_feature_draft
from tests.unit.test_distill import PROMPTS, small_config, tiny_target  # noqa: F401 (fixture)

VOCAB_SIZE = 16
PROMPT_IDS = [[5], [0, 3, 1], [7, 2, 9, 9, 4, 11, 1]]  # 1, 3 and 7 tokens


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB_SIZE, 0, hidden_size=32, intermediate_size=64, num_hidden_layers=2)


@pytest.fixture(scope="module")
def draft(target):
    """Close to its initialisation (the target's last layer), so drafts are often accepted."""
    return random_feature_draft(target, list(range(12)), noise=0.1)


def _features(target, token_ids) -> torch.Tensor:
    """h_0 .. h_{T-2}, teacher-forced without a cache: ``[T - 1, hidden]``."""
    with torch.no_grad():
        hidden = target.get_decoder()(torch.tensor([token_ids])).last_hidden_state[0]
    return hidden[:-1]


def _request(target, prompt, output, k, *, seed=0, features=None) -> DraftRequest:
    params = SamplingParams(seed=seed)
    token_ids = [*prompt, *output]
    return DraftRequest(
        "r",
        prompt,
        output,
        LogitsPipeline(params, VOCAB_SIZE, prompt),
        KeyedRandom(seed),
        k,
        target_features=_features(target, token_ids) if features is None else features,
    )


def _drafter(model) -> FeatureDrafter:
    return FeatureDrafter(ModelRunner(model), DraftProbsEncoding.parse("fp32"))


def test_runner_returns_hidden_rows_on_request(target):
    runner = ModelRunner(target)
    logits = runner.forward({"a": [1, 2, 3]}, {"a": 1})
    assert isinstance(logits, dict)  # unchanged without num_hidden
    logits, hidden = runner.forward({"a": [4, 5], "b": [6]}, {"a": 2}, num_hidden={"a": 2, "b": 1})
    assert hidden["a"].shape == (2, 32) and hidden["b"].shape == (1, 32) and "b" not in logits
    expected = _features(target, [1, 2, 3, 4, 5, 0])[-2:]  # rows of positions 3 and 4
    torch.testing.assert_close(hidden["a"], expected, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        from_head = target.get_output_embeddings()(hidden["a"])
    torch.testing.assert_close(logits["a"], from_head, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="features must be given exactly"):
        runner.forward({"a": [1]}, {"a": 1}, features={"a": torch.zeros(1, 32)})


class RecordingDrafter(FeatureDrafter):
    """Checks every request's features against the teacher-forced target's."""

    def __init__(self, model, target):
        super().__init__(ModelRunner(model), DraftProbsEncoding.parse("fp32"))
        self.target, self.checked = target, 0

    def propose(self, requests):
        for request in requests:
            expected = _features(self.target, request.token_ids)
            torch.testing.assert_close(request.target_features, expected, atol=1e-4, rtol=1e-4)
            self.checked += 1
        return super().propose(requests)


def test_core_keeps_the_target_features_of_committed_positions(target, draft):
    drafter = RecordingDrafter(draft, target)
    engine = Engine(target, draft=drafter, num_speculative_tokens=3, max_batch_size=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3)  # sampled: rejections
    outputs = engine.generate(PROMPT_IDS, params)
    assert drafter.checked >= 3
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
    assert not engine.core._features  # released with the requests


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identity(target, draft, k):
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, seed=0)
    reference = Engine(target, draft=None).generate(PROMPT_IDS, params)
    # max_batch_size 2: the third request joins while others are mid-generation.
    engine = Engine(target, draft=draft, num_speculative_tokens=k, max_batch_size=2)
    assert isinstance(engine.drafter, FeatureDrafter) and engine.core.keep_features
    outputs = engine.generate(PROMPT_IDS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert accepted > 0 and (k == 1 or accepted < drafted), (drafted, accepted)


def test_target_only_engine_keeps_no_features(target):
    engine = Engine(target, draft="ngram", num_speculative_tokens=2)
    assert not engine.core.keep_features
    engine.generate(PROMPT_IDS, SamplingParams(max_tokens=4, seed=0))
    assert not engine.core._features


def _same_block(left, right):
    assert left.token_ids == right.token_ids
    torch.testing.assert_close(left.draft_probs, right.draft_probs, atol=1e-5, rtol=1e-5)


def test_resync_gives_the_block_a_fresh_drafter_gives(target, draft):
    prompt = [0, 3, 1, 4]
    drafter = _drafter(draft)
    first = drafter.propose([_request(target, prompt, [], 3)])[0]
    again = drafter.propose([_request(target, prompt, [], 3)])[0]  # same committed tokens
    _same_block(first, again)
    # The target accepted d_1 then emitted another token: d_1's cache entry came from chained
    # features and is recomputed from the target's.
    output = [first.token_ids[0], (first.token_ids[1] + 1) % VOCAB_SIZE]
    fed_before = drafter.target_rows_fed
    moved = drafter.propose([_request(target, prompt, output, 3, seed=1)])[0]
    assert drafter.target_rows_fed - fed_before == 2  # h of x_3 and of d_1
    _same_block(moved, _drafter(draft).propose([_request(target, prompt, output, 3, seed=1)])[0])
    # A rollback into the prompt (another sequence under the same id): re-synced as well.
    other = [0, 3, 2]
    rolled = drafter.propose([_request(target, other, [], 2, seed=2)])[0]
    _same_block(rolled, _drafter(draft).propose([_request(target, other, [], 2, seed=2)])[0])


def test_features_change_q_and_are_required(target, draft):
    prompt = [0, 3, 1, 4]
    real = _drafter(draft).propose([_request(target, prompt, [], 1)])[0]
    zeros = torch.zeros(len(prompt) - 1, 32)
    zeroed = _drafter(draft).propose([_request(target, prompt, [], 1, features=zeros)])[0]
    assert not torch.allclose(real.draft_probs, zeroed.draft_probs, atol=1e-3)
    with pytest.raises(ValueError, match="target_features"):
        _drafter(draft).propose([_request(target, prompt, [], 1, features=zeros[:2])])
    with pytest.raises(ValueError, match="embed_with_features"):
        FeatureDrafter(ModelRunner(target), DraftProbsEncoding.parse("fp32"))


@pytest.mark.slow  # a whole distillation run
def test_distill_feature_conditioned_end_to_end(tiny_target, tmp_path):  # noqa: F811
    config = small_config(tiny_target, feature_conditioned=True)
    summary = run_distill(tmp_path, config)
    assert summary["train"]["steps"] == 6 and summary["draft"]["feature_conditioned"]
    assert json.loads((tmp_path / DRAFT_FILE).read_text())["feature_conditioned"] is True
    params = SamplingParams(temperature=0, max_tokens=12, seed=0)
    reference = Engine(tiny_target, draft=None).generate(PROMPTS, params)
    engine = Engine(tiny_target, draft=str(tmp_path), num_speculative_tokens=3)
    assert isinstance(engine.drafter, FeatureDrafter)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert engine.drafter.target_rows_fed > 0
    # The draft reads the target's own embedding tensor.
    draft_embed = engine.drafter.runner.model.get_input_embeddings().weight
    assert draft_embed.data_ptr() == engine.target.model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("field, value", [("feature_conditioned", "yes"), ("chained_passes", -1)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DistillConfig(**{field: value})
