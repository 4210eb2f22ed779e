"""Prompt-lookup drafting: the continuation rule and its point-mass q."""

import torch

from specray.drafters import DraftRequest, NgramDrafter, find_continuation
from specray.sampling import KeyedRandom, LogitsPipeline, SamplingParams
from specray.sampling.encoding import SparseDraftProbs


def test_longest_latest_match_wins():
    history = [5, 6, 7, 9, 1, 6, 8, 5, 6]
    # suffix [5, 6] matched at index 0 (followed by 7, 9); [6] alone would match index 5 first
    assert find_continuation(history, 2, min_ngram=1, max_ngram=3) == [7, 9]


def test_no_match_gives_empty_block():
    assert find_continuation([1, 2, 3, 4], 3, min_ngram=1, max_ngram=3) == []


def test_block_is_truncated_at_history_end():
    assert find_continuation([3, 4, 3], 5, min_ngram=1, max_ngram=2) == [4, 3]


def test_draft_probs_are_point_masses():
    vocab = 10
    params = SamplingParams(temperature=1.0)
    request = DraftRequest(
        "r", [1, 2, 3, 1, 2], [], LogitsPipeline(params, vocab), KeyedRandom(0), num_tokens=2
    )
    (block,) = NgramDrafter(vocab).propose([request])
    assert block.token_ids == [3, 1]
    expected = torch.zeros(2, vocab)
    expected[0, 3] = expected[1, 1] = 1.0
    assert isinstance(block.draft_probs, SparseDraftProbs)  # one id a row, no vocabulary row
    assert torch.equal(block.draft_probs.to_dense(), expected)
