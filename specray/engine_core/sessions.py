"""Front ends on the engine core: one long-lived session each, a TCP connection
(:mod:`specray.engine_core.session_wire`).

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
import logging

from specray.engine_core.session_wire import MAX_UNSENT_BYTES, frame, read_frame
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

log = logging.getLogger(__name__)
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


class SessionServer:
    """The engine core's listener (:mod:`specray.engine_core.session_wire`): a
    :class:`Session` per front end's connection, read and written on the engine core's loop."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.sessions: list[Session] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> str:
        """Listen on a free port of ``host``; returns the address front ends connect to."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{host}:{port}"

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    def close_all(self) -> None:
        """End every session (its front end sees the connection close)."""
        self.stop_accepting()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()

        def send(payload: bytes) -> None:
            if writer.is_closing():
                return
            if writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
                log.error("closing a front-end session: it has not read its last deltas")
                writer.close()  # its reading below ends, and the session with it
                return
            writer.write(frame(payload))

        session = Session(self.coordinator, loop, send)
        self.sessions.append(session)
        self._writers.add(writer)
        try:
            while (payload := await read_frame(reader)) is not None:
                await session.take(decode(payload, FrontendBatch))
        except ProtocolError as error:  # another version, or not a session: end it, loudly
            log.error("closing a front-end session: %s", error)
        except OSError:
            pass  # the front end went away
        finally:
            session.close()
            self.sessions.remove(session)
            self._writers.discard(writer)
            writer.close()
