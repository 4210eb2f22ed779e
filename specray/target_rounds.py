"""The target side of a round without the model: one bookkeeper for the real target worker
(:mod:`specray.actors.target_worker`) and the simulated one (:mod:`specray.sim.workers`).

A round, for the requests of one :class:`~specray.protocol.VerifyRound`:

0. :meth:`TargetRounds.live` — items scheduled ahead for requests that the round before ended
   are set aside (answered :meth:`TargetRounds.ended`, nothing runs for them).
1. :meth:`TargetRounds.open` — requests new here are registered from their spec; every
   item's committed count must match what is held (a mismatch is a coordinator bug, raised).
2. prefill — the host caches what each new request's context lacks (:func:`prefill_span`
   decides how much, under chunked prefill); a request still short sits the round out.
3. :meth:`TargetRounds.expected` — the (request_id, step) keys whose blocks to wait for.
4. the host waits for them until the draft deadline.
5. :meth:`TargetRounds.sort` — arrivals become blocks to verify, or drop reasons (invalid,
   stale, missed the deadline).
6. the host verifies, and :meth:`TargetRounds.result` states what it committed.

The hosts differ only in steps 2, 4 and 6: a model and threads, or virtual time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from specray.protocol import Dropped, DropReason, RequestSpec, VerifyItem, VerifyResult

Key = tuple[str, int]  # (request_id, step)
State = TypeVar("State")


class Arrival(Protocol):
    num_committed: int  # the committed tokens the block was drafted from


A = TypeVar("A", bound=Arrival)
STALE = Dropped(DropReason.STALE, "drafted from other committed tokens")
MISSED = Dropped(DropReason.DEADLINE, "no block arrived in time")


def prefill_span(cached: int, context: int, until: int | None) -> tuple[int, bool]:
    """How far to cache a request's context this round, and whether it stays short of it.

    ``cached`` tokens are in the cache, ``context`` is what decoding needs (prompt and committed
    output but the pending token), ``until`` the chunked-prefill grant (None: all of it).

    >>> prefill_span(0, 10, None), prefill_span(0, 10, 4), prefill_span(4, 10, 12)
    ((10, False), (4, True), (10, False))
    """
    end = context if until is None else min(context, until)
    return end, max(cached, end) < context


class TargetRounds(Generic[State]):
    """Requests held by the target, keyed by id; ``make_state`` builds a host's state from a
    spec, ``committed`` counts the output tokens a state holds."""

    def __init__(
        self, make_state: Callable[[RequestSpec], State], committed: Callable[[State], int]
    ):
        self._make_state, self._committed = make_state, committed
        self.requests: dict[str, State] = {}

    def live(self, items: Sequence[VerifyItem]) -> tuple[list[VerifyItem], set[str]]:
        """The items to run, and the ids of requests set aside: scheduled ahead of a verdict
        that ended them (this side freed them when it did). An item not scheduled ahead for a
        request held nowhere still fails in :meth:`open`."""
        ended = {
            item.request_id
            for item in items
            if item.scheduled_ahead and item.request_id not in self.requests
        }
        if not ended:
            return list(items), ended
        return [item for item in items if item.request_id not in ended], ended

    @staticmethod
    def ended(
        items: Sequence[VerifyItem], results: Sequence[VerifyResult], ended: set[str]
    ) -> tuple[VerifyResult, ...]:
        """One result per item, in order: ``results`` answer the live items, the set-aside
        ones are answered ``ended``."""
        if not ended:
            return tuple(results)
        live = iter(results)
        return tuple(
            VerifyResult(item.request_id, (), ended=True)
            if item.request_id in ended
            else next(live)
            for item in items
        )

    def open(self, items: Sequence[VerifyItem]) -> tuple[list[State], set[str]]:
        """The states of the round's requests, in item order, and the ids new here."""
        fresh = set()
        for item in items:
            if item.request_id in self.requests:
                continue
            if item.spec is None:
                raise ValueError(f"target has no state for request {item.request_id}")
            self.requests[item.request_id] = self._make_state(item.spec)
            fresh.add(item.request_id)
        states = [self.requests[item.request_id] for item in items]
        for item, state in zip(items, states, strict=True):
            if item.num_committed != self._committed(state):
                raise RuntimeError(
                    f"request {item.request_id} is at {self._committed(state)} committed tokens "
                    f"here, the caller says {item.num_committed}"
                )
        return states, fresh

    @staticmethod
    def expected(items: Sequence[VerifyItem], prefilling: set[str]) -> list[Key]:
        """The blocks to wait for: drafted requests that verify this round."""
        return [
            (item.request_id, item.step)
            for item in items
            if item.expect_draft and item.request_id not in prefilling
        ]

    def sort(
        self, keys: Sequence[Key], arrived: Mapping[Key, A | Dropped]
    ) -> tuple[dict[str, A], dict[str, Dropped]]:
        """Blocks to verify (drafted from the committed tokens held here), and why the other
        expected ones are not used."""
        blocks: dict[str, A] = {}
        dropped: dict[str, Dropped] = {}
        for key in keys:
            request_id = key[0]
            value = arrived.get(key)
            if value is None:
                dropped[request_id] = MISSED
            elif isinstance(value, Dropped):
                dropped[request_id] = value
            elif value.num_committed != self._committed(self.requests[request_id]):
                dropped[request_id] = STALE
            else:
                blocks[request_id] = value
        return blocks, dropped

    @staticmethod
    def result(
        item: VerifyItem,
        token_ids: Sequence[int],
        num_draft_tokens: int,
        num_accepted: int,
        finish_reason: str | None,
        dropped: Mapping[str, Dropped],
        error: str | None = None,
    ) -> VerifyResult:
        """What a verified request committed (acceptance counts only when it drafted)."""
        return VerifyResult(
            item.request_id,
            tuple(token_ids),
            num_draft_tokens,
            num_accepted if num_draft_tokens else 0,
            finish_reason,
            dropped.get(item.request_id),
            error=error,
        )

    def forget(self, request_id: str) -> State | None:
        return self.requests.pop(request_id, None)
