"""The public gRPC API (``specray.v1.Generation`` and the health service) fuzzed over loopback
against ``start_grpc_server`` on a real :class:`LocalBackend`: random and truncated bytes as the
request message of every method (a generic channel with identity serializers), and valid
messages with boundary values in every field.

Every call ends with a proper status (never UNKNOWN or INTERNAL), details without a traceback
or path; a successful Generate stream is well formed (deltas, then exactly one Final that adds
them up) and honours the request (length, allowed / banned tokens); the server keeps serving.

The bug this found (sampling values giving NaN rows, so tokens outside allowed_token_ids) is
fixed; the regression test at the bottom pins it.
"""

from __future__ import annotations

import math
import re

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import event, given
from hypothesis import strategies as st

from specray.v1 import generation_pb2 as pb
from tests.fuzz.budget import fuzz_settings

VOCAB = 49_152  # the tiny chat pair's vocabulary
CALL_TIMEOUT_S = 30.0
LEAK_MARKERS = ("Traceback", '.py"', "/work/", "site-packages")
# Statuses a call may end with; UNKNOWN and INTERNAL mean an unhandled server error.
PROPER = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # only when the client set a short deadline
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
GENERATE = "/specray.v1.Generation/Generate"
UNARY_METHODS = (
    "/specray.v1.Generation/GetModelInfo",
    "/specray.v1.Generation/Abort",
    "/grpc.health.v1.Health/Check",
)


def _call(grpc_channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """One call with raw bytes; returns (status, details, raw responses)."""
    try:
        if method == GENERATE:
            responses = list(grpc_channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S))
        else:
            responses = [grpc_channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S)]
    except grpc.RpcError as error:
        return error.code(), error.details() or "", []
    return grpc.StatusCode.OK, "", responses


def _count(tally, code: grpc.StatusCode) -> None:
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        tally.server_error()


def _assert_proper(code: grpc.StatusCode, details: str, context) -> None:
    assert code in PROPER, (code, details, context)
    for marker in LEAK_MARKERS:
        assert marker not in details, (details, context)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details, context


# ---- random bytes as any method's request --------------------------------------------------
def _parses_as(method: str, payload: bytes) -> bool:
    message_type = {
        GENERATE: pb.GenerateRequest,
        "/specray.v1.Generation/GetModelInfo": pb.GetModelInfoRequest,
        "/specray.v1.Generation/Abort": pb.AbortRequest,
        "/grpc.health.v1.Health/Check": health_pb2.HealthCheckRequest,
    }[method]
    try:
        message_type.FromString(payload)
    except DecodeError:
        return False
    return True


def _valid_request_bytes() -> st.SearchStrategy:
    return generate_requests().map(lambda m: m.SerializeToString())


@fuzz_settings(60)
@given(
    method=st.sampled_from([GENERATE, *UNARY_METHODS]),
    payload=st.one_of(
        st.binary(max_size=200),
        st.deferred(_valid_request_bytes).flatmap(
            lambda wire: st.integers(0, len(wire)).map(lambda cut: wire[:cut])
        ),  # truncated valid requests
    ),
)
def test_random_bytes_as_any_request(grpc_channel, tally, serving_after, method, payload):
    tally.case()
    code, details, _ = _call(grpc_channel, method, payload)
    _count(tally, code)
    event(f"{method.rsplit('/', 1)[1]}: {code.name}")
    if not _parses_as(method, payload):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, method, payload)
    if method == "/grpc.health.v1.Health/Check" and code == grpc.StatusCode.NOT_FOUND:
        return  # a service name the server does not have: the health protocol's answer
    _assert_proper(code, details, (method, payload))


