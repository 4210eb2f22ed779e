"""Property tests of the internal draft <-> target data plane (``specray.rpc``,
``specray.sampling.encoding``): every q encoding round-trips bit-exactly through the wire, and
any other message (random bytes, truncated, oversized, wrong dtype, boundary field values) is
either refused with :class:`InvalidMessageError` or decodes to a valid block; never another
exception, never an allocation sized by a declared shape instead of the bytes received.

The bugs this found (negative dims, values dtype unchecked, one bad block ending the stream)
are fixed; the regression tests at the bottom pin them.
"""

from __future__ import annotations

import re
import time

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st

from specray.engine_core.draft_streams import StreamDraftPool
from specray.rpc.inbox import BlockInbox
from specray.rpc.messages import (
    MAX_MESSAGE_BYTES,
    ROW_SUM_TOLERANCE,
    CheckedBlock,
    InvalidMessageError,
    block_to_pb,
    check_block,
    grpc_options,
)
from specray.rpc.server import VerifierServicer, start_server
from specray.sampling import (
    MAX_SPEC_LEN,
    DraftProbsEncoding,
    WireTensor,
    decode_draft_probs,
    encode_draft_probs,
    quantize_draft_probs,
    stack_rows,
)
from specray.sampling.encoding import SparseDraftProbs
from specray.v1 import speculation_pb2 as pb
from tests.fuzz.budget import fuzz_settings

VOCAB = 24  # the receiving target's vocabulary in the fuzz of inbound messages
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}  # wire dtype -> item bytes
ENCODING_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
REJECT_WITHIN_S = 2.0  # a refusal that takes longer suggests work sized by a declared shape
INT64 = (-(2**63), 2**63 - 1)


