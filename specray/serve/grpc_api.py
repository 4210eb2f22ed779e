"""The public gRPC API (``specray.v1.Generation``) in front of a :class:`GenerationBackend`.

:class:`GenerationServicer` translates protobuf <-> :class:`GenerateRequest` and backend events,
and :class:`SpecrayError` <-> gRPC status (the error's ``grpc_code`` and message, never a stack
trace). :func:`start_grpc_server` serves it with the standard health service, server
reflection (v1 and v1alpha), message-size limits, optional TLS / mTLS and an optional bearer token.

Deadlines and cancellation reach the backend: the RPC's remaining time becomes the request's
``timeout_s``, and when the client cancels (or the deadline passes) the backend's event
iterator is closed, which aborts the request and frees its worker state.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from specray.client.config import PemSource, check_token, read_pem
from specray.errors import DeadlineExceededError, InvalidRequestError, SpecrayError
from specray.serve.protocol import GenerateRequest, GenerationBackend, check_grammar_params
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "specray.v1.Generation"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"  # served beside grpc.reflection.v1alpha
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # gRPC's default receive limit is 4 MiB
DEFAULT_HEALTH_INTERVAL_S = 1.0  # how often Watch subscribers see backend.health() re-read
HEALTH_CHECK_TIMEOUT_S = 5.0  # a backend.health() call slower than this counts as unhealthy

# SamplingParams fields whose proto zero value equals the default: sent only when non-zero.
_PLAIN_PARAMS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "min_tokens",
    "logprobs_mode",
)
# `optional` proto fields: sent only when set, so unset means SamplingParams' default.
_OPTIONAL_PARAMS = (
    "temperature",
    "top_p",
    "repetition_penalty",
    "max_tokens",
    "seed",
    "logprobs",
    "prompt_logprobs",
)


# ---- protobuf <-> protocol ------------------------------------------------------------------
def request_from_proto(
    message: pb.GenerateRequest, *, timeout_s: float | None, final_only: bool = False
) -> GenerateRequest:
    """The backend's request; wire-level problems (no prompt, an empty one, negative token ids)
    are rejected here, the rest by :class:`GenerateRequest` and the backend. ``final_only``:
    the caller takes the whole output only, whatever the message says (``Complete``)."""
    prompt = prompt_token_ids = messages = None
    which = message.WhichOneof("prompt")
    if which is None:
        raise InvalidRequestError(
            "prompt must be set: one of text, token_ids or messages", param="prompt"
        )
    if which == "text":
        if not message.text:
            raise InvalidRequestError("prompt must not be empty, got ''", param="prompt")
        prompt = message.text
    elif which == "token_ids":
        prompt_token_ids = tuple(message.token_ids.ids)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt token_ids must not be empty, got []", param="prompt")
        negative = [t for t in prompt_token_ids if t < 0]
        if negative:
            raise InvalidRequestError(
                f"prompt token ids must be >= 0, got {negative[0]}", param="prompt"
            )
    else:
        messages = tuple({"role": m.role, "content": m.content} for m in message.messages.messages)
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
    params: dict = {
        name: getattr(message, name) for name in _PLAIN_PARAMS if getattr(message, name)
    }
    params |= {name: getattr(message, name) for name in _OPTIONAL_PARAMS if message.HasField(name)}
    if message.logit_bias:
        params["logit_bias"] = dict(message.logit_bias)
    if message.HasField("allowed_token_ids"):
        params["allowed_token_ids"] = list(message.allowed_token_ids.ids)
    for name in ("banned_token_ids", "stop_token_ids"):
        if getattr(message, name):
            params[name] = list(getattr(message, name))
    if message.HasField("structured_outputs"):  # checked by SamplingParams, compiled at admission
        check_grammar_params(params, "structured_outputs")
        grammar = message.structured_outputs
        params["structured_outputs"] = (grammar.kind, grammar.spec)
    return GenerateRequest(
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        params=params,
        stop=tuple(message.stop),
        num_speculative_tokens=message.num_speculative_tokens
        if message.HasField("num_speculative_tokens")
        else None,
        speculation=message.speculation or "auto",
        request_id=message.request_id or None,
        timeout_s=timeout_s,
        stream=not (final_only or message.final_only),
    )


def logprobs_to_proto(entries) -> list[pb.TokenLogprob]:
    """Events' log-probability entries as messages (the first prompt token's, which has
    none, is left out: ``Final.prompt_logprobs`` starts at the second)."""
    return [
        pb.TokenLogprob(
            token_id=entry["token_id"],
            logprob=entry["logprob"],
            rank=entry["rank"],
            top_token_ids=[top["token_id"] for top in entry["top"]],
            top_logprobs=[top["logprob"] for top in entry["top"]],
        )
        for entry in entries or ()
        if entry["logprob"] is not None
    ]


def response_from_event(event: dict) -> pb.GenerateResponse:
    """One backend event (see :mod:`specray.serve.protocol`) as a stream message."""
    kind = event.get("kind")
    if kind == "delta":
        delta = pb.Delta(
            text=event["text"],
            token_ids=event["token_ids"],
            logprobs=logprobs_to_proto(event.get("logprobs")),
        )
        return pb.GenerateResponse(delta=delta)
    if kind != "final":
        raise ValueError(f"unknown event kind {kind!r}")
    return pb.GenerateResponse(final=final_from_event(event))


def final_from_event(event: dict) -> pb.Final:
    """A backend's final event as the ``Final`` message."""
    spec = event.get("speculative_decoding") or {}
    per_position = spec.get("num_accepted_tokens_per_pos", spec.get("accepted_per_position", ()))
    final = pb.Final(
        request_id=event["request_id"],
        text=event["text"],
        token_ids=event["token_ids"],
        finish_reason=event["finish_reason"],
        prompt_tokens=event["prompt_tokens"],
        completion_tokens=event["completion_tokens"],
        seed=event["seed"],
        speculative_decoding=pb.SpeculativeDecoding(
            num_drafts=spec.get("num_drafts", 0),
            num_draft_tokens=spec.get("num_draft_tokens", 0),
            num_accepted_tokens=spec.get("num_accepted_tokens", 0),
            num_accepted_tokens_per_pos=per_position,
            acceptance_rate=spec.get("acceptance_rate", 0.0),
            mean_acceptance_length=spec.get("mean_acceptance_length", 1.0),
        ),
        logprobs=logprobs_to_proto(event.get("logprobs")),
        prompt_logprobs=logprobs_to_proto(event.get("prompt_logprobs")),
    )
    for name in ("time_to_first_token_s", "latency_s"):
        if event.get(name) is not None:
            setattr(final, name, event[name])
    return final


