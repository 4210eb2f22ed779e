"""Admission: what the coordinator checks before it takes a request, and how waiting requests
join the micro-batches at their block boundaries.

Checks fail at once, with the parameter named (:class:`~specray.errors.InvalidRequestError`),
so a bad request never reaches a worker; a full queue is refused
(:class:`~specray.errors.OverloadedError`) rather than queued without bound. Joining and
merging only move requests between the coordinator's lists: the caller decides whether a split
into micro-batches pays (:func:`specray.engine_core.block_length.split_pays`).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Container, Sequence

from specray.engine_core.coordinator_config import CoordinatorConfig
from specray.engine_core.policy import prefill_chunks
from specray.engine_core.request import Request, TargetPhase
from specray.errors import InvalidRequestError
from specray.rpc.messages import MAX_REQUEST_ID_CHARS
from specray.sampling import SamplingParams
from specray.sampling.grammar import check_compiles
from specray.sampling.grammar_spec import GrammarError


def check_structured_outputs(params: SamplingParams, grammars: bool = True) -> None:
    """The request's grammar compiles, and (``grammars``) this model has a tokenizer to
    compile it over (a worker's always has: it loads the model's directory)."""
    if not grammars:
        raise InvalidRequestError(
            "structured outputs need the model's tokenizer, and this model has none",
            param="structured_outputs",
        )
    try:
        check_compiles(*params.structured_outputs)
    except GrammarError as error:
        raise InvalidRequestError(str(error), param="structured_outputs") from None


def check_request(
    prompt_token_ids,
    params,
    request_id,
    timeout_s,
    *,
    vocab_size: int,
    max_positions: int | None,
    in_flight: Container[str],
    eos_token_ids: frozenset[int] = frozenset(),
) -> None:
    """Raise InvalidRequestError unless the prompt, params, request id and timeout are
    usable by this model and not a duplicate of a request ``in_flight``."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {params!r}")
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    for token_id in prompt_token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise InvalidRequestError(
                f"prompt token ids must be integers, got {token_id!r}", param="prompt"
            )
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"prompt token id {token_id} is outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )
    try:
        params.check_vocab(vocab_size, eos_token_ids)
    except ValueError as error:
        raise InvalidRequestError(str(error), param=getattr(error, "param", None)) from None
    if params.structured_outputs is not None:
        check_structured_outputs(params)
    if max_positions and len(prompt_token_ids) + params.max_tokens > max_positions:
        raise InvalidRequestError(
            f"max_tokens={params.max_tokens} plus the {len(prompt_token_ids)}-token prompt "
            f"exceeds the model's {max_positions} positions",
            param="max_tokens",
        )
    # Bounded: it is a sequence id in draft blocks and in the TP group's msgpack commands.
    if request_id is not None and (
        not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS
    ):
        raise InvalidRequestError(
            f"request_id must be a string of 1..{MAX_REQUEST_ID_CHARS} characters, got "
            f"{reprlib.repr(request_id)}",
            param="request_id",
        )
    if request_id in in_flight:
        raise InvalidRequestError(
            f"request_id {request_id!r} is already in flight", param="request_id"
        )
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise InvalidRequestError(f"timeout_s must be > 0, got {timeout_s!r}", param="timeout")


def check_submission(
    prompt_token_ids,
    params,
    request_id,
    timeout_s,
    num_speculative_tokens,
    committed_token_ids,
    *,
    vocab_size: int,
    max_positions: int | None,
    in_flight: Container[str],
    eos_token_ids: frozenset[int],
    group_max_k: int,
) -> tuple[list[int], int]:
    """Every check of a submission (:func:`check_request`, :func:`check_committed`,
    :func:`request_max_k`); returns its committed tokens and its largest k."""
    check_request(
        prompt_token_ids,
        params,
        request_id,
        timeout_s,
        vocab_size=vocab_size,
        max_positions=max_positions,
        in_flight=in_flight,
        eos_token_ids=eos_token_ids,
    )
    committed = check_committed(committed_token_ids, params, vocab_size=vocab_size)
    return committed, request_max_k(num_speculative_tokens, group_max_k)


