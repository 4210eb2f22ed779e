"""Wire messages: every corruption of a draft block is refused before it reaches the sampler,
honest blocks decode to exactly the q the draft sampled from, and the inbox is idempotent."""

import time

import pytest
import torch

from specray.rpc import inbox as inbox_module
from specray.rpc.inbox import BlockInbox
from specray.rpc.messages import InvalidMessageError, block_to_pb, check_block
from specray.sampling import (
    DraftProbsEncoding,
    decode_draft_probs,
    encode_draft_probs,
    stack_rows,
)
from specray.sampling.encoding import SparseDraftProbs
from specray.v1 import speculation_pb2 as pb

VOCAB = 50


def _dense(draft_probs) -> torch.Tensor:
    """A checked block's q as ``[k, vocab]``; a top<M> block must have stayed sparse."""
    if isinstance(draft_probs, SparseDraftProbs):
        assert draft_probs.values.shape[-1] < VOCAB, "sparse q kept as [k, M]"
        return draft_probs.to_dense()
    return draft_probs


def _honest_block(encoding: str, k: int = 3, seed: int = 0):
    """Rows encoded one at a time, as the draft does; returns (message, decoded q rows)."""
    generator = torch.Generator().manual_seed(seed)
    rows, decoded = [], []
    for _ in range(k):
        probs = torch.softmax(torch.randn(1, VOCAB, generator=generator) * 3, dim=-1)
        row = encode_draft_probs(probs, DraftProbsEncoding.parse(encoding))
        rows.append(row)
        decoded.append(decode_draft_probs(row))
    q = torch.cat(decoded)  # [k, vocab]
    token_ids = q.argmax(dim=-1).tolist()
    return block_to_pb("req-1", 4, 7, token_ids, stack_rows(rows)), q


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "bf16", "top8"])
def test_honest_block_decodes_to_the_exact_q_sent(encoding):
    message, q = _honest_block(encoding)
    checked = check_block(pb.DraftBlock.FromString(message.SerializeToString()), VOCAB)
    assert isinstance(checked.draft_probs, SparseDraftProbs) == encoding.startswith("top")
    assert torch.equal(_dense(checked.draft_probs), q), "bit-identical q on both ends"
    assert (checked.request_id, checked.step, checked.num_committed) == ("req-1", 4, 7)


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "bf16", "top8"])
def test_block_mixing_point_masses_and_model_rows_decodes_exactly(encoding):
    """A block whose first tokens came from prompt lookup (point masses, top1) and the rest
    from a draft model: each row decodes on the receiver to exactly the q it was drawn from."""
    point_mass = DraftProbsEncoding.parse("top1")
    generator = torch.Generator().manual_seed(5)
    rows, decoded = [], []
    for index in range(4):
        if index in (0, 1, 3):  # the token id 0 case exercises the padding ids' choice
            probs = torch.zeros(1, VOCAB)
            probs[0, (0, 17, 49)[index % 3]] = 1.0
            row = encode_draft_probs(probs, point_mass)
        else:
            probs = torch.softmax(torch.randn(1, VOCAB, generator=generator) * 3, dim=-1)
            row = encode_draft_probs(probs, DraftProbsEncoding.parse(encoding))
        rows.append(row)
        decoded.append(decode_draft_probs(row))
    q = torch.cat(decoded)  # [4, vocab]
    message = block_to_pb("req-1", 4, 7, q.argmax(dim=-1).tolist(), stack_rows(rows))
    checked = check_block(pb.DraftBlock.FromString(message.SerializeToString()), VOCAB)
    assert torch.equal(_dense(checked.draft_probs), q), "bit-identical q on both ends"
    assert message.draft_probs.encoding == encoding


def test_rows_of_two_model_encodings_are_refused():
    probs = torch.softmax(torch.randn(1, VOCAB), dim=-1)
    rows = [encode_draft_probs(probs, DraftProbsEncoding.parse(name)) for name in ("fp16", "top8")]
    with pytest.raises(ValueError, match="share one encoding"):
        stack_rows(rows)


def test_sparse_q_is_small_on_the_wire():
    message, _ = _honest_block("top8", k=1)
    assert message.ByteSize() < 2048


def test_empty_block_means_no_proposal():
    checked = check_block(pb.DraftBlock(request_id="r", step=1), VOCAB)
    assert checked.token_ids == [] and checked.draft_probs.shape == (0, VOCAB)


def _corrupt(mutate) -> pb.DraftBlock:
    message, _ = _honest_block("fp32")
    mutate(message)
    return message


def _set_values(message, values: torch.Tensor):
    message.draft_probs.values.data = values.numpy().tobytes()


