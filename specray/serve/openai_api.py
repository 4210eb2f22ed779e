"""The OpenAI-compatible HTTP API over any :class:`specray.serve.protocol.GenerationBackend`.

``build_http_app(backend)`` returns a FastAPI app with no global state: the Ray Serve ingress
wraps it with ``@serve.ingress(app)``; the standalone server runs it under uvicorn on the loop
the backend runs on. Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, and vLLM's
``POST /tokenize``, ``POST /detokenize``, ``GET /version``. Request bodies are parsed by
:mod:`specray.serve.openai_schema` (which documents the API decisions), not by pydantic
(responses are made by :mod:`specray.serve.openai_responses`), so no
FastAPI 422 ever reaches a client: every error is OpenAI's ``{"error": {message, type, param,
code}}`` with the status of :mod:`specray.errors` (503 with ``Retry-After`` when retrying may
help), and an unexpected exception is logged here and answered with a generic 500.

Streams (``stream: true``) are server-sent events, ``data: {json}\\n\\n`` ending with
``data: [DONE]\\n\\n``. The response starts once every choice has produced its first event,
so a request the backend refuses (invalid, overloaded) still gets its own status code; an
error after that is sent as one ``data: {"error": ...}`` event that ends the stream (no
``[DONE]``: a consumer can tell a cut stream from a finished one). A client that disconnects,
streaming or not, has its backend requests closed, which aborts them and frees worker state.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specray import __version__
from specray.errors import RequestCancelledError, SpecrayError
from specray.serve.openai_responses import (
    StreamedChoice,
    chunk,
    error_body,
    response,
    usage_chunk,
)
from specray.serve.openai_schema import (
    ApiCall,
    HttpError,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from specray.serve.openai_structured import CONSTRAINT_FIELDS
from specray.serve.protocol import GenerateRequest, GenerationBackend

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20  # a request body larger than this is refused (413)
RETRY_AFTER_S = 1  # the Retry-After of a 503 (overloaded, unavailable)
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies: don't buffer
INTERNAL_ERROR = SpecrayError("internal server error")  # all a client learns of a bug


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote client text (a field name with a lone
    surrogate), and an error body must never fail to encode."""

    def render(self, content) -> bytes:
        text = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        return text.encode("ascii")


def error_response(error: SpecrayError, headers: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if error.retriable:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if error.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _AsciiJSONResponse(error_body(error), status_code=error.http_status, headers=headers)


# ---- request bodies ----------------------------------------------------------------------
def _is_json_type(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _too_large(limit_bytes: int) -> HttpError:
    return HttpError(413, f"the request body exceeds {limit_bytes} bytes")


async def read_json(request: Request, limit_bytes: int = MAX_BODY_BYTES):
    """The JSON body, refused early when too large (Content-Length, then bytes as they come).
    A body without a Content-Type is read as JSON (as FastAPI does); another type is 415."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json_type(content_type):
        raise HttpError(415, f"Content-Type must be application/json, got {content_type!r}")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit_bytes:
        raise _too_large(limit_bytes)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit_bytes:
            raise _too_large(limit_bytes)
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8; deep nesting
        raise HttpError(400, f"the request body is not valid JSON: {error}") from None


# ---- running the choices of one call ----------------------------------------------------
class Choices:
    """One call's backend requests, run concurrently; their events merge into one queue.

    Cancelling a request's task closes its event iterator, which aborts the request in the
    backend (the :class:`GenerationBackend` contract): :meth:`close` does so for every
    unfinished one."""

    def __init__(self, backend: GenerationBackend, requests: Sequence[GenerateRequest]):
        self.count = len(requests)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._pump(index, backend, request), name=request.request_id)
            for index, request in enumerate(requests)
        ]

    async def _pump(self, index: int, backend: GenerationBackend, request: GenerateRequest):
        events, finished = None, False
        try:
            events = backend.generate(request)
            async for event in events:
                self._queue.put_nowait((index, event, None))
                finished = event["kind"] == "final"
            if not finished:  # a broken backend must not leave the caller waiting forever
                raise SpecrayError(f"request {request.request_id} ended without a result")
        except Exception as error:
            self._queue.put_nowait((index, None, error))
        finally:
            if events is not None and hasattr(events, "aclose"):
                await events.aclose()  # already done unless iteration stopped early

    async def next(self) -> tuple[int, dict]:
        """The next event of any choice, as ``(index, event)``; a choice's error is raised."""
        index, event, error = await self._queue.get()
        if error is not None:
            raise error
        return index, event

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def _collect(choices: Choices) -> list[dict]:
    """Every choice's final event, in index order."""
    finals: list = [None] * choices.count
    pending = choices.count
    while pending:
        index, event = await choices.next()
        if event["kind"] == "final":
            finals[index], pending = event, pending - 1
    return finals


async def _first_events(choices: Choices) -> list[tuple[int, dict]]:
    """Events up to the first of every choice: admission errors surface before a stream."""
    buffered, started = [], set()
    while len(started) < choices.count:
        index, event = await choices.next()
        buffered.append((index, event))
        started.add(index)
    return buffered


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable):
    """``await work``, cancelled if the client disconnects first (its requests then abort)."""
    work = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work.cancel()  # a no-op once done; otherwise the client left (or we were cancelled)
    if not work.done() or work.cancelled():
        raise RequestCancelledError("the client disconnected")
    return work.result()


# ---- server-sent events ------------------------------------------------------------------
def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _event_stream(
    call: ApiCall,
    choices: Choices,
    buffered: list[tuple[int, dict]],
    echoes: Sequence[str] | None,
) -> AsyncIterator[str]:
    finals: list = [None] * choices.count
    streamed = [
        StreamedChoice(call, index, echoes[index] if echoes is not None else None)
        for index in range(choices.count)
    ]
    pending = choices.count
    try:
        if call.chat:  # OpenAI opens each chat choice with the role
            for index in range(choices.count):
                yield _sse(chunk(call, index, None))
        buffered = list(reversed(buffered))
        while pending:
            index, event = buffered.pop() if buffered else await choices.next()
            if event["kind"] == "final":
                finals[index], pending = event, pending - 1
            piece = streamed[index].chunk(event)
            if piece is not None:
                yield _sse(piece)
        if call.include_usage:
            yield _sse(usage_chunk(call, finals))
        yield "data: [DONE]\n\n"
    except SpecrayError as error:
        yield _sse(error_body(error))
    except Exception:
        log.exception("stream %s failed", call.id)
        yield _sse(error_body(INTERNAL_ERROR))
    finally:
        choices.close()


class _EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Sending failed or the client left: close the stream now (it aborts the
            # requests), not when the garbage collector finds it.
            await self.body_iterator.aclose()


# ---- the app -----------------------------------------------------------------------------
def _auth_check(auth_token: str | None) -> Callable[[Request], None]:
    expected = auth_token.encode() if auth_token is not None else None

    def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.strip().encode(), expected
        ):
            raise HttpError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                error_type="authentication_error",
                code="invalid_api_key",
            )

    return check


