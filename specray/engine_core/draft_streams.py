"""The draft workers as the engine core sees them: one stream each, one message per round.

A draft worker connects to rank 0's ``Verifier.Exchange`` and names itself; it gets an index
(the coordinator's worker number) that a reconnection under the same id keeps. What the
coordinator asks of a worker in one turn of the event loop — free these requests, take those
on, draft this block — is merged into one :class:`~specray.protocol.DraftCommand`, and the
verdicts the target staged for that worker since its last message travel with it
(:meth:`StreamDraftPool.flush`). The worker answers with its blocks and its report on the
previous command in one message; a report resolves the futures of its command.

Threads: the gRPC servicer (attach, detach, replies), the target's forward (verdicts) and the
event loop (commands, flush) all touch the pool, so its state sits behind one lock; futures
are resolved on the loop. A worker whose stream closes is unavailable from then on, its
pending calls fail (the coordinator counts it failed and its requests go target-only), and
Ray or Serve restarts the process, which connects anew.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specray.protocol import (
    DraftCommand,
    DraftItem,
    DraftReply,
    PrefillReport,
    ProposeCall,
    ProposeReport,
    ProtocolError,
    decode,
    encode,
)
from specray.v1 import speculation_pb2 as pb

log = logging.getLogger(__name__)


class DraftWorkerLost(ConnectionError):
    """The worker's stream closed before it answered."""


@dataclass
class _Pending:
    """A command being gathered for one worker in this turn of the loop."""

    release: list[str] = field(default_factory=list)
    prefill: list[DraftItem] = field(default_factory=list)
    prefill_future: asyncio.Future | None = None
    propose: ProposeCall | None = None
    propose_future: asyncio.Future | None = None


@dataclass
class _Worker:
    worker_id: str
    send: Callable[[pb.DraftDown], None]
    open: bool = True
    verdicts: list[pb.Verdict] = field(default_factory=list)  # staged by the target
    commands: list[_Pending] = field(default_factory=list)  # gathered this turn
    # seq -> the futures its reply resolves: (prefill, propose)
    waiting: dict[int, tuple[asyncio.Future | None, asyncio.Future | None]] = field(
        default_factory=dict
    )


@dataclass
class PoolCounters:
    messages_sent: int = 0  # DraftDown messages (verdicts and a command at most)
    commands_sent: int = 0
    verdict_messages: int = 0  # of them, messages carrying verdicts only
    messages_received: int = 0  # DraftUp messages after the first