# ---- valid messages, boundary values -------------------------------------------------------
boundary_doubles = st.one_of(
    st.sampled_from(
        [0.0, -0.0, 1.0, 1e-5, 9.9e-6, 5e-324, 1e-39, 1e39, 1e300, -1.0, 2.0000001,
         math.nan, math.inf, -math.inf]
    ),
    st.floats(),
)  # fmt: skip
int32s = st.one_of(st.integers(-2, 70), st.sampled_from([-(2**31), 2**31 - 1]))
valid_ids = st.integers(0, 300)
boundary_ids = st.one_of(
    st.integers(VOCAB - 2, VOCAB + 1), st.sampled_from([-1, -(2**31), 2**31 - 1])
)
roles = st.sampled_from(["system", "user", "assistant"])
SAMPLING_DOUBLES = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
}
CORRUPTIBLE = (
    "text", "token_ids", "messages", "no prompt", "double", "top_k", "logit_bias",
    "allowed_token_ids", "banned_token_ids", "stop_token_ids", "max_tokens", "seed", "stop",
    "num_speculative_tokens", "request_id", "logprobs", "structured_outputs",
)  # fmt: skip
GRAMMARS = [("regex", "[ab]{1,3}"), ("choice", '["yes", "no"]'), ("json", '{"type": "boolean"}')]
BAD_GRAMMARS = [
    ("", ""), ("yaml", "a: 1"), ("regex", ""), ("regex", "[ab"), ("regex", "(a)\\1"),
    ("choice", "[]"), ("choice", "yes"), ("json", "{"), ("json", '{"type": "nope"}'),
    ("json", "false"), ("grammar", "root ::= missing"), ("json_object", "x" * 70_000),
]  # fmt: skip


