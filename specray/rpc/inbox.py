"""Where draft blocks wait for their verification round, keyed by (request_id, step).

Idempotent by construction: the first valid block for a key wins and later copies (retries,
duplicates, replays) are ignored; a block for a step that was already verified is dropped.
A block for a request that already finished is parked: it is either late (it missed its round
and came after the request ended) or the first block of a new request that reuses the id and
has not yet reached the target; opening the request adopts its parked blocks, and parked blocks
nobody opened are dropped after ``PARKED_TTL_S`` (kept, a late block would be held for the life
of the process).
Invalid blocks are counted and remembered as a drop reason, so that round runs target-only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specray.protocol import Dropped, DropReason
from specray.rpc.messages import CheckedBlock

Key = tuple[str, int]  # (request_id, step)
# How long a finished request's late blocks are recognised as such: they come within seconds
# of its end (a draft call's length), never minutes; older ids are forgotten for good.
FINISHED_TTL_S = 600.0
# A reused id's first blocks wait for one target round to open the request: seconds at most.
PARKED_TTL_S = 60.0


@dataclass
class InboxStats:
    received: int = 0
    duplicates: int = 0
    stale: int = 0
    invalid: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)


class BlockInbox:
    def __init__(self):
        self._lock = threading.Condition()
        self._blocks: dict[Key, CheckedBlock] = {}
        self._invalid: dict[Key, Dropped] = {}
        self._reply: dict[Key, Callable] = {}  # where to send the verdict for a key
        self._verified_step: dict[str, int] = {}  # highest step already verified per request
        self._finished: dict[str, float] = {}  # request id -> when it was forgotten (in order)
        # blocks for finished ids: key -> (block, reply, arrival), in arrival order
        self._parked: dict[Key, tuple[CheckedBlock, Callable, float]] = {}
        self.stats = InboxStats()

    def _ended(self, request_id: str) -> bool:
        return request_id in self._finished

    def put(self, block: CheckedBlock, reply: Callable) -> bool:
        """Store a valid block; False when it is a duplicate or stale (ignored)."""
        key = (block.request_id, block.step)
        with self._lock:
            self.stats.received += 1
            if self._ended(block.request_id):
                if key in self._parked:
                    self.stats.duplicates += 1
                    return False
                self._parked[key] = (block, reply, time.monotonic())
                self._sweep_parked()
                return True
            if block.step <= self._verified_step.get(block.request_id, -1):
                self.stats.stale += 1
                return False
            if key in self._blocks:
                self.stats.duplicates += 1
                return False
            self._blocks[key] = block
            self._reply[key] = reply
            self._lock.notify_all()
            return True

    def put_invalid(self, request_id: str, step: int, reason: str) -> None:
        with self._lock:
            self.stats.invalid += 1
            label = reason.split(":")[0][:60]
            self.stats.invalid_reasons[label] = self.stats.invalid_reasons.get(label, 0) + 1
            if request_id and not self._ended(request_id):
                self._invalid.setdefault((request_id, step), Dropped(DropReason.INVALID, reason))
                self._lock.notify_all()

    def take(self, keys: Iterable[Key], deadline: float) -> dict[Key, CheckedBlock | Dropped]:
        """Wait until every key has a block or a drop reason, or the deadline passes.

        Returns what arrived: a block, or the reason it was dropped; missing keys are absent.
        The keys are marked verified, so late copies are dropped as stale.
        """
        keys = list(keys)
        with self._lock:
            while True:
                done = all(key in self._blocks or key in self._invalid for key in keys)
                remaining = deadline - time.monotonic()
                if done or remaining <= 0:
                    break
                self._lock.wait(remaining)
            out: dict[Key, CheckedBlock | Dropped] = {}
            for key in keys:
                if key in self._blocks:
                    out[key] = self._blocks.pop(key)
                elif key in self._invalid:
                    out[key] = self._invalid.pop(key)
                request_id, step = key
                self._verified_step[request_id] = max(step, self._verified_step.get(request_id, -1))
            return out

    def reply_to(self, key: Key) -> Callable | None:
        with self._lock:
            return self._reply.pop(key, None)

    def open(self, request_ids: Iterable[str]) -> None:
        """Requests new to the target: ids of finished requests reused by new ones; their
        parked blocks (the new request's, sent before this round) are adopted."""
        with self._lock:
            for request_id in request_ids:
                if self._finished.pop(request_id, None) is None:
                    continue
                for key in [key for key in self._parked if key[0] == request_id]:
                    block, reply, _ = self._parked.pop(key)
                    self._blocks[key], self._reply[key] = block, reply
            self._lock.notify_all()

    def _sweep_parked(self) -> None:
        """Drop parked blocks older than PARKED_TTL_S (oldest first; caller holds the lock)."""
        horizon = time.monotonic() - PARKED_TTL_S
        while self._parked and next(iter(self._parked.values()))[2] <= horizon:
            del self._parked[next(iter(self._parked))]
            self.stats.stale += 1

    def forget(self, request_id: str) -> None:
        """Drop everything about a finished request; its blocks arriving later are parked."""
        with self._lock:
            for store in (self._blocks, self._invalid, self._reply, self._parked):
                for key in [key for key in store if key[0] == request_id]:
                    del store[key]
            self._verified_step.pop(request_id, None)
            now = time.monotonic()
            self._finished[request_id] = now
            while next(iter(self._finished.values())) <= now - FINISHED_TTL_S:  # oldest first
                del self._finished[next(iter(self._finished))]  # (never empty: this one is new)
            self._sweep_parked()

    @property
    def num_held(self) -> int:
        """Blocks, drop reasons and reply channels held: 0 once every request ended and its late
        blocks were parked for PARKED_TTL_S."""
        with self._lock:
            self._sweep_parked()
            return len(self._blocks) + len(self._invalid) + len(self._reply) + len(self._parked)
