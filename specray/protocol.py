"""The round protocol: every message that crosses a process boundary each round, typed.

Glossary (one round of one micro-batch, docs/design.md section "The round"):

* **request spec** — what a worker needs to hold a request: prompt, validated
  :class:`SamplingParams`, seed, and the output committed so far (non-empty after a resume).
  Sent on a worker's first contact with a request, never again.
* **verify item** — the coordinator's instruction to the target for one request: its step,
  how many tokens the caller holds as committed (a consistency check), whether a draft block
  is coming, and for chunked prefill how much of the context to cache.
* **verify result** — what the target committed for that request, how many drafted tokens it
  saw and accepted, its finish reason, and why a block it expected was dropped.
* **round report** — the results of one round plus its timing (the cost model's input).
* **draft item** — the coordinator's instruction to a draft worker: the block length ``k``
  for the step, and the committed tokens the worker has not seen yet.
* **propose / prefill report** — what a draft worker did in a call (bytes sent to the
  target, drafting seconds, steps), the cost model's input on the draft side.

Validation happens once, at the trust boundaries (the public APIs build ``SamplingParams``;
the target checks every draft block, :mod:`specray.rpc.messages`). Inside, workers trust
these messages. :func:`encode` / :func:`decode` are their one wire form: msgpack with a
version field and explicit limits, never pickle.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from typing import Any

import msgpack

from specray.sampling.logprobs import TokenLogprob
from specray.sampling.params import SamplingParams

PROTOCOL_VERSION = 6  # 2: logprobs in VerifyResult and Delta; 3: VerifyResult.error, and
# RoundReport.num_tokens / kv_cache_usage; 4: VerifyItem.scheduled_ahead, VerifyResult.ended;
# 5: RoundReport.shared_tokens; 6: RoundReport.fused_prefill_tokens
# Explicit msgpack limits on a decoded message (docs/design.md section 6): a message over them is
# refused whole. Strings are request ids (at most 128 characters), enum values and finish reasons.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_STR_CHARS = 1024
MAX_ARRAY_LEN = 1 << 22  # token ids of one prompt, items of one round
MAX_MAP_LEN = 1 << 16  # logit_bias entries, fields


class DropReason(enum.Enum):
    """Why a round ran target-only for a request whose draft block was expected."""

    INVALID = "invalid"  # the block failed validation at the target
    STALE = "stale"  # drafted from other committed tokens than the target holds
    DEADLINE = "deadline"  # no block arrived before the draft deadline


@dataclass(frozen=True)
class Dropped:
    reason: DropReason
    detail: str = ""  # a human-readable why (the validation error), for logs

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # validated at the public edge; never re-validated inside
    seed: int
    output_token_ids: tuple[int, ...] = ()  # committed output (a resumed request)


@dataclass(frozen=True)
class VerifyItem:
    request_id: str
    step: int  # the request's round counter: blocks and verdicts are keyed (request_id, step)
    num_committed: int  # output tokens the caller holds; the target must hold as many
    expect_draft: bool  # a draft worker streams a block for (request_id, step)
    spec: RequestSpec | None = None  # on the target's first contact (or to replay)
    prefill_until: int | None = None  # chunked prefill: cache at most this many context tokens
    # Issued before the verdict of the request's previous round (async scheduling): if that
    # round ended the request, the target skips it (VerifyResult.ended) instead of failing.
    scheduled_ahead: bool = False


@dataclass(frozen=True)
class VerifyRound:
    items: tuple[VerifyItem, ...]
    draft_deadline_s: float  # the target waits this long for expected blocks, then goes alone


@dataclass(frozen=True)
class VerifyResult:
    request_id: str
    token_ids: tuple[int, ...]  # committed this round (empty while prefilling)
    num_draft_tokens: int = 0  # drafted tokens verified
    num_accepted: int = 0  # of them accepted
    finish_reason: str | None = None  # "stop" / "length" / "error" once the request ended
    dropped: Dropped | None = None  # the expected block was not used
    prefilling: bool = False  # only a chunk of the context was cached: nothing verified
    logprobs: tuple[TokenLogprob, ...] = ()  # one per committed token (params.logprobs)
    # params.prompt_logprobs: entries cached this round, the first for prompt position
    # prompt_logprobs_from + 1 (entries are kept by position: a replayed chunk repeats some)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs_from: int = 0
    error: str | None = None  # finish_reason "error": why the request cannot go on
    # A scheduled-ahead item whose request the previous round ended: nothing ran for it.
    ended: bool = False

    @staticmethod
    def chunk(
        request_id: str, prompt_logprobs: tuple[TokenLogprob, ...] = (), start: int = 0
    ) -> VerifyResult:
        """The result of a request that only prefilled part of its context this round."""
        return VerifyResult(
            request_id,
            (),
            prefilling=True,
            prompt_logprobs=prompt_logprobs,
            prompt_logprobs_from=start,
        )


@dataclass(frozen=True)
class RoundReport:
    results: tuple[VerifyResult, ...]  # one per item, in order
    wait_s: float  # waited for draft blocks (the pipeline bubble)
    compute_s: float  # prefill, forward and verification: busy is busy
    prefill_s: float = 0.0  # of requests new to the target (part of compute_s)
    # Context tokens cached by the verification forward itself (requests new to the target,
    # prefilled in the round's one forward): that forward's time is not a verification cost.
    fused_prefill_tokens: int = 0
    forward_s: float = 0.0  # the verification forward alone
    service_s: float = 0.0  # inside the call
    num_tokens: int = 0  # tokens the round's forwards ran: prompts prefilled and verification
    shared_tokens: int = 0  # of num_tokens, copied from a row fed the same (models/shared_rows)
    kv_cache_usage: float = 0.0  # after the round: the share of the target's KV slots in use


@dataclass(frozen=True)
class DraftItem:
    request_id: str
    step: int
    k: int  # tokens to draft for this step (0: a prefill, take the request on)
    num_committed: int  # output tokens committed; the worker must hold as many after the call
    new_token_ids: tuple[int, ...]  # committed tokens the worker has not seen yet
    spec: RequestSpec | None = None  # on the worker's first contact (output then in new_token_ids)
    ahead: bool = True  # may draft past the block before its verdict (policy: likely kept)


@dataclass(frozen=True)
class ProposeCall:
    items: tuple[DraftItem, ...]
    draft_ahead: bool  # keep drafting past the blocks while nothing else waits


@dataclass(frozen=True)
class ProposeReport:
    num_requests: int
    bytes: int  # sent to the target
    draft_s: float  # drafting compute (idle waits excluded)
    steps: int  # draft forwards
    reused_tokens: int = 0  # drafts made ahead that this call kept
    ahead_tokens: int = 0  # drafted ahead in this call


@dataclass(frozen=True)
class PrefillReport:
    num_requests: int
    draft_s: float


@dataclass(frozen=True)
class DraftCommand:
    """The engine core's one message to a draft worker in a round (beside the verdicts it
    travels with): what to free, take on and draft, in that order."""

    seq: int  # the reply names it
    release: tuple[str, ...] = ()  # requests to free (no reply)
    prefill: tuple[DraftItem, ...] = ()  # requests to take on (k unused)
    propose: ProposeCall | None = None


@dataclass(frozen=True)
class DraftReply:
    """A draft worker's report on one command, sent with its next blocks (or alone when idle)."""

    seq: int
    prefill: PrefillReport | None = None
    propose: ProposeReport | None = None
    error: str | None = None  # the command failed: the engine core counts the worker failed