# ---- round trips ---------------------------------------------------------------------------
@st.composite
def wire_tensors(draw) -> WireTensor:
    """Any bit pattern (NaN payloads, subnormals, -0) of any dtype and a small shape (1-D at
    least: the protocol never sends a scalar, and from_tensor cannot view one as bytes)."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    count = 1
    for size in shape:
        count *= size
    data = draw(st.binary(min_size=count * DTYPES[dtype], max_size=count * DTYPES[dtype]))
    return WireTensor(data, dtype, shape)


@fuzz_settings(200)
@given(tensor=wire_tensors())
def test_wire_tensor_round_trips_bit_exactly(tally, tensor):
    tally.case()
    decoded = tensor.to_tensor()
    assert tuple(decoded.shape) == tensor.shape
    assert WireTensor.from_tensor(decoded) == tensor
    message = pb.Tensor(data=tensor.data, dtype=tensor.dtype, shape=list(tensor.shape))
    again = pb.Tensor.FromString(message.SerializeToString())
    assert WireTensor(again.data, again.dtype, tuple(again.shape)) == tensor
    if len(tensor.shape) == 2 and tensor.shape[0] > 0:
        for index in range(tensor.shape[0]):
            assert WireTensor.from_tensor(decoded[index : index + 1]) == tensor.row(index)


encodings = st.one_of(
    st.sampled_from(["fp32", "fp16", "bf16"]), st.integers(1, 70).map(lambda m: f"top{m}")
)


@st.composite
def draft_rows(draw) -> tuple[torch.Tensor, str]:
    """Random q rows ``[k, vocab]`` (flat to near one-hot) and an encoding."""
    vocab = draw(st.integers(2, 64))
    k = draw(st.integers(1, MAX_SPEC_LEN))
    scale = draw(st.sampled_from([0.0, 0.1, 1.0, 4.0, 30.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return torch.softmax(logits, dim=-1), draw(encodings)


@fuzz_settings(200)
@given(case=draft_rows(), step=st.integers(0, 2**64 - 1), committed=st.integers(0, 2**32 - 1))
def test_every_q_encoding_round_trips_through_the_wire(tally, case, step, committed):
    tally.case()
    draft_probs, name = case  # [k, vocab]
    k, vocab = draft_probs.shape
    encoding = DraftProbsEncoding.parse(name)
    # The draft encodes each row as it samples it and samples from the decoded row.
    rows = [encode_draft_probs(draft_probs[j : j + 1], encoding) for j in range(k)]
    sampled_from = torch.cat([decode_draft_probs(row) for row in rows])  # [k, vocab]
    if name != "fp32":  # fp32's quantize is the identity; decoding renormalises (ulps apart)
        assert torch.equal(quantize_draft_probs(draft_probs, encoding), sampled_from)
    token_ids = sampled_from.argmax(dim=-1).tolist()
    message = block_to_pb("req", step, committed, token_ids, stack_rows(rows))
    received = pb.DraftBlock.FromString(message.SerializeToString())
    checked = check_block(received, vocab)
    assert torch.equal(_dense(checked.draft_probs), sampled_from), "bit-identical q on both ends"
    assert (checked.request_id, checked.step, checked.num_committed) == ("req", step, committed)
    assert checked.token_ids == token_ids
    _assert_valid_block(checked, vocab)
    if name == "fp32":
        assert torch.allclose(sampled_from, draft_probs, rtol=1e-5, atol=1e-7)
    elif encoding.sparse:
        kept = (sampled_from > 0).sum(dim=-1)
        assert bool((kept <= encoding.top_m).all())
        sent = message.draft_probs
        assert len(sent.values.data) + len(sent.token_ids.data) == 8 * k * min(
            encoding.top_m, vocab
        )
    else:  # fp16 / bf16: a few mantissa bits, renormalised
        assert torch.allclose(sampled_from, draft_probs, rtol=2e-2, atol=1e-4)


# ---- hostile messages ------------------------------------------------------------------------
def _dense(draft_probs) -> torch.Tensor:
    """A checked block's q as ``[k, vocab]`` (a top<M> block arrives sparse: distinct ids in
    range, float32 values)."""
    if not isinstance(draft_probs, SparseDraftProbs):
        return draft_probs
    ids = draft_probs.token_ids  # [k, M]
    assert ids.dtype == torch.int64 and draft_probs.values.shape == ids.shape
    assert bool(((ids >= 0) & (ids < draft_probs.vocab_size)).all())
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    return draft_probs.to_dense()


def _assert_valid_block(block: CheckedBlock, vocab: int) -> None:
    k = len(block.token_ids)
    assert 0 <= k <= MAX_SPEC_LEN and block.request_id
    probs = _dense(block.draft_probs)
    assert probs.shape == (k, vocab) and probs.dtype == torch.float32
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    if k:
        assert bool(((probs.double().sum(-1) - 1).abs() < 1e-5).all())
        assert all(0 <= t < vocab for t in block.token_ids)
        assert bool((probs[torch.arange(k), torch.tensor(block.token_ids)] > 0).all())


def _honest(encoding: str, k: int, seed: int) -> pb.DraftBlock:
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(torch.randn(k, VOCAB, generator=generator) * 2, dim=-1)
    parsed = DraftProbsEncoding.parse(encoding)
    rows = [encode_draft_probs(draft_probs[j : j + 1], parsed) for j in range(k)]
    token_ids = torch.cat([decode_draft_probs(r) for r in rows]).argmax(-1).tolist()
    return block_to_pb("req", 3, 5, token_ids, stack_rows(rows))


dims = st.one_of(
    st.integers(-3, VOCAB + 3),
    st.sampled_from([MAX_SPEC_LEN + 1, 2**31, 2**32 + 1, 2**62, *INT64, -VOCAB]),
)


@st.composite
def tensor_edits(draw, tensor: pb.Tensor) -> None:
    """Mutate a wire tensor in place: its bytes, dtype or shape."""
    edit = draw(st.sampled_from(["data", "truncate", "extend", "dtype", "shape", "reinterpret"]))
    if edit == "data":
        tensor.data = draw(st.binary(max_size=4 * VOCAB * 3))
    elif edit == "truncate":
        tensor.data = tensor.data[: draw(st.integers(0, max(len(tensor.data) - 1, 0)))]
    elif edit == "extend":
        tensor.data += draw(st.binary(min_size=1, max_size=16))
    elif edit == "dtype":
        tensor.dtype = draw(
            st.one_of(st.sampled_from([*DTYPES, "float64", "uint8", "", "FLOAT32"]), st.text())
        )
    elif edit == "shape":
        tensor.shape[:] = draw(st.lists(dims, max_size=4))
    else:  # the same bytes read as another dtype, the shape adjusted to match
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        old = DTYPES.get(tensor.dtype, 4)
        tensor.dtype = dtype
        if tensor.shape and DTYPES[dtype] != old:
            tensor.shape[-1] = tensor.shape[-1] * old // DTYPES[dtype]


@st.composite
def hostile_blocks(draw) -> pb.DraftBlock:
    """An honest block with one to three fields set to boundary or random values."""
    encoding = draw(st.sampled_from(["fp32", "fp16", "bf16", "top1", "top5", f"top{VOCAB + 9}"]))
    message = _honest(encoding, draw(st.integers(1, 4)), draw(st.integers(0, 1000)))
    probs = message.draft_probs
    for _ in range(draw(st.integers(1, 3))):
        field = draw(
            st.sampled_from(
                ["request_id", "step", "token_ids", "encoding", "vocab_size", "values",
                 "sparse_ids", "drop_probs"]
            )
        )  # fmt: skip
        if field == "request_id":
            message.request_id = draw(st.one_of(st.text(max_size=200), st.just("r" * 129)))
        elif field == "step":
            message.step = draw(st.integers(0, 2**64 - 1))
            message.num_committed = draw(st.integers(0, 2**32 - 1))
        elif field == "token_ids":
            ids = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, VOCAB + 2))
            message.token_ids[:] = draw(st.lists(ids, max_size=MAX_SPEC_LEN + 3))
        elif field == "encoding":
            probs.encoding = draw(
                st.one_of(
                    st.sampled_from(["fp32", "fp16", "bf16", "top0", "top", "top-1", "fp64",
                                     "top" + "9" * 30, "top\u0663", "TOP4", " fp32"]),
                    st.text(max_size=8),
                )
            )  # fmt: skip
        elif field == "vocab_size":
            probs.vocab_size = draw(st.one_of(st.integers(-(2**31), 2**31 - 1), st.just(0)))
        elif field == "values":
            draw(tensor_edits(probs.values))
        elif field == "sparse_ids":
            if draw(st.booleans()):
                ids = draw(st.lists(st.integers(-3, VOCAB + 3), min_size=1, max_size=20))
                probs.token_ids.data = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
                probs.token_ids.dtype = "int32"
                probs.token_ids.shape[:] = [1, len(ids)]
            else:
                draw(tensor_edits(probs.token_ids))
        else:
            message.ClearField("draft_probs")
    return message


def _dtype_matches_encoding(message: pb.DraftBlock) -> bool:
    probs = message.draft_probs
    if probs.encoding in ENCODING_DTYPES:
        return probs.values.dtype == ENCODING_DTYPES[probs.encoding]
    return probs.values.dtype == "float32"  # sparse values; ids are checked as int32


def _check_hostile(message: pb.DraftBlock) -> None:
    """Refused cleanly, or a valid block; fast either way."""
    started = time.monotonic()
    try:
        block = check_block(message, VOCAB)
    except InvalidMessageError as error:
        assert str(error)
        event(f"refused: {re.sub(r'-?[0-9.]+', 'N', str(error))[:48]}")
    else:
        _assert_valid_block(block, VOCAB)
        assert not block.token_ids or _dtype_matches_encoding(message), message
        event("accepted" if block.token_ids else "accepted (empty block)")
    assert time.monotonic() - started < REJECT_WITHIN_S


@fuzz_settings(300)
@given(message=hostile_blocks())
def test_hostile_blocks_are_refused_or_valid(tally, message):
    tally.case()
    _check_hostile(message)
    # Whatever survives serialization is judged the same way on the receiving end.
    _check_hostile(pb.DraftBlock.FromString(message.SerializeToString()))


@fuzz_settings(200)
@given(
    raw=st.one_of(
        st.binary(max_size=600),
        hostile_blocks()
        .map(lambda m: m.SerializeToString())
        .flatmap(
            lambda wire: st.integers(0, len(wire)).map(lambda cut: wire[:cut])
        ),  # truncated serialized blocks
    )
)
def test_random_and_truncated_bytes_are_refused_or_valid(tally, raw):
    tally.case()
    try:
        message = pb.DraftBlock.FromString(raw)
    except DecodeError:
        event("protobuf DecodeError")
        return  # protobuf's own refusal; gRPC turns it into a status before check_block
    _check_hostile(message)


@pytest.mark.parametrize(
    "shape",
    [
        [2**31, 2**31],  # 2**62 elements declared, a few bytes sent
        [MAX_SPEC_LEN, 2**40],
        [1, 2**63 - 1],
        [2**62, 4, 0],  # zero elements, dims whose product overflows int64 first
        [0, 2**63 - 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, VOCAB],
    ],
)
def test_oversized_declared_shapes_are_refused_without_allocating(shape):
    message = _honest("fp32", 1, 0)
    message.draft_probs.values.shape[:] = shape
    started = time.monotonic()
    with pytest.raises(InvalidMessageError):
        check_block(message, VOCAB)
    assert time.monotonic() - started < REJECT_WITHIN_S


def test_message_size_limits_are_explicit_and_fit_an_honest_block():
    """Explicit, finite gRPC limits on both ends, large enough for k = MAX_SPEC_LEN dense fp32
    rows of a 262,144-token vocabulary (the largest in common use)."""
    options = dict(grpc_options())
    assert options["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    assert 0 < MAX_SPEC_LEN * 262_144 * 4 + 4096 <= MAX_MESSAGE_BYTES
    assert ROW_SUM_TOLERANCE < 0.1


# ---- the target's stream, on loopback --------------------------------------------------------
@pytest.fixture(scope="module")
def verifier():
    inbox = BlockInbox()
    server, address = start_server(VerifierServicer(inbox, VOCAB, StreamDraftPool()))
    channel = grpc.insecure_channel(address, options=grpc_options())
    grpc.channel_ready_future(channel).result(timeout=30)
    exchange = channel.stream_stream("/specray.v1.Verifier/Exchange")  # raw bytes both ways
    health = channel.unary_unary(
        "/specray.v1.Verifier/Health",
        request_serializer=pb.HealthRequest.SerializeToString,
        response_deserializer=pb.HealthResponse.FromString,
    )
    yield inbox, exchange, health
    channel.close()
    server.stop(0)


def _exchange(exchange, payloads: list[bytes]) -> grpc.StatusCode:
    """Send raw payloads on one Exchange stream, half-close, drain; the final status."""
    call = exchange(iter(payloads), timeout=10)
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        assert "Traceback" not in (error.details() or "")
        return error.code()
    return grpc.StatusCode.OK


@fuzz_settings(40)
@given(
    payloads=st.lists(
        st.one_of(
            st.binary(max_size=200),
            hostile_blocks().map(lambda m: pb.DraftUp(blocks=[m]).SerializeToString()),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_exchange_stream_survives_hostile_payloads(tally, verifier, payloads):
    """Random and hostile payloads on the target's stream (after a draft worker's first
    message): the stream ends with a status (no hang), and the server keeps answering. A
    payload protobuf cannot parse ends the stream with gRPC's own INTERNAL ("Exception
    deserializing request!"), before check_block sees it; any other stream ends OK, its invalid
    blocks dropped one by one."""
    _, exchange, health = verifier
    tally.case()
    code = _exchange(exchange, [pb.DraftUp(worker_id="fuzz").SerializeToString(), *payloads])
    event(f"stream status {code.name}")
    if any(not _parses(payload) for payload in payloads):
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INTERNAL), code
    else:
        assert code == grpc.StatusCode.OK, code
    assert health(pb.HealthRequest(), timeout=10).status == "SERVING"


def _parses(payload: bytes) -> bool:
    try:
        pb.DraftUp.FromString(payload)
    except DecodeError:
        return False
    return True


# ---- fixed bugs: regression tests ----------------------------------------------------------
def _negative_dims_block() -> pb.DraftBlock:
    message = _honest("fp32", 1, 0)
    message.draft_probs.values.shape[:] = [-1, -VOCAB]  # product VOCAB: the bytes match
    return message


def test_negative_shape_is_refused():
    with pytest.raises(InvalidMessageError):
        check_block(_negative_dims_block(), VOCAB)


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "top4"])
def test_wrong_dtype_is_refused(encoding):
    """q one-hot at token 0 as int32 (4 bytes an item, like float32): was accepted."""
    message = _honest(encoding, 1, 0)
    width = 4 if encoding == "top4" else VOCAB
    one_hot = torch.zeros(1, width, dtype=torch.int32)
    one_hot[0, 0] = 1
    message.draft_probs.values.data = one_hot.numpy().tobytes()
    message.draft_probs.values.dtype = "int32"
    message.draft_probs.values.shape[:] = [1, width]
    if encoding == "top4":
        ids = torch.tensor([[message.token_ids[0], *range(VOCAB)]], dtype=torch.int32)
        ids = torch.unique_consecutive(ids)[:width].reshape(1, width)
        message.draft_probs.token_ids.data = ids.numpy().tobytes()
    else:
        message.token_ids[:] = [0]
    with pytest.raises(InvalidMessageError):
        check_block(message, VOCAB)


def _stream(*blocks: pb.DraftBlock) -> list[bytes]:
    """A draft worker's stream: its first message, then one block a message."""
    hello = pb.DraftUp(worker_id="fuzz").SerializeToString()
    return [hello, *(pb.DraftUp(blocks=[block]).SerializeToString() for block in blocks)]


