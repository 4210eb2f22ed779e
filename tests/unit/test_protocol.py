"""The round protocol's wire form and the target's round bookkeeping."""

from __future__ import annotations

import doctest

import msgpack
import pytest

from specray import target_rounds
from specray.protocol import (
    MAX_STR_CHARS,
    PROTOCOL_VERSION,
    DraftItem,
    Dropped,
    DropReason,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    ProtocolError,
    RequestSpec,
    RoundReport,
    VerifyItem,
    VerifyResult,
    VerifyRound,
    decode,
    encode,
)
from specray.sampling import SamplingParams
from specray.target_rounds import MISSED, STALE, TargetRounds

PARAMS = SamplingParams(
    temperature=0.7,
    top_k=5,
    top_p=0.9,
    logit_bias={"3": 1.5, 7: -100},
    allowed_token_ids=[9, 3, 7],
    stop_token_ids=[2],
    max_tokens=12,
    seed=2**63 - 1,
)
SPEC = RequestSpec("req-1", (5, 6, 7), PARAMS, seed=11, output_token_ids=(8,))

MESSAGES = [
    SPEC,
    VerifyRound(
        (
            VerifyItem("req-1", 1, 0, expect_draft=False, spec=SPEC, prefill_until=2),
            VerifyItem("req-2", 4, 3, expect_draft=True),
        ),
        draft_deadline_s=5,
    ),
    RoundReport(
        (
            VerifyResult("req-1", (1, 2, 3), 4, 2, "stop", Dropped(DropReason.STALE, "why")),
            VerifyResult.chunk("req-2"),
        ),
        wait_s=0.25,
        compute_s=1.0,
        prefill_s=0.5,
        forward_s=0.25,
        service_s=1.25,
    ),
    ProposeCall(
        (DraftItem("req-1", 2, 4, 1, (8,), spec=SPEC), DraftItem("r", 3, 0, 2, (), ahead=False)),
        draft_ahead=True,
    ),
    ProposeReport(2, 1024, 0.5, 4, reused_tokens=1, ahead_tokens=3),
    PrefillReport(1, 0.25),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_wire(message):
    decoded = decode(encode(message), type(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_sampling_params_cross_without_revalidation_but_whole():
    decoded = decode(encode(SPEC), RequestSpec).params
    assert decoded == PARAMS and hash(decoded) == hash(PARAMS)
    assert dict(decoded.logit_bias) == {3: 1.5, 7: -100.0}
    assert decoded.allowed_token_ids == (3, 7, 9) and decoded.greedy is False
    with pytest.raises(AttributeError):  # still frozen
        decoded.top_k = 1


def test_another_version_or_type_is_refused():
    data = encode(PrefillReport(1, 0.5))
    with pytest.raises(ProtocolError, match="expected a ProposeReport"):
        decode(data, ProposeReport)
    _, tag, *body = msgpack.unpackb(data)
    with pytest.raises(ProtocolError, match="version 99"):
        decode(msgpack.packb([99, tag, *body]), PrefillReport)
    with pytest.raises(ProtocolError, match="fields"):
        decode(msgpack.packb([PROTOCOL_VERSION, tag, 1]), PrefillReport)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgpack.packb({"a": 1}),
        msgpack.packb([PROTOCOL_VERSION]),
        msgpack.packb([PROTOCOL_VERSION, 8, 1, b"binary"]),  # no bin fields in the protocol
        msgpack.packb([PROTOCOL_VERSION, 8, "x" * (MAX_STR_CHARS + 1), 0.5]),
        msgpack.packb([PROTOCOL_VERSION, 8, "one", 0.5]),  # a string where an int belongs
    ],
)
def test_malformed_bytes_are_a_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode(payload, PrefillReport)


def test_prefill_span_examples():
    assert doctest.testmod(target_rounds).failed == 0


def _book() -> TargetRounds:
    return TargetRounds(
        lambda spec: {"committed": len(spec.output_token_ids)}, lambda s: s["committed"]
    )


class _Block:
    def __init__(self, num_committed: int):
        self.num_committed = num_committed


def test_target_rounds_register_check_and_sort():
    book = _book()
    items = (
        VerifyItem("a", 1, 1, True, spec=SPEC),
        VerifyItem("b", 1, 0, True, spec=RequestSpec("b", (1,), PARAMS, 0)),
        VerifyItem("c", 1, 0, True, spec=RequestSpec("c", (1,), PARAMS, 0)),
        VerifyItem("d", 1, 0, False, spec=RequestSpec("d", (1,), PARAMS, 0)),
    )
    states, fresh = book.open(items)
    assert fresh == {"a", "b", "c", "d"} and states[0] == {"committed": 1}
    keys = book.expected(items, prefilling={"c"})
    assert keys == [("a", 1), ("b", 1)]
    invalid = Dropped(DropReason.INVALID, "draft_probs must be finite")
    blocks, dropped = book.sort(keys, {("a", 1): _Block(1)})
    assert list(blocks) == ["a"] and dropped == {"b": MISSED}
    blocks, dropped = book.sort(keys, {("a", 1): _Block(0), ("b", 1): invalid})
    assert blocks == {} and dropped == {"a": STALE, "b": invalid}
    result = book.result(items[0], [4, 5], 3, 1, None, dropped)
    assert result == VerifyResult("a", (4, 5), 3, 1, None, STALE)
    assert book.result(items[3], [4], 0, 0, "length", {}).num_accepted == 0
    with pytest.raises(RuntimeError, match="the caller says 2"):
        book.open((VerifyItem("a", 2, 2, False),))
    with pytest.raises(ValueError, match="no state for request e"):
        book.open((VerifyItem("e", 1, 0, False),))
    book.forget("a")
    assert sorted(book.requests) == ["b", "c", "d"]