# ---- front ends <-> the engine core -------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    request_id: str  # chosen by the front end, unique among its requests in flight
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    timeout_s: float | None = None
    num_speculative_tokens: int | None = None  # this request's largest k (None: the group's)
    fixed_k: bool = False  # speculation "on": that k every round, whatever the policy says
    committed_token_ids: tuple[int, ...] = ()  # already delivered (a resumed request)
    # False: the caller waits for the whole output, so the session sends the request's first
    # tokens (they also say it was admitted), then its progress at most every
    # sessions.PROGRESS_INTERVAL_S (what a resume starts from), then its end.
    stream: bool = True


@dataclass(frozen=True)
class FrontendBatch:
    """Everything a front end asks of the engine core since its last message."""

    submits: tuple[Submit, ...] = ()
    aborts: tuple[str, ...] = ()
    finishes: tuple[str, ...] = ()  # end these now as finished (a stop string matched there)


@dataclass(frozen=True)
class ErrorInfo:
    """A :class:`specray.errors.SpecrayError` as plain values (``errors.error_to_dict``)."""

    type: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Finished:
    """The end of a request: what its output needs beyond the tokens (text is decoded by
    the front end, off the engine core's loop)."""

    finish_reason: str
    seed: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    num_target_steps: int
    time_to_first_token_s: float
    latency_s: float
    chunk_gaps_s: tuple[float, ...]