def test_exchange_keeps_reading_after_a_refused_block(verifier):
    """A refused block is dropped alone: the honest block after it on the stream arrives."""
    inbox, exchange, _ = verifier
    honest = _honest("fp32", 1, 1)
    honest.request_id, honest.step = "after-crash", 1
    _exchange(exchange, _stream(_negative_dims_block(), honest))
    taken = inbox.take([("after-crash", 1)], time.monotonic() + 2)
    assert ("after-crash", 1) in taken


def test_exchange_keeps_reading_after_a_crashing_check(verifier, monkeypatch):
    """Even an unexpected exception in validation drops only its block, not the stream's
    reader thread."""
    import specray.rpc.server as server

    real = server.check_block

    def crash_once(message, vocab_size):
        if message.request_id == "crash":
            raise RuntimeError("a bug in validation")
        return real(message, vocab_size)

    monkeypatch.setattr(server, "check_block", crash_once)
    inbox, exchange, _ = verifier
    crashing = _honest("fp32", 1, 1)
    crashing.request_id, crashing.step = "crash", 1
    honest = _honest("fp32", 1, 1)
    honest.request_id, honest.step = "after-crash-2", 1
    _exchange(exchange, _stream(crashing, honest))
    taken = inbox.take([("after-crash-2", 1)], time.monotonic() + 2)
    assert ("after-crash-2", 1) in taken