def model_info_to_proto(info: dict) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info["model"],
        max_model_len=info.get("max_model_len") or 0,
        vocab_size=info["vocab_size"],
        draft=info.get("draft") or "",
        num_speculative_tokens=info.get("num_speculative_tokens") or 0,
        eos_token_ids=info.get("eos_token_ids") or (),
    )


def _time_remaining_s(context: grpc.aio.ServicerContext) -> float | None:
    """The RPC's deadline from now (None without one); a passed deadline is an error."""
    remaining = context.time_remaining()
    if remaining is None or not math.isfinite(remaining):
        return None
    if remaining <= 0:
        raise DeadlineExceededError("the request's deadline passed before it started")
    return remaining


# ---- the servicer ---------------------------------------------------------------------------
async def _abort(context: grpc.aio.ServicerContext, error: SpecrayError) -> None:
    code = getattr(grpc.StatusCode, error.grpc_code, grpc.StatusCode.INTERNAL)
    message, param = error.message, error.param
    if param and param not in message:  # a status has no param field: the message names it
        message = f"{param}: {message}"
    await context.abort(code, message)


def _internal(method: str) -> SpecrayError:
    logger.exception("%s failed", method)  # the trace stays in the server's log
    return SpecrayError("internal error")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """``specray.v1.Generation`` over a backend; every failure becomes a gRPC status."""

    def __init__(self, backend: GenerationBackend):
        self._backend = backend

    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        events: AsyncIterator[dict] | None = None
        try:
            generate_request = request_from_proto(request, timeout_s=_time_remaining_s(context))
            events = self._backend.generate(generate_request)
            async for event in events:
                if request.final_only and event.get("kind") != "final":
                    continue
                await context.write(response_from_event(event))
            return
        except SpecrayError as error:
            failure = error
        except Exception:
            failure = _internal("Generate")
        finally:
            # Cancelled, past the deadline, or failed: closing the events aborts the request.
            if events is not None and hasattr(events, "aclose"):
                await events.aclose()
        await _abort(context, failure)

    async def Complete(self, request: pb.GenerateRequest, context) -> pb.Final:
        events: AsyncIterator[dict] | None = None
        try:
            generate_request = request_from_proto(
                request, timeout_s=_time_remaining_s(context), final_only=True
            )
            events = self._backend.generate(generate_request)
            async for event in events:
                if event.get("kind") == "final":
                    return final_from_event(event)
            logger.error("Complete: the backend's events ended without the final one")
            failure = SpecrayError("internal error")
        except SpecrayError as error:
            failure = error
        except Exception:
            failure = _internal("Complete")
        finally:
            if events is not None and hasattr(events, "aclose"):
                await events.aclose()
        await _abort(context, failure)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        try:
            return model_info_to_proto(await self._backend.model_info())
        except SpecrayError as error:
            failure = error
        except Exception:
            failure = _internal("GetModelInfo")
        await _abort(context, failure)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidRequestError("request_id must not be empty", param="request_id")
            return pb.AbortResponse(aborted=bool(await self._backend.abort(request.request_id)))
        except SpecrayError as error:
            failure = error
        except Exception:
            failure = _internal("Abort")
        await _abort(context, failure)


