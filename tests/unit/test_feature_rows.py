"""Target feature rows over the network: the row bookkeeping (prefix, overlaps, gaps), the
verdict's feature field, and the tolerant FeatureDrafter (rows missing or late) that a draft
worker runs."""

from __future__ import annotations

import pytest
import torch

from specray.drafters import FeatureDrafter
from specray.feature_rows import FeatureRows
from specray.models.runner import ModelRunner
from specray.rpc.messages import InvalidMessageError, check_verdict_features, features_to_pb
from specray.sampling import DraftProbsEncoding
from specray.v1 import speculation_pb2 as pb
from tests.helpers.tiny_models import tiny_llama
from tests.statistical.test_engine_distribution import _one_thread  # noqa: F401 (autouse)
from tests.statistical.test_feature_draft import random_feature_draft
from tests.unit.test_feature_draft import VOCAB_SIZE, _features, _request, _same_block


@pytest.fixture(scope="module")
def target():
    """test_feature_draft's pair: the rows there are 32 wide."""
    return tiny_llama(VOCAB_SIZE, 0, hidden_size=32, intermediate_size=64, num_hidden_layers=2)


@pytest.fixture(scope="module")
def draft(target):
    return random_feature_draft(target, list(range(12)), noise=0.1)


def _rows(start: int, count: int, size: int = 4) -> torch.Tensor:
    """Row j holds the value start + j: ``[count, size]``."""
    return torch.arange(start, start + count).float()[:, None].expand(count, size).clone()


def test_rows_are_a_prefix_overlaps_keep_held_rows_and_gaps_are_refused():
    rows = FeatureRows(4)
    assert rows.write(0, _rows(0, 3)) and len(rows) == 3
    before = rows.view()
    assert rows.write(2, _rows(100, 2))  # row 2 is held: kept; row 3 is new
    assert rows.view()[:, 0].tolist() == [0, 1, 2, 101]
    assert before[:, 0].tolist() == [0, 1, 2], "a view handed out never changes"
    assert not rows.write(6, _rows(6, 1)) and len(rows) == 4  # rows 4, 5 missing: refused
    assert rows.write(4, _rows(4, 100))  # grows past the initial capacity
    assert len(rows) == 104 and rows.view(5)[:, 0].tolist() == [0, 1, 2, 101, 4]
    assert before[:, 0].tolist() == [0, 1, 2]
    rows.truncate(2)
    assert rows.write(2, _rows(50, 1)) and rows.view()[:, 0].tolist() == [0, 1, 50]
    assert rows.view(10).shape == (3, 4) and rows.view(0).shape == (0, 4)


def test_verdict_features_round_trip_as_bf16_and_are_validated():
    verdict = pb.Verdict(request_id="r", step=3)
    assert check_verdict_features(verdict, 4) is None
    rows = torch.randn(5, 4)
    features_to_pb(verdict, rows, 7)
    assert verdict.target_features.dtype == "bfloat16" and len(verdict.target_features.data) == 40
    start, decoded = check_verdict_features(pb.Verdict.FromString(verdict.SerializeToString()), 4)
    assert start == 7 and decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, rows.to(torch.bfloat16).float())
    with pytest.raises(InvalidMessageError, match=r"shape \[n, 8\]"):
        check_verdict_features(verdict, 8)
    features_to_pb(verdict, torch.tensor([[float("nan")] * 4]), 0)
    with pytest.raises(InvalidMessageError, match="finite"):
        check_verdict_features(verdict, 4)
    verdict.target_features.data = b"\x00" * 3
    with pytest.raises(InvalidMessageError, match="target_features"):
        check_verdict_features(verdict, 4)


def _tolerant(model) -> FeatureDrafter:
    encoding = DraftProbsEncoding.parse("fp32")
    return FeatureDrafter(ModelRunner(model), encoding, tolerant=True)


def test_tolerant_drafter_with_every_row_is_the_strict_one(target, draft):
    prompt, output = [0, 3, 1, 4], [2, 7]
    strict = FeatureDrafter(ModelRunner(draft), DraftProbsEncoding.parse("fp32"))
    tolerant = _tolerant(draft)
    for drafted in ([], output):
        request = _request(target, prompt, drafted, 3, seed=4)
        _same_block(tolerant.propose([request])[0], strict.propose([request])[0])
    assert tolerant.rows_without_target == 0
    assert tolerant.target_rows_fed == strict.target_rows_fed


def test_tolerant_drafter_drafts_without_rows_and_recomputes_when_they_arrive(target, draft):
    prompt = [0, 3, 1, 4, 6]
    tolerant = _tolerant(draft)
    none = _request(target, prompt, [], 3, features=torch.zeros(0, 32))
    block = tolerant.propose([none])[0]  # no row yet: chained features / zeros
    assert len(block.token_ids) == 3 and tolerant.rows_without_target == len(prompt) - 1
    some = _request(target, prompt, [], 3, features=_features(target, prompt)[:2])
    tolerant.propose([some])  # rows 0, 1 arrived: positions 1, 2 recomputed from them
    assert tolerant._num_from_target["r"] == 3
    fed = tolerant.target_rows_fed
    tolerant.propose([some])  # nothing new arrived: the cache is kept, nothing recomputed
    assert tolerant.target_rows_fed == fed and tolerant._num_from_target["r"] == 3
    # Every row now: the block is the one a fresh strict drafter makes.
    full = _request(target, prompt, [5], 3, seed=2)
    strict = FeatureDrafter(ModelRunner(draft), DraftProbsEncoding.parse("fp32"))
    _same_block(tolerant.propose([full])[0], strict.propose([full])[0])
    assert tolerant._num_from_target["r"] == len(prompt) + 1


def test_tolerant_drafter_takes_history_past_the_rows(target, draft):
    """A worker's history runs past the committed tokens (its drafts made ahead): those
    positions have no target row and are fed with the chained g they were drafted with."""
    prompt = [0, 3, 1, 4]
    tolerant = _tolerant(draft)
    first = tolerant.propose([_request(target, prompt, [], 3)])[0]
    ahead = first.token_ids[:2]  # assumed accepted, not yet verified
    rows = _features(target, prompt)  # h_0 .. h_2: the committed part only
    block = tolerant.propose([_request(target, prompt, ahead, 2, features=rows)])[0]
    assert len(block.token_ids) == 2 and tolerant._num_from_target["r"] == len(prompt)
    assert tolerant.rows_without_target > 0
    with pytest.raises(ValueError, match="target_features"):  # strict: every row is required
        FeatureDrafter(ModelRunner(draft), DraftProbsEncoding.parse("fp32")).propose(
            [_request(target, prompt, ahead, 2, features=rows)]
        )
    tolerant.release(["r"])
    assert not tolerant._chained and not tolerant._num_from_target