class StreamDraftPool:
    """A :class:`specray.engine_core.backends.DraftBackend` over the draft workers' streams."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connected = threading.Condition()  # notified when a worker attaches
        self._workers: list[_Worker] = []
        self._by_id: dict[str, int] = {}
        self._seq = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._on_lost: Callable[[int, BaseException], None] | None = None
        self.counters = PoolCounters()

    # ---- the coordinator's side (its event loop) ---------------------------------------
    def bind(
        self,
        loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[int, BaseException], None] | None = None,
    ) -> None:
        """Send commands from ``loop``; ``on_lost(worker, error)`` when a stream closes."""
        with self._lock:
            self._loop, self._on_lost = loop, on_lost

    def unbind(self) -> None:
        with self._lock:
            self._loop, self._on_lost = None, None

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def num_live(self) -> int:
        return sum(worker.open for worker in self._workers)

    def available(self, worker: int) -> bool:
        return worker < len(self._workers) and self._workers[worker].open

    def wait_for_workers(self, count: int, timeout_s: float) -> bool:
        """Block (not on the loop) until ``count`` workers are connected."""
        with self._connected:
            return self._connected.wait_for(lambda: self.num_live >= count, timeout_s)

    def propose(self, worker: int, call: ProposeCall) -> asyncio.Future:
        """Draft ``call``'s blocks; resolves to the worker's report (its next message)."""
        future = self._loop.create_future()
        with self._lock:
            pending = self._gather(worker, lambda p: p.propose is None, future)
            if pending is not None:
                pending.propose, pending.propose_future = call, future
        # Sent now, not at the end of the turn: a propose completes its round's command (its
        # releases and prefills were gathered before it), and the worker starts drafting
        # while the loop still has the target's call and the round's records to do.
        self.flush()
        return future

    def prefill(self, worker: int, items: Sequence[DraftItem]) -> asyncio.Future:
        future = self._loop.create_future()
        with self._lock:
            pending = self._gather(worker, lambda p: p.prefill_future is None, future)
            if pending is not None:
                pending.prefill, pending.prefill_future = list(items), future
                self._schedule_flush()
        return future

    def release(self, worker: int, request_ids: Sequence[str]) -> asyncio.Future:
        """Freed with the worker's next command (its commands run in order); nothing to wait
        for: a released request is never named to it again (a worker gone holds nothing)."""
        future = self._loop.create_future()
        with self._lock:
            pending = self._gather(worker, lambda p: True, None)
            if pending is not None:
                pending.release.extend(request_ids)
                self._schedule_flush()
        future.set_result(None)
        return future

    async def replace(self, worker: int) -> None:
        """Nothing to do here: the process is restarted by Ray or Serve and reconnects."""

    def _gather(
        self, worker: int, fits: Callable[[_Pending], bool], future: asyncio.Future | None
    ) -> _Pending | None:
        """The command this turn adds to (a new one if the last cannot take this part); None,
        with ``future`` failed, when the worker is gone. The caller says when it goes out."""
        state = self._workers[worker]
        if not state.open:
            if future is not None:
                future.set_exception(DraftWorkerLost(f"draft worker {worker} is not connected"))
            return None
        if not state.commands or not fits(state.commands[-1]):
            state.commands.append(_Pending())
        return state.commands[-1]

    def _schedule_flush(self) -> None:
        """(On the loop: commands are gathered there.)"""
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def schedule_flush(self) -> None:
        """Flush at the end of this turn of the loop (after whatever it still gathers); called
        on the loop, so no wake-up of the loop is needed (none at all with nothing staged)."""
        # Unlocked look first: the target staged this round's verdicts before its round
        # returned, and commands are gathered on this loop; nothing staged is the usual case
        # without draft workers.
        if not any(worker.verdicts or worker.commands for worker in self._workers):
            return
        with self._lock:
            if not self._flush_scheduled and self._loop is not None:
                self._flush_scheduled = True
                self._loop.call_soon(self.flush)

    # ---- sending -------------------------------------------------------------------------
    def flush(self) -> None:
        """Send what is staged: per worker, its verdicts with its first command, then any
        further commands alone. Callable from any thread."""
        with self._lock:
            self._flush_scheduled = False
            for state in self._workers:
                if not state.open or not (state.verdicts or state.commands):
                    continue
                verdicts, state.verdicts = state.verdicts, []
                commands, state.commands = state.commands, []
                if not commands:
                    self._send(state, pb.DraftDown(verdicts=verdicts))
                    self.counters.verdict_messages += 1
                for index, pending in enumerate(commands):
                    seq = next(self._seq)
                    command = DraftCommand(
                        seq,
                        tuple(pending.release),
                        tuple(pending.prefill),
                        pending.propose,
                    )
                    if pending.prefill_future or pending.propose_future:
                        state.waiting[seq] = (pending.prefill_future, pending.propose_future)
                    message = pb.DraftDown(command=encode(command))
                    if index == 0:
                        message.verdicts.extend(verdicts)
                    self._send(state, message)
                    self.counters.commands_sent += 1

    def _send(self, state: _Worker, message: pb.DraftDown) -> None:
        self.counters.messages_sent += 1
        state.send(message)

    # ---- the servicer's side (gRPC threads) and the target's (its forward thread) ---------
    def attach(self, worker_id: str, send: Callable[[pb.DraftDown], None]) -> int:
        """A worker's stream opened: its index (the same as before for a known id)."""
        with self._lock:
            index = self._by_id.get(worker_id)
            state = _Worker(worker_id, send)
            if index is None:
                index = self._by_id[worker_id] = len(self._workers)
                self._workers.append(state)
            else:
                self._workers[index] = state
        with self._connected:
            self._connected.notify_all()
        return index

    def detach(self, worker: int) -> None:
        """Its stream closed: unavailable; its calls in flight fail."""
        with self._lock:
            state = self._workers[worker]
            state.open = False
            waiting, state.waiting = state.waiting, {}
            state.verdicts.clear()
            loop, on_lost = self._loop, self._on_lost
        if loop is None:
            return
        error = DraftWorkerLost(f"draft worker {worker} ({state.worker_id}) disconnected")

        def fail() -> None:
            for futures in waiting.values():
                for future in futures:
                    if future is not None and not future.done():
                        future.set_exception(error)
            if on_lost is not None:
                on_lost(worker, error)

        loop.call_soon_threadsafe(fail)

    def stage_verdict(self, worker: int, verdict: pb.Verdict) -> None:
        """A verdict for the worker's next message (the target's forward thread)."""
        with self._lock:
            state = self._workers[worker]
            if state.open:
                state.verdicts.append(verdict)

    def on_message(self, worker: int, replies) -> None:
        """A DraftUp arrived (its blocks went to the inbox); resolve what its replies answer."""
        self.counters.messages_received += 1
        for reply in replies:
            try:
                answer = decode(reply, DraftReply)
            except ProtocolError as error:
                log.error("draft worker %d sent an undecodable reply: %s", worker, error)
                continue
            with self._lock:
                futures = self._workers[worker].waiting.pop(answer.seq, None)
                loop = self._loop
            if futures is not None and loop is not None:
                loop.call_soon_threadsafe(_resolve, futures, answer)


def _resolve(futures, answer: DraftReply) -> None:
    prefill, propose = futures
    results: list[tuple[asyncio.Future | None, PrefillReport | ProposeReport | None]] = [
        (prefill, answer.prefill),
        (propose, answer.propose),
    ]
    for future, report in results:
        if future is None or future.done():
            continue
        if answer.error is not None or report is None:
            future.set_exception(RuntimeError(answer.error or "the worker sent no report"))
        else:
            future.set_result(report)
