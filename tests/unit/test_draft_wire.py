"""What a draft model sends for each request: a greedy request's one-hot q as a point mass
(its id, 8 bytes a row), a sampled request's q in the configured encoding; both decode to the
rows the tokens were sampled from."""

import torch

from specray.drafters import DraftRequest, ModelDrafter
from specray.models.runner import ModelRunner
from specray.sampling import (
    DraftProbsEncoding,
    KeyedRandom,
    LogitsPipeline,
    SamplingParams,
    decode_draft_probs,
)
from tests.helpers.tiny_models import tiny_llama

VOCAB = 40


def _requests(vocab: int) -> list[DraftRequest]:
    def request(name, params):
        pipeline = LogitsPipeline(params, vocab)
        return DraftRequest(name, [3, 7, 1, 9], [], pipeline, KeyedRandom(5), num_tokens=3)

    return [
        request("greedy", SamplingParams(temperature=0.0)),
        request("sampled", SamplingParams(temperature=1.0, seed=5)),
    ]


def _propose(keep_encoded: bool):
    torch.manual_seed(0)
    drafter = ModelDrafter(
        ModelRunner(tiny_llama(VOCAB, 0)),
        DraftProbsEncoding.parse("fp32"),
        keep_encoded=keep_encoded,
    )
    return drafter.propose(_requests(VOCAB))


def test_greedy_rows_go_as_point_masses_and_sampled_rows_stay_dense():
    greedy, sampled = _propose(keep_encoded=True)
    assert greedy.encoded.encoding == "top1" and greedy.encoded.num_bytes == 8 * 3
    assert sampled.encoded.encoding == "fp32"
    assert sampled.encoded.num_bytes == 4 * VOCAB * 3
    for block in (greedy, sampled):
        # the receiver decodes row by row: the same q the drafter sampled from
        rows = torch.cat([decode_draft_probs(block.encoded.row(j)) for j in range(3)])
        assert torch.equal(rows, block.draft_probs)
    one_hot = torch.zeros(3, VOCAB)
    one_hot[torch.arange(3), torch.tensor(greedy.token_ids)] = 1.0
    assert torch.equal(greedy.draft_probs, one_hot)


def test_the_wire_form_changes_no_draft():
    (greedy, sampled), (greedy_kept, sampled_kept) = _propose(True), _propose(False)
    assert greedy.token_ids == greedy_kept.token_ids
    assert torch.equal(greedy.draft_probs, greedy_kept.draft_probs)  # a point mass is exact
    # a dense row is renormalised after decoding (float rounding), too little to move a draw
    assert sampled.token_ids == sampled_kept.token_ids
    torch.testing.assert_close(sampled.draft_probs, sampled_kept.draft_probs)