def check_committed(
    token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int
) -> list[int]:
    """The output tokens a resumed request had already committed, checked: in the
    vocabulary and no more than its max_tokens."""
    committed = list(token_ids)
    for token_id in committed:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise InvalidRequestError(f"committed token ids must be integers, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"committed token id {token_id} is outside the vocabulary")
    if len(committed) > params.max_tokens:
        raise InvalidRequestError(
            f"{len(committed)} committed tokens exceed max_tokens={params.max_tokens}"
        )
    return committed


def request_max_k(num_speculative_tokens, group_max_k: int) -> int:
    """A request's largest k: its own cap (0: speculation off for it) below the group's
    (None: the group's)."""
    if num_speculative_tokens is None:
        return group_max_k
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidRequestError(
            f"num_speculative_tokens must be an integer >= 0, got {k!r}",
            param="num_speculative_tokens",
        )
    return min(k, group_max_k)


def queue_full(num_waiting: int, num_running: int, config: CoordinatorConfig) -> bool:
    """No room for one more waiting request. Free slots count: requests submitted between two
    block boundaries wait for the next one even when slots are free, and a burst must not be
    refused for that. E.g. max_queue 4, max_running 8 with 6 running: 6 may wait."""
    free = max(config.max_running - num_running, 0)
    return num_waiting >= config.max_queue + free


def expired(waiting: Sequence[Request], now: float) -> list[Request]:
    """Waiting requests whose deadline has passed at ``now``."""
    return [r for r in waiting if r.deadline_s and r.deadline_s <= now]


def admit(
    waiting: list[Request],
    batches: list[list[Request]],
    index: int,
    *,
    max_running: int,
    split_pays: Callable[[int], bool],
) -> list[Request]:
    """Join waiting requests to micro-batch ``index`` at its block boundary, first come first
    served, and return them (the caller assigns their draft workers). While a split pays
    (``split_pays(running requests)``), keep the micro-batches balanced (one drafts while
    another verifies); while it does not, the first takes everyone: with nothing to overlap,
    one large batch verifies fastest. E.g. two micro-batches, none running, 5 waiting, a split
    paying: micro-batch 0 takes 3 (a half, rounded up), micro-batch 1 the other 2."""
    batch, joined = batches[index], []

    def running() -> int:
        return sum(len(b) for b in batches)

    if not waiting or running() >= max_running:
        return joined
    splitting = split_pays(min(running() + len(waiting), max_running))
    if not splitting and index > 0:
        return joined
    while waiting and running() < max_running:
        total = running() + len(waiting)
        share = math.ceil(total / len(batches)) if splitting else total
        if len(batch) >= share:
            break
        request = waiting.pop(0)
        request.batch_index = index
        batch.append(request)
        joined.append(request)
    return joined


def merge_unless_split_pays(
    batches: list[list[Request]], index: int, *, total: int, split_pays: Callable[[int], bool]
) -> bool:
    """At its block boundary, a later micro-batch hands its requests to the first when a
    split no longer pays for ``total`` running requests (acceptance fell, the batch shrank):
    the target then verifies them in one forward instead of two at almost the same cost each.
    Requests only ever move to the first micro-batch, so this cannot oscillate. True when
    they moved."""
    batch = batches[index]
    if index == 0 or not batch or split_pays(total):
        return False
    batches[0].extend(batch)
    batch.clear()
    return True


def prefill_grants(batch: Sequence[Request], budget: int) -> dict[str, int]:
    """request id -> context tokens the target is to have cached after this round, for
    requests it has not prefilled yet (chunked: :func:`~specray.engine_core.policy.prefill_chunks`,
    ``budget`` tokens a round, 0: no limit). Those left out (the round's prefill budget spent)
    sit this round out. E.g. budget 256, two new requests with 300 and 50 context tokens
    to cache: {first: 256} (the second waits); next round {first: 300, second: 50}."""
    waiting = [r for r in batch if r.target_phase in (TargetPhase.NEW, TargetPhase.PREFILLING)]
    if not waiting:
        return {}
    missing = [r.target_context - r.target_prefilled for r in waiting]
    grants = prefill_chunks(missing, budget)
    return {
        r.state.request_id: r.target_prefilled + grant
        for r, count, grant in zip(waiting, missing, grants, strict=True)
        if grant or not count
    }


HOLD_SHARE = 1.0  # of the last round's time, the most an idle micro-batch holds for arrivals


def arrival_hold_s(expected: int, waiting: int, round_s: float, cap_s: float) -> float:
    """How long an idle micro-batch waits for submissions before its next round: while fewer
    than ``expected`` (the requests its last round ended, when at least two: what a closed
    loop of clients sends again) are ``waiting``, up to that round's time (what starting
    without them costs them: a round later, for the rest of their lives) and at most
    ``cap_s``. One request ended, or as many already here: no wait (a lone client never
    waits)."""
    if expected < 2 or waiting >= expected:
        return 0.0
    return max(min(cap_s, HOLD_SHARE * round_s), 0.0)
