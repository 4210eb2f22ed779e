"""A front end's session with the engine core, for asyncio (the serving layer).

It offers what :class:`specray.serve.service.CoordinatorService` uses of a coordinator —
``submit`` (returns once the engine core admitted or refused the request), ``abort`` and
``finish`` (a stop string ended it here) — so the service turns tokens into
text and events in the front end's process, while the engine core only commits tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

from specray.engine_core.client import Delivered, deliver, frontend_bytes
from specray.engine_core.session_wire import connect, frame, read_frame
from specray.engine_core.streams import RequestStream
from specray.errors import SpecrayError, UnavailableError, error_from_dict
from specray.outputs import RequestOutput
from specray.protocol import Delta, FrontendBatch, ProtocolError, Submit, encode
from specray.sampling import SamplingParams

log = logging.getLogger(__name__)
# Batches queued in one turn of the loop go out as one frame, up to this many bytes of their
# own encodings: the n choices of one call (submitted in one turn of the loop) reach the engine
# core together, so it admits them to one round, whose forward computes their shared prompt
# once (models/shared_rows.py).
MERGE_BYTES = 4 * 1024 * 1024


class AsyncClientStream(RequestStream):
    """One request's deltas (``async for``), as a coordinator's RequestStream; ``admitted``
    resolves once the engine core took (or refused) the request."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        committed: Sequence[int] = (),
    ):
        super().__init__(request_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self._delivered = Delivered(request_id, prompt_token_ids, params, committed)
        self.token_ids = self._delivered.token_ids  # a resumed request's are its start
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.output: RequestOutput | None = None

    def _take(self, delta: Delta) -> None:
        error = error_from_dict(delta.error.__dict__) if delta.error is not None else None
        if not self.admitted.done():
            if error is not None:
                self.admitted.set_exception(error)
                return
            self.admitted.set_result(None)
        new = self._delivered.take(delta)
        if delta.token_ids:
            self._push(new.token_ids, new.logprobs, new.prompt_logprobs)
        if delta.finished is not None:
            self.output = self._delivered.output(delta.finished)
            self._finish(self.output, None)
        elif error is not None:
            self._finish(None, error)

    def _fail(self, error: SpecrayError) -> None:
        if not self.admitted.done():
            self.admitted.set_exception(error)
        else:
            self._finish(None, error)


class AsyncEngineCoreClient:
    """``await start()``, then submit / abort / finish; ``closed`` once the session ended
    (the engine core went away): its requests failed with UnavailableError."""

    def __init__(
        self,
        address: str,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        num_speculative_tokens: int,
        metrics_text: Callable[[], Awaitable[bytes]] | None = None,
    ):
        self.address = address
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.num_speculative_tokens = num_speculative_tokens
        self._metrics_text = metrics_text
        self._prefix = f"{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()
        self._streams: dict[str, AsyncClientStream] = {}
        # This turn's messages, sent together at its end (:meth:`_flush`).
        self._queued: list[tuple[FrontendBatch, bytes]] = []
        self._writer: asyncio.StreamWriter | None = None
        self.closed: asyncio.Event | None = None
        self.batches_received = 0

    async def start(self, connect_timeout_s: float = 30.0) -> None:
        """Connect, retrying for up to ``connect_timeout_s`` (an engine core starting up);
        UnavailableError if none answers by then."""
        reader, self._writer = await connect(self.address, connect_timeout_s)
        self.closed = asyncio.Event()
        self._reader = asyncio.create_task(self._read(reader), name="engine-core-session")

    def _queue(self, batch: FrontendBatch, payload: bytes) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append((batch, payload))

    def _flush(self) -> None:
        """Send what this turn queued, in as few frames as :data:`MERGE_BYTES` allows (in
        order: a request's abort or finish never goes before its submission)."""
        queued, self._queued = self._queued, []
        if self._writer is None or self._writer.is_closing():
            return  # the session ended: its requests failed already
        while queued:
            size, count = 0, 0
            while count < len(queued) and (count == 0 or size < MERGE_BYTES):
                size += len(queued[count][1])
                count += 1
            self._writer.write(frame(_merged(queued[:count])))
            queued = queued[count:]

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: SpecrayError = UnavailableError("the engine core closed the session")
        try:
            while (payload := await read_frame(reader)) is not None:
                self.batches_received += 1
                deliver(payload, self._streams)
        except (OSError, ProtocolError) as failure:
            error = UnavailableError(f"the engine core session failed: {failure}")
        except asyncio.CancelledError:
            pass
        finally:
            self.closed.set()
            streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream._fail(error)

    @property
    def in_flight(self) -> int:
        """Requests of this session not yet ended."""
        return len(self._streams)

    @property
    def healthy(self) -> bool:
        return self.closed is not None and not self.closed.is_set()

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
        num_speculative_tokens: int | None = None,
        fixed_k: bool = False,
        committed_token_ids: Sequence[int] = (),
        stream: bool = True,
    ) -> AsyncClientStream:
        """Admit a request or raise (invalid input, overload, draining) once the engine core
        has decided. ``stream=False``: the caller wants the whole output only (its first
        tokens, progress and end come, not every round's)."""
        if not self.healthy:
            raise UnavailableError("the engine core session is closed; retry")
        request_id = request_id or f"{self._prefix}{next(self._ids)}"
        submit = Submit(
            request_id,
            tuple(prompt_token_ids),
            params,
            timeout_s=timeout_s,
            num_speculative_tokens=num_speculative_tokens,
            fixed_k=fixed_k,
            committed_token_ids=tuple(committed_token_ids),
            stream=stream,
        )
        batch = FrontendBatch(submits=(submit,))
        payload = frontend_bytes(batch)  # checked alone: an invalid request fails alone
        stream = AsyncClientStream(request_id, prompt_token_ids, params, committed_token_ids)
        self._streams[request_id] = stream
        self._queue(batch, payload)
        await stream.admitted
        return stream

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its stream ends with RequestCancelledError when the engine core
        has freed it. False if it is not in flight here."""
        self._send(FrontendBatch(aborts=(request_id,)))
        return request_id in self._streams

    async def finish(self, request_id: str) -> RequestOutput | None:
        """End a request now as finished (a stop string matched here); its output, with what
        the engine core committed by then, or None if it already ended otherwise."""
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        self._send(FrontendBatch(finishes=(request_id,)))
        with contextlib.suppress(SpecrayError):
            async for _ in stream:
                pass
        return stream.output

    def _send(self, batch: FrontendBatch) -> None:
        self._queue(batch, encode(batch))

    async def metrics_text(self) -> bytes:
        return await self._metrics_text() if self._metrics_text is not None else b""

    async def close(self) -> None:
        """End the session: the engine core aborts what is left of its requests."""
        if self._writer is None:
            return
        self._flush()
        self._writer.close()  # the engine core sees the end and closes its side
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._reader, 10)


def _merged(queued: Sequence[tuple[FrontendBatch, bytes]]) -> bytes:
    """One payload for the queued ``(batch, its encoding)`` pairs."""
    if len(queued) == 1:
        return queued[0][1]
    batches = [batch for batch, _ in queued]
    return encode(
        FrontendBatch(
            submits=tuple(submit for batch in batches for submit in batch.submits),
            aborts=tuple(request_id for batch in batches for request_id in batch.aborts),
            finishes=tuple(request_id for batch in batches for request_id in batch.finishes),
        )
    )