# ---- health, auth, TLS ----------------------------------------------------------------------
class BackendHealthServicer(health_aio.HealthServicer):
    """grpc.health.v1 for the overall server ("") and ``specray.v1.Generation``: SERVING while
    ``backend.health()`` is true. ``Check`` re-reads it on every call; ``Watch`` subscribers see
    the changes :meth:`poll` finds."""

    SERVICES = ("", SERVICE_NAME)

    def __init__(self, backend: GenerationBackend):
        super().__init__()
        self._backend = backend
        self.poller: asyncio.Task | None = None  # held here: the loop keeps only weak refs

    async def refresh(self) -> bool:
        try:
            serving = bool(
                await asyncio.wait_for(self._backend.health(), timeout=HEALTH_CHECK_TIMEOUT_S)
            )
        except Exception:
            logger.warning("backend health check failed", exc_info=True)
            serving = False
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in self.SERVICES:
            await self.set(service, status)
        return serving

    async def Check(self, request, context):
        if request.service in self.SERVICES:
            await self.refresh()
        return await super().Check(request, context)

    async def poll(self, server: grpc.aio.Server, interval_s: float) -> None:
        """Re-read the backend's health every ``interval_s`` until the server stops."""
        # wait_for_termination returns True when it timed out (the server still runs).
        while await server.wait_for_termination(timeout=interval_s):
            await self.refresh()


def _rejecting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that fails with UNAUTHENTICATED."""

    async def reject(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        reject,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata on every call except the health
    service's: load balancers and orchestrators probe health without credentials, and health
    reveals nothing but SERVING / NOT_SERVING. Reflection does need the token."""

    def __init__(self, token: str):
        check_token("auth_token", token)
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self._expected):  # constant time: no timing oracle
            return handler
        reason = "invalid bearer token" if given else "missing 'authorization: Bearer' metadata"
        return _rejecting_handler(handler, reason)


_MALFORMED = object()  # what a request deserializer returns for bytes it cannot parse


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as a unary method's request get INVALID_ARGUMENT naming the
    method, not gRPC's default UNKNOWN that quotes protobuf's exception class and text."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method
        message = f"the request is not a valid {method} request message"

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception:  # protobuf's DecodeError
                return _MALFORMED

        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behavior):  # a streaming method that yields

            async def checked(request, context):
                if request is _MALFORMED:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                async for response in behavior(request, context):
                    yield response

        else:  # a unary method, or a streaming one that calls context.write

            async def checked(request, context):
                if request is _MALFORMED:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                return await behavior(request, context)

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            checked,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS: certificate chain and key; with ``client_ca``, mutual TLS (clients must
    present a certificate signed by that CA). Paths are read once, when the config is made."""

    cert_chain: PemSource  # the server's certificate chain (PEM)
    private_key: PemSource = field(repr=False)  # its private key (PEM); never printed
    client_ca: PemSource | None = None  # set: require client certificates signed by it

    def __post_init__(self) -> None:
        for name in ("cert_chain", "private_key", "client_ca"):
            source = getattr(self, name)
            if source is not None:
                object.__setattr__(self, name, read_pem(name, source))

    @property
    def require_client_auth(self) -> bool:
        return self.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.require_client_auth,
        )


# ---- the server -----------------------------------------------------------------------------
def _add_reflection_v1(service_names, server) -> None:
    """Server reflection v1 beside v1alpha (clients such as grpcurl ask v1 first). The two
    protocols differ only in their package name: the same messages, field for field, so the
    v1 method is served by the v1alpha servicer with v1alpha's message classes."""
    servicer = reflection.aio.ReflectionServicer(service_names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handler = grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method})
    server.add_generic_rpc_handlers((handler,))


async def start_grpc_server(
    backend: GenerationBackend,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    tls: TLSConfig | None = None,
    auth_token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
) -> tuple[grpc.aio.Server, int]:
    """Serve ``backend`` on ``host:port`` (0: any free port) and return ``(server, bound_port)``.

    Call on the event loop the backend lives on; stop with ``await server.stop(grace_s)``.
    Without ``tls`` the port is plaintext: keep it (and any ``auth_token`` sent over it) on a
    trusted network or loopback.
    """
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    if tls is not None and not isinstance(tls, TLSConfig):
        raise ValueError(f"tls must be a TLSConfig or None, got {type(tls).__name__}")
    if auth_token is not None:
        check_token("auth_token", auth_token)
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise ValueError(f"max_message_bytes must be an integer, got {max_message_bytes!r}")
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
    if not (isinstance(health_interval_s, (int, float)) and health_interval_s > 0):
        raise ValueError(f"health_interval_s must be > 0, got {health_interval_s!r}")

    server = grpc.aio.server(
        # The malformed-bytes check wraps whatever the token check returns (it runs first).
        interceptors=[MalformedRequestInterceptor()]
        + ([BearerTokenInterceptor(auth_token)] if auth_token is not None else []),
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ],
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(backend), server)
    health = BackendHealthServicer(backend)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    served = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
        REFLECTION_V1,
    )
    reflection.enable_server_reflection(served, server)
    _add_reflection_v1(served, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if tls is not None:
        bound_port = server.add_secure_port(address, tls.server_credentials())
    else:
        bound_port = server.add_insecure_port(address)
    await health.refresh()
    await server.start()
    health.poller = asyncio.create_task(health.poll(server, health_interval_s))
    return server, bound_port
