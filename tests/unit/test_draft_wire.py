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
from specray.sampling.encoding import (
    POINT_MASS_ENCODING,
    SparseDraftProbs,
    dense_draft_probs,
    encode_draft_probs,
    point_mass_rows,
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
        assert torch.equal(rows, dense_draft_probs(block.draft_probs))
    one_hot = torch.zeros(3, VOCAB)
    one_hot[torch.arange(3), torch.tensor(greedy.token_ids)] = 1.0
    # the greedy block keeps its point masses sparse: one id a row, no vocabulary row
    assert isinstance(greedy.draft_probs, SparseDraftProbs)
    assert greedy.draft_probs.token_ids.shape == (3, 1)
    assert torch.equal(greedy.draft_probs.to_dense(), one_hot)
    assert isinstance(sampled.draft_probs, torch.Tensor)


def test_the_wire_form_changes_no_draft():
    (greedy, sampled), (greedy_kept, sampled_kept) = _propose(True), _propose(False)
    assert greedy.token_ids == greedy_kept.token_ids
    # a point mass is exact
    assert torch.equal(greedy.draft_probs.to_dense(), greedy_kept.draft_probs.to_dense())
    # a dense row is renormalised after decoding (float rounding), too little to move a draw
    assert sampled.token_ids == sampled_kept.token_ids
    torch.testing.assert_close(sampled.draft_probs, sampled_kept.draft_probs)


def test_an_all_greedy_step_sends_the_point_masses_encoding_would():
    """A step whose requests are all greedy takes its tokens from the argmax ids and sends them
    as point masses directly: the same tokens, q and bytes as a step that also samples (where
    each greedy row is encoded, decoded and drawn from), and the bytes encode_draft_probs
    gives for those one-hot rows."""

    def greedy(name, prompt):
        params = SamplingParams(temperature=0.0)
        return DraftRequest(
            name, prompt, [], LogitsPipeline(params, VOCAB), KeyedRandom(5), num_tokens=3
        )

    def propose(requests):
        torch.manual_seed(0)
        drafter = ModelDrafter(
            ModelRunner(tiny_llama(VOCAB, 0)), DraftProbsEncoding.parse("fp32"), keep_encoded=True
        )
        return drafter.propose(requests)

    alone, other = propose([greedy("a", [3, 7, 1, 9]), greedy("b", [5, 2, 8])])
    beside_sampled = propose([greedy("a", [3, 7, 1, 9]), _requests(VOCAB)[1]])[0]
    assert alone.token_ids == beside_sampled.token_ids
    assert isinstance(beside_sampled.draft_probs, SparseDraftProbs)
    assert torch.equal(alone.draft_probs.to_dense(), beside_sampled.draft_probs.to_dense())
    assert alone.encoded == beside_sampled.encoded
    for block in (alone, other):
        one_hot = torch.zeros(3, VOCAB)
        one_hot[torch.arange(3), torch.tensor(block.token_ids)] = 1.0
        assert isinstance(block.draft_probs, SparseDraftProbs)
        assert torch.equal(block.draft_probs.to_dense(), one_hot)
        expected = encode_draft_probs(one_hot, POINT_MASS_ENCODING)
        assert block.encoded == expected
    assert point_mass_rows([4, 0], VOCAB)[1] == encode_draft_probs(
        torch.eye(VOCAB)[:1], POINT_MASS_ENCODING
    )


def test_a_greedy_request_whose_logits_are_processed_drafts_from_the_processed_ones():
    """An all-greedy step of plain requests takes the raw argmax; one with a banned token
    (or any bias, penalty, grammar) goes through its pipeline: the raw argmax banned, the
    draft proposes the runner-up."""
    prompt = [3, 7, 1, 9]
    model = tiny_llama(VOCAB, 0)
    raw = ModelRunner(model).forward({"r": prompt}, {"r": 1})["r"][0]  # [vocab]
    first, second = raw.topk(2).indices.tolist()

    def propose(params):
        pipeline = LogitsPipeline(params, VOCAB)
        drafter = ModelDrafter(ModelRunner(model), DraftProbsEncoding.parse("fp32"))
        request = DraftRequest("r", prompt, [], pipeline, KeyedRandom(5), num_tokens=1)
        return pipeline.plain, drafter.propose([request])[0].token_ids

    assert propose(SamplingParams(temperature=0.0)) == (True, [first])
    assert propose(SamplingParams(temperature=0.0, banned_token_ids=[first])) == (False, [second])
