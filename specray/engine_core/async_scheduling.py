"""Async scheduling: a micro-batch's next round queued at the target before the verdict of the
round it is running (docs/design.md, "The engine core").

Between two forwards of one micro-batch the coordinator takes a turn: it commits the verdict,
pushes the stream deltas, admits and chooses the next round's k. The target would idle for that
turn; when the next round does not depend on the verdict, it is issued at once instead and the
turn runs during the next forward. A round depends on the verdict when a request in it drafts
(in the running round: its next block is drafted from the verdict; in the next: the policy is
asked before the verdict, and the round waits unless it drafts nothing), is still being
prefilled (the verdict says whether its prompt is cached) or is being ended (cancelled, past
its deadline, a stop string matched), or when requests wait to join (they join at the next
boundary instead of a round later). A request the running round ends by its length is left
out of the next.

A request the running round ends otherwise (a stop token, a grammar's end) has nothing run for
it in the queued round: the target freed it when it ended it, and skips an item scheduled ahead
for a request it does not hold (:meth:`specray.target_rounds.TargetRounds.live`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

from specray.engine_core.request import Request, TargetPhase
from specray.protocol import RoundReport, VerifyItem


@dataclass
class IssuedRound:
    """A round sent to the target: its requests in item order and what its reply completes."""

    requests: list[Request]
    reply: Awaitable[RoundReport]  # a task once sent; a coroutine that sends it when awaited
    grants: dict[str, int] = field(default_factory=dict)  # chunked prefill (request id -> until)
    proposals: dict = field(default_factory=dict)  # draft calls made for it
    ahead: bool = False  # issued before the verdict of the round before


def next_round_ahead(
    running: Sequence[Request], batch: Sequence[Request], *, admitting: bool, now: float
) -> list[Request]:
    """The requests of the round to queue behind ``running`` (a round in flight), or [] when
    the next round must wait for its verdict. Whether the policy drafts in it is asked
    apart (the coordinator queues it only if not).

    ``batch`` is the micro-batch now; ``admitting``: requests wait that the batch has room for.
    Requests the running round ends by their length are left out (they finish there), and so
    are those no longer in the batch.

    A batch of two decoding requests drafting nothing, one with a single token left: the next
    round carries the other. With a request just admitted (not in the running round), one
    still prefilling, or one drafting in the running round: [] (built after the verdict).
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
