"""A front end's side of an engine core session (:mod:`specray.engine_core.sessions`): submit,
abort, and per-request streams of committed tokens, from plain threads (the offline
``Engine``'s driver, benchmarks).

Outputs are assembled here from the deltas: text is decoded here, not on the engine core.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence

from specray.engine_core.session_wire import connect_blocking, frame, read_frame_blocking
from specray.engine_core.streams import StreamDelta
from specray.errors import InvalidRequestError, SpecrayError, UnavailableError, error_from_dict
from specray.outputs import RequestOutput, SpecDecodeMetrics
from specray.protocol import (
    Delta,
    DeltaBatch,
    Finished,
    FrontendBatch,
    ProtocolError,
    Submit,
    decode,
    encode,
)
from specray.rpc.messages import MAX_REQUEST_ID_CHARS
from specray.sampling import SamplingParams
from specray.sampling.logprobs import TokenLogprob

_END = object()


class Delivered:
    """What a front end has received of one request: its tokens, and log-probabilities when
    its params asked (a resumed request starts from its ``committed`` tokens)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        committed: Sequence[int] = (),
    ):
        self.request_id, self.prompt_token_ids = request_id, list(prompt_token_ids)
        self.token_ids: list[int] = list(committed)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def take(self, delta: Delta) -> StreamDelta:
        """Keep a delta's tokens; the stream delta that hands them on."""
        self.token_ids.extend(delta.token_ids)
        logprobs = prompt = None
        if self.logprobs is not None:
            logprobs = list(delta.logprobs)
            self.logprobs.extend(logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt = [None, *delta.prompt_logprobs]
        return StreamDelta(list(delta.token_ids), None, logprobs, prompt)

    def output(self, finished: Finished) -> RequestOutput:
        output = output_of(self.request_id, self.prompt_token_ids, self.token_ids, finished)
        output.logprobs = None if self.logprobs is None else list(self.logprobs)
        output.prompt_logprobs = self.prompt_logprobs
        return output


def output_of(
    request_id: str, prompt: Sequence[int], tokens: Sequence[int], finished: Finished
) -> RequestOutput:
    """A request's output (text left empty) from its delivered tokens and the engine core's
    end record."""
    metrics = SpecDecodeMetrics(
        num_drafts=finished.num_drafts,
        num_draft_tokens=finished.num_draft_tokens,
        num_accepted_tokens=finished.num_accepted_tokens,
        accepted_per_position=list(finished.accepted_per_position),
        num_target_steps=finished.num_target_steps,
    )
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        token_ids=list(tokens),
        text="",
        finish_reason=finished.finish_reason,
        seed=finished.seed,
        metrics=metrics,
        time_to_first_token_s=finished.time_to_first_token_s,
        latency_s=finished.latency_s,
        chunk_gaps_s=list(finished.chunk_gaps_s),
    )


def deliver(payload: bytes, streams: dict, lock: threading.Lock | None = None) -> None:
    """Hand each delta of a ``DeltaBatch`` to its request's stream in ``streams`` (request id
    -> stream with ``_take``); a request that ended leaves ``streams``. ``lock`` guards
    ``streams`` where other threads submit."""
    guard = lock if lock is not None else contextlib.nullcontext()
    for delta in decode(payload, DeltaBatch).deltas:
        with guard:
            stream = streams.get(delta.request_id)
            if delta.finished is not None or delta.error is not None:
                streams.pop(delta.request_id, None)
        if stream is not None:
            stream._take(delta)


def frontend_bytes(batch: FrontendBatch) -> bytes:
    """The batch's wire form, checked here, at the front end, against what the engine core
    accepts: a request it could not decode must fail alone, as invalid input, rather than
    close the session of every request beside it."""
    for submit in batch.submits:
        if not 0 < len(submit.request_id) <= MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                f"request_id must be a string of 1..{MAX_REQUEST_ID_CHARS} characters, got "
                f"{len(submit.request_id)} characters",
                param="request_id",
            )
    payload = encode(batch)
    try:
        decode(payload, FrontendBatch)
    except ProtocolError as error:
        raise InvalidRequestError(
            f"the request exceeds the engine core's limits: {error}"
        ) from None
    return payload