@dataclass(frozen=True)
class Delta:
    request_id: str
    token_ids: tuple[int, ...]  # committed since the last delta
    finished: Finished | None = None
    error: ErrorInfo | None = None  # the request failed (admission or later): it is over
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids (params.logprobs)
    # with a request's first tokens (params.prompt_logprobs): prompt positions 1 .. P - 1
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class DeltaBatch:
    """One message per round to each front end: every request's new tokens."""

    deltas: tuple[Delta, ...]


# ---- the wire form -----------------------------------------------------------------------
Message = (
    RequestSpec
    | VerifyItem
    | VerifyRound
    | VerifyResult
    | RoundReport
    | DraftItem
    | ProposeCall
    | ProposeReport
    | PrefillReport
    | DraftCommand
    | DraftReply
    | Submit
    | FrontendBatch
    | Delta
    | DeltaBatch
)
_MESSAGES = typing.get_args(Message)
_TAGS = {cls: index for index, cls in enumerate(_MESSAGES)}


class ProtocolError(ValueError):
    """Bytes that are not a message of this protocol version (or exceed its limits)."""


def encode(message: Message) -> bytes:
    """``[version, type tag, fields...]`` as msgpack."""
    return msgpack.packb(
        [PROTOCOL_VERSION, _TAGS[type(message)], *_encoder(type(message))(message)]
    )


def decode(data: bytes, expected: type[Message]) -> Message:
    """The message in ``data``; ProtocolError for another version or type, or limits exceeded."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        values = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,  # logit_bias keys are ints
            max_str_len=MAX_STR_CHARS,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise ProtocolError(f"undecodable message: {error}") from None
    if not isinstance(values, list) or len(values) < 2:
        raise ProtocolError("a message is [version, type, fields...]")
    version, tag, *body = values
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    if tag != _TAGS[expected]:
        raise ProtocolError(f"expected a {expected.__name__}, got type tag {tag!r}")
    try:
        return _decoder(expected)(body)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise ProtocolError(f"malformed {expected.__name__}: {error}") from None


# Converters are compiled once per message class from its type hints (a round's messages are
# encoded and decoded on the per-round path): None means "as is".
Convert = Callable[[Any], Any] | None


@cache
def _hints(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in fields(cls)]


@cache
def _encoder(cls: type) -> Callable[[Any], list]:
    plan = [(name, _to_plain(hint)) for name, hint in _hints(cls)]

    def encode_fields(message) -> list:
        return [
            getattr(message, name) if convert is None else convert(getattr(message, name))
            for name, convert in plan
        ]

    return encode_fields


def _to_plain(hint: Any) -> Convert:
    """Tuples, ints, floats, strings and None go to msgpack as they are."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        inner = _to_plain(_optional(hint))
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple:
        inner = _to_plain(typing.get_args(hint)[0])
        return None if inner is None else (lambda v: [inner(entry) for entry in v])
    if hint is SamplingParams:
        return _params_to_plain
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: v.value
    if is_dataclass(hint):
        return _encoder(hint)
    return None


@cache
def _decoder(cls: type) -> Callable[[list], Any]:
    plan = [_from_plain(hint) for _, hint in _hints(cls)]

    def build(body: list):
        if len(body) != len(plan):
            raise ValueError(f"{cls.__name__} has {len(plan)} fields, got {len(body)}")
        return cls(*[convert(value) for convert, value in zip(plan, body, strict=True)])

    return build


def _from_plain(hint: Any) -> Convert:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        inner = _from_plain(_optional(hint)) or _identity
        return lambda v: None if v is None else inner(v)
    if origin is tuple:
        entry_hint = typing.get_args(hint)[0]
        if entry_hint in _SCALARS:  # token ids, request ids: as many as a round holds
            return tuple
        inner = _from_plain(entry_hint)
        return lambda v: tuple([inner(entry) for entry in v])
    if hint is SamplingParams:
        return SamplingParams.trusted
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    if is_dataclass(hint):
        return _decoder(hint)
    if hint is float:
        return _float
    return _SCALARS[hint]


def _optional(hint: Any) -> Any:
    (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return inner


def _identity(value: Any) -> Any:
    return value


def _float(value: Any) -> float:
    if type(value) not in (float, int):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _scalar(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return check


_SCALARS = {kind: _scalar(kind) for kind in (int, str, bool)}


def _params_to_plain(params: SamplingParams) -> dict:
    plain = {name: getattr(params, name) for name in SAMPLING_FIELDS}
    plain["logit_bias"] = dict(params.logit_bias)
    return plain


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
