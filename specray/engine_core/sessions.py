"""Front ends on the engine core: one long-lived ``EngineCore.Session`` stream each.

A front end (the offline ``Engine``'s driver, a Serve ingress) sends
:class:`~specray.protocol.FrontendBatch` messages (submissions, aborts) and receives at most
one :class:`~specray.protocol.DeltaBatch` per round: the new tokens of its streamed requests
that committed any, and the end of those that finished. A request whose caller waits for the
whole output is not streamed: its first tokens, its progress every ``PROGRESS_INTERVAL_S`` and
its end (a message per round costs the engine core's process more than a small model's
forward). Tokens only: text and stop strings are the front end's work, off the engine core's
loop. A front end that goes away takes its requests with it (they are aborted and their worker
state freed)."""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading

import grpc

from specray.engine_core.streams import StreamDelta
from specray.errors import SpecrayError, error_to_dict
from specray.outputs import RequestOutput
from specray.protocol import (
    Delta,
    DeltaBatch,
    ErrorInfo,
    Finished,
    FrontendBatch,
    ProtocolError,
    Submit,
    decode,
    encode,
)
from specray.v1 import speculation_pb2 as pb
from specray.v1 import speculation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CLOSED = object()
# A request whose caller waits for the whole output (``Submit.stream`` False) reports its
# progress this often: the tokens a resume on another group starts from.
PROGRESS_INTERVAL_S = 0.25


def finished_of(output: RequestOutput) -> Finished:
    metrics = output.metrics
    return Finished(
        finish_reason=output.finish_reason,
        seed=output.seed,
        num_drafts=metrics.num_drafts,
        num_draft_tokens=metrics.num_draft_tokens,
        num_accepted_tokens=metrics.num_accepted_tokens,
        accepted_per_position=tuple(metrics.accepted_per_position),
        num_target_steps=metrics.num_target_steps,
        time_to_first_token_s=output.time_to_first_token_s or 0.0,
        latency_s=output.latency_s or 0.0,
        chunk_gaps_s=tuple(output.chunk_gaps_s or ()),
    )


def error_info(error: SpecrayError) -> ErrorInfo:
    values = error_to_dict(error)
    return ErrorInfo(values["type"], values["message"], values["param"])