class ClientStream:
    """One request's deltas as they arrive; ``result()`` waits for its output."""

    def __init__(
        self,
        client: EngineCoreClient,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        committed: Sequence[int] = (),
    ):
        self._client, self.request_id = client, request_id
        self.prompt_token_ids = prompt_token_ids
        self._delivered = Delivered(request_id, prompt_token_ids, params, committed)
        self.token_ids = self._delivered.token_ids  # a resumed request's are its start
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._error: SpecrayError | None = None

    def _take(self, delta: Delta) -> None:
        new = self._delivered.take(delta)
        if delta.error is not None:
            self._error = error_from_dict(delta.error.__dict__)
        elif delta.finished is not None:
            self._output = new.output = self._delivered.output(delta.finished)
            tokenizer = self._client.tokenizer
            if tokenizer is not None:  # decoded here, off the engine core's loop
                self._output.text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if delta.token_ids or self._output is not None:
            self._events.put(new)
        if delta.error is not None or delta.finished is not None:
            self._done.set()
            self._events.put(_END)

    def _fail(self, error: SpecrayError) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()
            self._events.put(_END)

    def __iter__(self) -> Iterator[StreamDelta]:
        while True:
            item = self._events.get()
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def result(self, timeout_s: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"request {self.request_id} is still running")
        if self._error is not None:
            raise self._error
        return self._output


class EngineCoreClient:
    """One session with the engine core at ``address``."""

    def __init__(self, address: str, *, tokenizer=None, connect_timeout_s: float = 30.0):
        self.tokenizer = tokenizer
        self._prefix = f"{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()
        self._streams: dict[str, ClientStream] = {}
        self._lock = threading.Lock()
        self._socket = connect_blocking(address, connect_timeout_s)
        self._write_lock = threading.Lock()
        self.batches_received = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        error: SpecrayError = UnavailableError("the engine core closed the session")
        try:
            while (payload := read_frame_blocking(self._socket)) is not None:
                self.batches_received += 1
                deliver(payload, self._streams, self._lock)
        except (OSError, ProtocolError) as failure:
            error = UnavailableError(f"the engine core session failed: {failure}")
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream._fail(error)

    def submit_many(self, submits: Sequence[tuple[list[int], SamplingParams, dict]]):
        """Submit several requests in one message; ``(prompt ids, params, options)`` each,
        options as for :meth:`submit`."""
        streams, messages = [], []
        for prompt_token_ids, params, options in submits:
            request_id = options.get("request_id") or f"{self._prefix}{next(self._ids)}"
            committed = tuple(options.get("committed_token_ids", ()))
            stream = ClientStream(self, request_id, list(prompt_token_ids), params, committed)
            messages.append(
                Submit(
                    request_id,
                    tuple(prompt_token_ids),
                    params,
                    timeout_s=options.get("timeout_s"),
                    num_speculative_tokens=options.get("num_speculative_tokens"),
                    fixed_k=options.get("fixed_k", False),
                    committed_token_ids=committed,
                    stream=options.get("stream", True),
                )
            )
            streams.append(stream)
        payload = frontend_bytes(FrontendBatch(tuple(messages)))
        with self._lock:
            for stream in streams:
                self._streams[stream.request_id] = stream
        self._write(payload)
        return streams

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, **options
    ) -> ClientStream:
        """``options``: request_id, timeout_s, num_speculative_tokens, fixed_k (speculation
        "on": that k every round), committed_token_ids,
        stream (False: only the whole output is wanted, so the engine core sends the first
        tokens, progress every ``sessions.PROGRESS_INTERVAL_S`` and the end, not every round)."""
        return self.submit_many([(prompt_token_ids, params or SamplingParams(), options)])[0]

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Submit every prompt at once and wait for all outputs (in order)."""
        submits = [(ids, p, {"stream": False}) for ids, p in zip(prompts, params, strict=True)]
        return [stream.result() for stream in self.submit_many(submits)]

    def abort(self, request_id: str) -> None:
        self._write(encode(FrontendBatch(aborts=(request_id,))))

    def _write(self, payload: bytes) -> None:
        with self._write_lock, contextlib.suppress(OSError):  # ended: its streams failed
            self._socket.sendall(frame(payload))

    def close(self) -> None:
        """End the session: the engine core aborts what is left of its requests."""
        with self._write_lock, contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_WR)  # the end of what this side sends
        self._reader.join(timeout=10)
        self._socket.close()