def build_http_app(backend: GenerationBackend, *, auth_token: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``backend``; with ``auth_token`` every route but
    ``/health`` requires ``Authorization: Bearer <auth_token>``."""
    app = FastAPI(title="specray", docs_url=None, redoc_url=None, openapi_url=None)
    check_auth = _auth_check(auth_token)
    started = int(time.time())
    info: dict = {}

    async def model_info() -> dict:
        if not info:  # served model, context length: fixed for the backend's lifetime
            info.update(await backend.model_info())
        return info

    def route(path: str, method: str, *, auth: bool = True):
        def register(handler: Callable[[Request], Awaitable[Response]]):
            async def endpoint(request: Request) -> Response:
                try:
                    if auth:
                        check_auth(request)
                    return await handler(request)
                except SpecrayError as error:
                    return error_response(error)
                except Exception:
                    log.exception("%s %s failed", request.method, request.url.path)
                    return error_response(INTERNAL_ERROR)

            app.add_api_route(path, endpoint, methods=[method], include_in_schema=False)
            return handler

        return register

    async def echoed_prompts(call: ApiCall) -> list[str] | None:
        """Each choice's prompt text when the call echoes it (token ids decoded, once the
        backend took them: an invalid id is the request's error, not detokenize's)."""
        if not call.echo:
            return None
        texts = []
        for choice in call.requests:
            if choice.prompt is not None:
                texts.append(choice.prompt)
            else:
                texts.append(await backend.detokenize(list(choice.prompt_token_ids)))
        return texts

    async def generate(request: Request, parse: Callable[..., ApiCall]) -> Response:
        body = await read_json(request)
        model = (await model_info())["model"]
        if isinstance(body, dict) and not body.keys() & CONSTRAINT_FIELDS:
            call = parse(body, model)  # nothing to compile: a thread's hop would cost more
        else:  # off the loop: compiling a structured output's grammar may take a second or more
            call = await asyncio.to_thread(parse, body, model)
        choices = Choices(backend, call.requests)
        if not call.stream:
            try:
                finals = await _unless_disconnected(request, _collect(choices))
            finally:
                choices.close()
            return JSONResponse(response(call, finals, await echoed_prompts(call)))
        try:
            buffered = await _unless_disconnected(request, _first_events(choices))
            echoes = await echoed_prompts(call)  # the prompts were admitted: they decode
        except BaseException:
            choices.close()
            raise
        stream = _event_stream(call, choices, buffered, echoes)
        return _EventStreamResponse(stream, headers=SSE_HEADERS)

    @route("/v1/completions", "POST")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    @route("/v1/chat/completions", "POST")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat)

    async def model_card() -> dict:
        served = await model_info()
        return {
            "id": served["model"],
            "object": "model",
            "created": started,
            "owned_by": "specray",
            "max_model_len": served.get("max_model_len") or None,
        }

    @route("/v1/models", "GET")
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [await model_card()]})

    @route("/v1/models/{model_id:path}", "GET")
    async def model(request: Request) -> Response:
        card, asked = await model_card(), request.path_params["model_id"]
        if asked != card["id"]:
            raise HttpError(
                404,
                f"the model {asked!r} does not exist; this server serves {card['id']!r}",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(card)

    @route("/tokenize", "POST")
    async def tokenize(request: Request) -> Response:
        served = await model_info()
        prompt = parse_tokenize(await read_json(request), served["model"])
        tokens = await backend.tokenize(prompt)
        limit = served.get("max_model_len") or None
        return JSONResponse({"count": len(tokens), "max_model_len": limit, "tokens": tokens})

    @route("/detokenize", "POST")
    async def detokenize(request: Request) -> Response:
        token_ids = parse_detokenize(await read_json(request), (await model_info())["model"])
        return JSONResponse({"prompt": await backend.detokenize(token_ids)})

    @route("/version", "GET", auth=False)
    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    @route("/health", "GET", auth=False)
    async def health(request: Request) -> Response:
        try:
            healthy = await backend.health()
        except Exception:
            log.exception("health check failed")
            healthy = False
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @route("/metrics", "GET")
    async def metrics(request: Request) -> Response:
        return Response(await backend.metrics_text(), media_type=METRICS_MEDIA_TYPE)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, error: StarletteHTTPException) -> Response:
        # Unknown routes (404) and methods (405), in OpenAI's shape.
        if error.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return error_response(HttpError(error.status_code, message), headers=error.headers)

    return app