CORRUPTIONS = {
    "no request id": lambda m: setattr(m, "request_id", ""),
    "token id out of range": lambda m: m.token_ids.__setitem__(0, VOCAB),
    "negative token id": lambda m: m.token_ids.__setitem__(0, -1),
    "too many tokens": lambda m: m.token_ids.extend([1] * 40),
    "wrong shape": lambda m: m.token_ids.append(1),
    "truncated bytes": lambda m: setattr(
        m.draft_probs.values, "data", m.draft_probs.values.data[:-4]
    ),
    "wrong vocabulary": lambda m: setattr(m.draft_probs, "vocab_size", VOCAB + 1),
    "unknown encoding": lambda m: setattr(m.draft_probs, "encoding", "int4"),
    "unknown dtype": lambda m: setattr(m.draft_probs.values, "dtype", "float64"),
    "nan": lambda m: _set_values(m, torch.full((3, VOCAB), float("nan"))),
    "negative": lambda m: _set_values(m, torch.full((3, VOCAB), -1.0 / VOCAB)),
    "rows not summing to 1": lambda m: _set_values(m, torch.full((3, VOCAB), 3.0 / VOCAB)),
    "q zero at drafted token": lambda m: _set_values(
        m, torch.zeros(3, VOCAB).index_fill_(1, torch.tensor([VOCAB - 1]), 1.0)
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupted_block_is_refused(kind):
    message = _corrupt(CORRUPTIONS[kind])
    if kind == "q zero at drafted token":
        message.token_ids[:] = [0, 0, 0]
    with pytest.raises(InvalidMessageError):
        check_block(message, VOCAB)


def test_sparse_duplicate_ids_are_refused():
    message, _ = _honest_block("top8", k=1)
    ids = torch.zeros(1, 8, dtype=torch.int32)
    message.draft_probs.token_ids.data = ids.numpy().tobytes()
    with pytest.raises(InvalidMessageError, match="repeats"):
        check_block(message, VOCAB)


def test_inbox_first_copy_wins_and_replays_are_stale():
    inbox = BlockInbox()
    message, _ = _honest_block("fp32")
    block = check_block(message, VOCAB)
    replies = []
    assert inbox.put(block, replies.append)
    assert not inbox.put(block, replies.append), "a duplicate changes nothing"
    taken = inbox.take([("req-1", 4)], time.monotonic() + 1)
    assert taken[("req-1", 4)] is block
    assert not inbox.put(block, replies.append), "a replay after verification is stale"
    assert inbox.stats.duplicates == 1 and inbox.stats.stale == 1


def test_a_block_arriving_after_its_request_ended_is_not_kept(monkeypatch):
    """A block that missed its round's deadline can come after the request finished: it is
    parked, and dropped once parked for PARKED_TTL_S (kept, it would be held for the life of
    the process); a drop reason for it is not kept at all."""
    clock = [100.0]
    monkeypatch.setattr(inbox_module.time, "monotonic", lambda: clock[0])
    inbox = BlockInbox()
    block = check_block(_honest_block("fp32")[0], VOCAB)
    assert inbox.put(block, lambda verdict: None) and inbox.num_held == 2  # block, reply
    inbox.forget("req-1")
    assert inbox.num_held == 0
    assert inbox.put(block, lambda verdict: None) and inbox.num_held == 1  # parked
    assert not inbox.put(block, lambda verdict: None)  # a copy of a parked block
    inbox.put_invalid("req-1", 5, "too late anyway")
    clock[0] += inbox_module.PARKED_TTL_S
    assert inbox.num_held == 0 and inbox.stats.stale == 1


def test_a_reused_request_id_gets_its_blocks():
    """A new request may reuse a finished one's id, and its first block may reach the target
    before the round that opens it: opening adopts the parked block, and its round takes it."""
    inbox = BlockInbox()
    block = check_block(_honest_block("fp32")[0], VOCAB)
    assert inbox.take([("req-1", block.step)], time.monotonic()) == {}
    inbox.forget("req-1")  # the first request with this id ended
    assert inbox.put(block, lambda verdict: None)  # the new one's block, before its round
    inbox.open(["req-1"])
    assert inbox.take([("req-1", block.step)], time.monotonic())[("req-1", block.step)] is block
    assert inbox.reply_to(("req-1", block.step)) is not None


def test_inbox_take_waits_until_the_deadline_then_returns_what_arrived():
    inbox = BlockInbox()
    started = time.monotonic()
    assert inbox.take([("missing", 1)], started + 0.2) == {}
    assert time.monotonic() - started >= 0.2