def corrupt(message: pb.GenerateRequest, field: str, draw) -> None:
    """Set ``field`` of ``message`` to a boundary (often invalid) value."""
    any_id = valid_ids | boundary_ids
    if field == "text":
        message.text = draw(st.sampled_from(["", "\x00", "\U0001f600" * 3]) | st.text())
    elif field == "token_ids":
        message.token_ids.ids[:] = draw(st.lists(any_id, max_size=4))
        message.token_ids.SetInParent()  # set even when empty
    elif field == "messages":
        message.messages.SetInParent()
        if draw(st.booleans()):  # else: an empty conversation
            role = draw(roles | st.text(max_size=8))
            message.messages.messages.add(role=role, content=draw(st.text(max_size=8)))
    elif field == "no prompt" and message.WhichOneof("prompt"):
        message.ClearField(message.WhichOneof("prompt"))
    elif field == "double":
        setattr(message, draw(st.sampled_from(sorted(SAMPLING_DOUBLES))), draw(boundary_doubles))
    elif field == "top_k":
        message.top_k = draw(int32s)
    elif field == "logit_bias":
        values = boundary_doubles | st.floats(-100, 100)
        message.logit_bias.update(draw(st.dictionaries(any_id, values, min_size=1, max_size=3)))
    elif field == "allowed_token_ids":
        message.allowed_token_ids.ids[:] = draw(st.lists(any_id, max_size=3))
        message.allowed_token_ids.SetInParent()
    elif field in ("banned_token_ids", "stop_token_ids"):
        getattr(message, field).extend(draw(st.lists(boundary_ids, min_size=1, max_size=3)))
    elif field == "max_tokens":
        message.max_tokens = draw(int32s)
    elif field == "seed":
        message.seed = draw(st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
    elif field == "stop":
        message.stop.extend(draw(st.sampled_from([["s"] * 17, [""], ["\U0001f600"]])))
    elif field == "num_speculative_tokens":
        message.num_speculative_tokens = draw(st.sampled_from([0, 33, 2**32 - 1]))
    elif field == "request_id":
        message.request_id = draw(st.sampled_from(["r" * 10_000, "\x00", " "]))
    elif field == "structured_outputs":
        kind, spec = draw(st.sampled_from(BAD_GRAMMARS) | st.tuples(st.text(max_size=8), st.text()))
        message.structured_outputs.kind, message.structured_outputs.spec = kind, spec
    elif field == "logprobs":
        name = draw(st.sampled_from(["logprobs", "prompt_logprobs"]))
        setattr(message, name, draw(st.sampled_from([21, 2**32 - 1])))
        message.logprobs_mode = draw(st.sampled_from(["raw", "processed_logprobs", "bogus", ""]))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A valid request (random prompt kind, a few sampling fields, a short length), then zero to
    two fields set to boundary values."""
    message = pb.GenerateRequest(max_tokens=draw(st.integers(1, 4)))
    prompt = draw(st.sampled_from(["text", "token_ids", "messages"]))
    if prompt == "text":
        message.text = draw(st.text(min_size=1, max_size=16))
    elif prompt == "token_ids":
        message.token_ids.ids[:] = draw(st.lists(valid_ids, min_size=1, max_size=6))
    else:
        for _ in range(draw(st.integers(1, 3))):
            message.messages.messages.add(role=draw(roles), content=draw(st.text(max_size=16)))
    for name, valid in SAMPLING_DOUBLES.items():
        if draw(st.integers(0, 3)) == 0:
            setattr(message, name, draw(valid))
    if draw(st.integers(0, 3)) == 0:
        message.top_k = draw(st.integers(0, 50))
    if draw(st.integers(0, 3)) == 0:
        message.allowed_token_ids.ids[:] = draw(st.lists(valid_ids, min_size=1, max_size=4))
    if draw(st.integers(0, 3)) == 0:
        message.banned_token_ids[:] = draw(st.lists(valid_ids, max_size=4))
    if draw(st.integers(0, 3)) == 0:
        message.stop[:] = draw(st.lists(st.text(min_size=1, max_size=4), max_size=3))
    message.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        message.seed = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        message.num_speculative_tokens = draw(st.integers(0, 8))
    if draw(st.integers(0, 2)) == 0:
        message.logprobs = draw(st.integers(0, 20))
        message.logprobs_mode = draw(st.sampled_from(["", "raw", "processed"]))
    if draw(st.integers(0, 3)) == 0:
        message.prompt_logprobs = draw(st.integers(0, 20))
    if draw(st.integers(0, 3)) == 0:
        kind, spec = draw(st.sampled_from(GRAMMARS))
        message.structured_outputs.kind, message.structured_outputs.spec = kind, spec
    for field in draw(st.lists(st.sampled_from(CORRUPTIBLE), max_size=2, unique=True)):
        corrupt(message, field, draw)
    return message


def _assert_well_formed_stream(message: pb.GenerateRequest, raw: list[bytes]) -> None:
    responses = [pb.GenerateResponse.FromString(r) for r in raw]
    assert responses and responses[-1].WhichOneof("event") == "final", responses
    assert all(r.WhichOneof("event") == "delta" for r in responses[:-1]), responses
    final = responses[-1].final
    streamed = [t for r in responses[:-1] for t in r.delta.token_ids]
    assert list(final.token_ids) == streamed, (final, streamed)
    assert final.text.startswith("".join(r.delta.text for r in responses[:-1]))
    assert final.finish_reason in ("stop", "length")
    assert final.completion_tokens == len(final.token_ids)
    if message.HasField("max_tokens"):
        assert len(final.token_ids) <= message.max_tokens
    if message.request_id:
        assert final.request_id == message.request_id
    if message.HasField("allowed_token_ids"):
        assert set(final.token_ids) <= set(message.allowed_token_ids.ids), final
    assert not set(final.token_ids) & set(message.banned_token_ids), final
    if message.HasField("logprobs"):  # one per token, on each delta and on the final
        for part in [*(r.delta for r in responses[:-1]), final]:
            assert [e.token_id for e in part.logprobs] == list(part.token_ids), part
            assert all(len(e.top_token_ids) == message.logprobs for e in part.logprobs), part
    else:
        assert not final.logprobs, final
    if message.HasField("prompt_logprobs"):  # every prompt token's but the first
        assert len(final.prompt_logprobs) == final.prompt_tokens - 1, final


@fuzz_settings(80)
@given(message=generate_requests())
def test_boundary_values_in_valid_messages(grpc_channel, tally, serving_after, message):
    tally.case()
    code, details, raw = _call(grpc_channel, GENERATE, message.SerializeToString())
    _count(tally, code)
    event(f"Generate: {code.name} {re.sub(r'-?[0-9][0-9.e+-]*', 'N', details)[:40]}")
    _assert_proper(code, details, message)
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "no deadline this short was set"
    if code == grpc.StatusCode.OK:
        _assert_well_formed_stream(message, raw)


BOUNDARY_MESSAGES = {
    "huge max_tokens": pb.GenerateRequest(text="hi", max_tokens=2**31 - 1),
    "zero max_tokens": pb.GenerateRequest(text="hi", max_tokens=0),
    "negative max_tokens": pb.GenerateRequest(text="hi", max_tokens=-5),
    "negative top_k": pb.GenerateRequest(text="hi", max_tokens=2, top_k=-7),
    "NaN temperature": pb.GenerateRequest(text="hi", max_tokens=2, temperature=math.nan),
    "inf top_p": pb.GenerateRequest(text="hi", max_tokens=2, top_p=math.inf),
    "empty text": pb.GenerateRequest(text="", max_tokens=2),
    "empty token ids": pb.GenerateRequest(token_ids=pb.TokenIds(), max_tokens=2),
    "negative token id": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, -1]), max_tokens=2),
    "token id = vocab": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB]), max_tokens=2),
    "no prompt": pb.GenerateRequest(max_tokens=2),
    "empty chat": pb.GenerateRequest(messages=pb.ChatMessages(), max_tokens=2),
    "unknown role": pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")]),
        max_tokens=2,
    ),
    "17 stop strings": pb.GenerateRequest(text="hi", max_tokens=2, stop=["s"] * 17),
    "10k stop strings": pb.GenerateRequest(text="hi", max_tokens=2, stop=["s"] * 10_000),
    "empty stop string": pb.GenerateRequest(text="hi", max_tokens=2, stop=[""]),
    "huge stop token list": pb.GenerateRequest(
        text="hi", max_tokens=2, stop_token_ids=list(range(100_000))
    ),
    "seed above int64": pb.GenerateRequest(text="hi", max_tokens=2, seed=2**64 - 1),
    "negative bias key": pb.GenerateRequest(text="hi", max_tokens=2, logit_bias={-3: 1.0}),
    "NaN bias": pb.GenerateRequest(text="hi", max_tokens=2, logit_bias={3: math.nan}),
    "empty allowed set": pb.GenerateRequest(
        text="hi", max_tokens=2, allowed_token_ids=pb.TokenIds()
    ),
    "k above the cap": pb.GenerateRequest(
        text="hi", max_tokens=2, num_speculative_tokens=2**32 - 1
    ),
    "huge request id": pb.GenerateRequest(text="hi", max_tokens=2, request_id="r" * 100_000),
    "129-character request id": pb.GenerateRequest(text="hi", max_tokens=2, request_id="r" * 129),
    "128-character request id": pb.GenerateRequest(text="hi", max_tokens=2, request_id="r" * 128),
}
BOUNDARY_OK = {"k above the cap", "128-character request id"}


def test_named_boundary_messages(grpc_channel, tally, serving_after):
    """The request has no model field: an unknown model cannot be named over gRPC."""
    for name, message in BOUNDARY_MESSAGES.items():
        tally.case()
        code, details, raw = _call(grpc_channel, GENERATE, message.SerializeToString())
        _count(tally, code)
        _assert_proper(code, details, name)
        if name in BOUNDARY_OK:
            assert code == grpc.StatusCode.OK, (name, details)
            _assert_well_formed_stream(message, raw)
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)


def test_a_short_deadline_is_deadline_exceeded(grpc_channel):
    request = pb.GenerateRequest(text="hi", max_tokens=60, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as raised:
        list(grpc_channel.unary_stream(GENERATE)(request.SerializeToString(), timeout=0.001))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


# ---- still serving ---------------------------------------------------------------------------
@pytest.fixture
def serving_after(served, grpc_channel):
    yield
    _assert_serving(grpc_channel)


def _assert_serving(grpc_channel) -> None:
    check = grpc_channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    assert check(health_pb2.HealthCheckRequest(), timeout=10).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    info = grpc_channel.unary_unary("/specray.v1.Generation/GetModelInfo")(b"", timeout=10)
    assert pb.ModelInfo.FromString(info).vocab_size == VOCAB
    request = pb.GenerateRequest(text="Hello there", max_tokens=3)
    code, details, raw = _call(grpc_channel, GENERATE, request.SerializeToString())
    assert code == grpc.StatusCode.OK, details
    _assert_well_formed_stream(request, raw)


@pytest.mark.parametrize("method", [GENERATE, *UNARY_METHODS])
def test_undecodable_request_is_invalid_argument(grpc_channel, method):
    code, details, _ = _call(grpc_channel, method, b"\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "DecodeError" not in details and method in details, details


# ---- fixed bugs: regression tests ----------------------------------------------------------
@pytest.mark.parametrize(
    "sampling",
    [{"top_p": 5e-324}, {"temperature": 1e39}, {"repetition_penalty": 1e-39}],
    ids=["subnormal-top_p", "huge-temperature", "tiny-repetition_penalty"],
)
def test_nan_prone_values_keep_allowed_token_ids(grpc_channel, sampling):
    """End to end: the output leaves the allowed set (or the request should be refused)."""
    allowed = [28, 1048]  # both in the prompt, so the repetition penalty applies
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=allowed), max_tokens=3, ignore_eos=True,
        allowed_token_ids=pb.TokenIds(ids=allowed), **sampling,
    )  # fmt: skip
    code, details, raw = _call(grpc_channel, GENERATE, request.SerializeToString())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return  # the fix may refuse these values
    assert code == grpc.StatusCode.OK, details
    final = pb.GenerateResponse.FromString(raw[-1]).final
    assert set(final.token_ids) <= set(allowed), list(final.token_ids)