class Session:
    """One front end's requests on the coordinator's loop (a :class:`StreamSink` for each)."""

    def __init__(self, coordinator, loop: asyncio.AbstractEventLoop, send):
        self.coordinator, self.loop, self._send = coordinator, loop, send
        self.requests: set[str] = set()
        self._tokens: dict[str, StreamDelta] = {}  # this turn's new tokens, per request
        self._ends: dict[str, Delta] = {}
        self._flush_scheduled = False
        # requests submitted with stream=False -> whether their first tokens went out
        self._unstreamed: dict[str, bool] = {}
        self._first: set[str] = set()  # unstreamed requests whose first tokens go next
        self._progress: asyncio.TimerHandle | None = None
        self._report_due = False  # the progress timer fired: held tokens go with the next
        self.batches_sent = 0
        # What the front end sent, in order, for one task on the loop to take: the reading
        # thread hands each message over without waiting for the loop (a burst of messages
        # is taken in one turn, not one thread-to-loop round trip each); None: it went away.
        self._inbox: collections.deque[FrontendBatch | None] = collections.deque()
        self._taker: asyncio.Task | None = None

    def receive(self, batch: FrontendBatch | None) -> None:
        """On the loop: queue a message from the front end (None: the front end went away,
        after everything it sent)."""
        self._inbox.append(batch)
        if self._taker is None or self._taker.done():
            self._taker = self.loop.create_task(self._take_all())

    async def _take_all(self) -> None:
        while self._inbox:
            batch = self._inbox.popleft()
            if batch is None:
                self.close()
                return
            try:
                await self.take(batch)
            except Exception:  # a bad message must not strand the ones behind it
                log.exception("taking a front end's message failed")

    async def take(self, batch: FrontendBatch) -> None:
        for submit in batch.submits:
            await self._submit(submit)
        for request_id in batch.aborts:
            self.coordinator.abort(request_id)
        for request_id in batch.finishes:
            self.coordinator.finish(request_id)

    async def _submit(self, submit: Submit) -> None:
        try:
            stream = await self.coordinator.submit(
                list(submit.prompt_token_ids),
                submit.params,
                request_id=submit.request_id,
                timeout_s=submit.timeout_s,
                num_speculative_tokens=submit.num_speculative_tokens,
                fixed_k=submit.fixed_k,
                committed_token_ids=submit.committed_token_ids,
            )
        except SpecrayError as error:
            self.on_end(submit.request_id, None, error)
            return
        self.requests.add(submit.request_id)
        if not submit.stream:
            self._unstreamed[submit.request_id] = False
        stream.attach(self)

    # ---- StreamSink ----------------------------------------------------------------------
    def on_tokens(self, request_id: str, delta: StreamDelta) -> None:
        held = self._tokens.get(request_id)
        self._tokens[request_id] = delta if held is None else held.merge(delta)
        started = self._unstreamed.get(request_id)
        if started:  # held for its progress report or its end
            if self._progress is None:
                self._progress = self.loop.call_later(PROGRESS_INTERVAL_S, self._report)
            return
        if started is not None:  # its first tokens go now (its admission)
            self._unstreamed[request_id] = True
            self._first.add(request_id)
        self._schedule()

    def on_end(self, request_id: str, output: RequestOutput | None, error) -> None:
        self.requests.discard(request_id)
        self._unstreamed.pop(request_id, None)
        finished = finished_of(output) if output is not None else None
        info = error_info(error) if error is not None else None
        self._ends[request_id] = Delta(request_id, (), finished, info)
        self._schedule()

    def _report(self) -> None:
        self._progress = None
        self._report_due = True
        self._schedule()

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """One message with everything this turn of the loop committed or ended. An
        unstreamed request's tokens go with its first tokens, its progress report or its
        end only: a front end wakes each request a delta names, and a caller waiting for
        the whole output has nothing to do with the tokens between."""
        self._flush_scheduled = False
        report, self._report_due = self._report_due, False
        held: dict[str, StreamDelta] = {}
        deltas = []
        for request_id, new in self._tokens.items():
            due = report or request_id in self._first or request_id in self._ends
            if self._unstreamed.get(request_id) and not due:
                held[request_id] = new
                continue
            end = self._ends.pop(request_id, None)
            finished, error = (None, None) if end is None else (end.finished, end.error)
            prompt = new.prompt_logprobs
            deltas.append(
                Delta(
                    request_id,
                    tuple(new.token_ids),
                    finished,
                    error,
                    tuple(new.logprobs or ()),
                    None if prompt is None else tuple(prompt[1:]),  # position 0 has none
                )
            )
        deltas.extend(self._ends.values())
        self._tokens = held
        self._ends.clear()
        self._first.clear()
        if deltas:
            self.batches_sent += 1
            self._send(encode(DeltaBatch(tuple(deltas))))

    def close(self) -> None:
        """The front end went away: its requests end here."""
        if self._progress is not None:
            self._progress.cancel()
            self._progress = None
        for request_id in list(self.requests):
            self.coordinator.abort(request_id)
        self.requests.clear()


class EngineCoreServicer(pb_grpc.EngineCoreServicer):
    """The ``EngineCore`` gRPC service; ``host()`` is the running engine core (or None)."""

    def __init__(self, host):
        self._host = host
        self.sessions: list[Session] = []

    def Session(self, request_iterator, context):
        host = self._host()
        if host is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no engine core runs on this target group")
        outbox: queue.Queue = queue.Queue()
        session = Session(host.coordinator, host.loop, lambda payload: outbox.put(payload))
        self.sessions.append(session)

        def read() -> None:
            try:
                for message in request_iterator:
                    try:
                        batch = decode(message.payload, FrontendBatch)
                    except ProtocolError as error:  # another version: end the session, loudly
                        log.error("closing a front-end session: %s", error)
                        return
                    host.loop.call_soon_threadsafe(session.receive, batch)
            except grpc.RpcError:
                pass  # the front end went away
            finally:
                host.loop.call_soon_threadsafe(session.receive, None)
                outbox.put(_CLOSED)

        threading.Thread(target=read, name="frontend-session", daemon=True).start()
        while True:
            payload = outbox.get()
            if payload is _CLOSED:
                self.sessions.remove(session)
                return
            yield pb.FrontendMessage(payload=payload)
