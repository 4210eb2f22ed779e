"""Async scheduling (``CoordinatorConfig.async_scheduling``, off by default): a micro-batch's
next round queued at the target before the verdict of the round it is running
(docs/design.md, section 4).

Between two forwards of one micro-batch the coordinator takes a turn: it commits the verdict,
pushes the stream deltas, admits and builds the next round. The target would idle for that
turn; when the next round does not depend on the verdict, it is issued at once instead and the
turn runs during the next forward. That is the case in a group that drafts nothing (its rounds
never wait for blocks drafted from a verdict) while one micro-batch runs, unless a request is
still being prefilled (the verdict says whether its prompt is cached) or being ended
(cancelled, past its deadline, a stop string matched), or requests wait to join. A request the
running round ends by its length is left out of the next; one submitted while the queued round
has not started joins it (:class:`OpenRound`). With draft workers the rounds stay
verdict-first: on the simulator, with a badly drafted request among good ones at concurrency
4, rounds decided before their verdict cost the policy 19 % of its throughput.

A request the running round ends otherwise (a stop token, a grammar's end) has nothing run for
it in the queued round: the target freed it when it ended it, and skips an item scheduled ahead
for a request it does not hold (:meth:`specray.target_rounds.TargetRounds.live`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

from specray.engine_core.admission import prefill_grants
from specray.engine_core.request import Request, TargetPhase
from specray.protocol import RoundReport, VerifyItem, VerifyRound


class OpenRound:
    """A round scheduled ahead that requests arriving meanwhile may still join, until the
    target starts it: a request submitted while the round before runs then starts in the next
    round, as it would without async scheduling, not one later. The target calls
    :meth:`start` when the round's turn comes (on its own thread); joining is locked against
    it."""

    def __init__(self, round_: VerifyRound):
        self._items = list(round_.items)
        self._deadline_s = round_.draft_deadline_s
        self._lock = threading.Lock()
        self._started = False

    @property
    def items(self) -> tuple[VerifyItem, ...]:
        """Its items so far (more may join until it starts)."""
        with self._lock:
            return tuple(self._items)

    def join(self, items: Sequence[VerifyItem]) -> bool:
        """Add ``items``; False (nothing added) once the target has started the round."""
        with self._lock:
            if self._started:
                return False
            self._items.extend(items)
            return True

    def start(self) -> VerifyRound:
        """The round as it runs; no item joins it after this."""
        with self._lock:
            self._started = True
            return VerifyRound(tuple(self._items), self._deadline_s)


def started(round_: VerifyRound | OpenRound) -> VerifyRound:
    """What a target runs when a round's turn comes."""
    return round_.start() if isinstance(round_, OpenRound) else round_


@dataclass
class IssuedRound:
    """A round sent to the target: its requests in item order and what its reply completes."""

    requests: list[Request]
    reply: Awaitable[RoundReport]  # a task once sent; a coroutine that sends it when awaited
    grants: dict[str, int] = field(default_factory=dict)  # chunked prefill (request id -> until)
    proposals: dict = field(default_factory=dict)  # draft calls made for it
    open: OpenRound | None = None  # scheduled ahead: requests may join until it starts


def next_round_ahead(
    running: Sequence[Request], batch: Sequence[Request], *, admitting: bool, now: float
) -> list[Request]:
    """The requests of the round to queue behind ``running`` (a round in flight), or [] when
    the next round must wait for its verdict.

    ``batch`` is the micro-batch now; ``admitting``: requests wait that the batch has room for.
    Requests the running round ends by their length are left out (they finish there), and so
    are those no longer in the batch.

    A batch of two decoding requests, one with a single token left: the next round carries the
    other. With a request just admitted (not in the running round), one still prefilling, or
    one drafting in the running round: [] (built after the verdict).
    """
    members = {id(request) for request in running}
    if admitting or any(id(request) not in members for request in batch):
        return []
    in_batch = {id(request) for request in batch}
    ahead = []
    for request in running:
        if id(request) not in in_batch:  # it ended since (finished, cancelled, expired)
            continue
        if (
            request.target_phase is not TargetPhase.DECODING
            or request.leaving(now)
            or request.last_k > 0  # its next block is drafted from the verdict
        ):
            return []
        if request.state.remaining > 1:  # the running round commits one token for it
            ahead.append(request)
    return ahead


def ahead_items(requests: Sequence[Request]) -> list[VerifyItem]:
    """The items of a round scheduled ahead: each request one step on, one token committed."""
    return [
        VerifyItem(
            request.state.request_id,
            request.step + 1,
            len(request.state.output_token_ids) + 1,
            expect_draft=False,
            scheduled_ahead=True,
        )
        for request in requests
    ]


def _sent(requests: Sequence[Request]) -> None:
    for request in requests:
        request.step += 1
        request.last_k = 0
        request.sent_to_target()


def schedule_ahead(requests: Sequence[Request], target, draft_deadline_s: float) -> IssuedRound:
    """Send the round of ``requests`` (:func:`next_round_ahead`) to ``target`` now (a task: it
    starts before the caller's turn ends, behind the round it follows), open to joiners."""
    open_round = OpenRound(VerifyRound(tuple(ahead_items(requests)), draft_deadline_s))
    _sent(requests)
    reply = asyncio.ensure_future(target.verify(open_round))
    return IssuedRound(list(requests), reply, open=open_round)


def join_ahead(ahead: IssuedRound, joined: Sequence[Request]) -> bool:
    """Add requests new to the target (just admitted) to ``ahead``, a round scheduled ahead,
    prefilled whole; False (nothing changed) once the target has started it."""
    grants = prefill_grants(joined, 0)
    items = [
        VerifyItem(
            request.state.request_id,
            request.step + 1,
            len(request.state.output_token_ids),
            expect_draft=False,
            spec=request.state.to_spec(),
            prefill_until=grants.get(request.state.request_id),
        )
        for request in joined
    ]
    if ahead.open is None or not ahead.open.join(items):
        return False
    _sent(joined)
    ahead.requests.extend(joined)
    ahead.grants.update(grants)
    return True
