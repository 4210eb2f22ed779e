"""The gRPC front end without a model: proto -> GenerateRequest (unset means SamplingParams'
default), events -> stream messages -> the client's Completion, TLSConfig, and a real server
on loopback over a scripted backend (error mapping, health, bearer token)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specray.client import Client, SpecrayClientError
from specray.client.results import Chunk
from specray.errors import InvalidRequestError, OverloadedError
from specray.sampling import SamplingParams
from specray.serve.grpc_api import (
    SERVICE_NAME,
    TLSConfig,
    model_info_to_proto,
    request_from_proto,
    response_from_event,
    start_grpc_server,
)
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc


def test_unset_fields_are_the_sampling_defaults():
    request = request_from_proto(pb.GenerateRequest(text="hi"), timeout_s=None)
    assert request.prompt == "hi" and dict(request.params) == {}
    assert SamplingParams.from_dict(request.params) == SamplingParams()
    assert request.stop == () and request.num_speculative_tokens is None
    assert request.request_id is None and request.timeout_s is None


def test_set_fields_pass_through_zero_included():
    message = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[3, 4]),
        temperature=0,
        top_k=5,
        max_tokens=7,
        seed=0,
        logit_bias={2: -1.5},
        allowed_token_ids=pb.TokenIds(ids=[1, 2]),
        stop_token_ids=[9],
        stop=["\n"],
        num_speculative_tokens=0,
        request_id="r1",
    )
    request = request_from_proto(message, timeout_s=2.5)
    assert request.prompt_token_ids == (3, 4)
    assert dict(request.params) == {
        "temperature": 0.0,
        "top_k": 5,
        "max_tokens": 7,
        "seed": 0,
        "logit_bias": {2: -1.5},
        "allowed_token_ids": [1, 2],
        "stop_token_ids": [9],
    }
    assert request.stop == ("\n",) and request.num_speculative_tokens == 0
    assert (request.request_id, request.timeout_s) == ("r1", 2.5)
    chat = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hey")])
    )
    assert request_from_proto(chat, timeout_s=None).messages == (
        {"role": "user", "content": "hey"},
    )


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(text=""), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, -2])), "prompt"),
        (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
        (pb.GenerateRequest(text="hi", stop=[""]), "stop"),
    ],
)
def test_wire_level_problems_name_the_parameter(message, param):
    with pytest.raises(InvalidRequestError) as caught:
        request_from_proto(message, timeout_s=None)
    assert caught.value.param == param


def test_events_become_the_clients_chunks_and_completion():
    delta = response_from_event({"kind": "delta", "text": "Hi", "token_ids": [5]})
    assert Chunk.from_proto(delta) == Chunk("Hi", (5,))
    final = response_from_event(
        {
            "kind": "final",
            "request_id": "r",
            "text": "Hi there",
            "token_ids": [5, 6],
            "finish_reason": "length",
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "seed": 2**63 - 1,
            "speculative_decoding": {
                "num_drafts": 1,
                "num_draft_tokens": 2,
                "num_accepted_tokens": 1,
                "num_accepted_tokens_per_pos": [1, 0],
                "acceptance_rate": 0.5,
                "mean_acceptance_length": 2.0,
            },
            "time_to_first_token_s": 0.25,
            "latency_s": None,
        }
    )
    completion = Chunk.from_proto(final).completion
    assert completion.token_ids == (5, 6) and completion.seed == 2**63 - 1
    assert completion.speculative_decoding["num_accepted_tokens_per_pos"] == (1, 0)
    assert completion.speculative_decoding["acceptance_rate"] == 0.5
    assert (completion.time_to_first_token_s, completion.latency_s) == (0.25, None)
    with pytest.raises(ValueError, match="unknown event kind"):
        response_from_event({"kind": "progress"})
    info = model_info_to_proto(
        {"model": "m", "max_model_len": None, "vocab_size": 9, "draft": None}
    )
    assert (info.max_model_len, info.draft, info.num_speculative_tokens) == (0, "", 0)


def test_tls_config_reads_and_checks_pem(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(b"-----BEGIN CERTIFICATE-----\n...\n")
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nsecret\n")
    config = TLSConfig(cert, str(key))
    assert config.private_key.startswith(b"-----BEGIN") and not config.require_client_auth
    assert "secret" not in repr(config)
    assert TLSConfig(cert, key, client_ca=cert).require_client_auth
    with pytest.raises(ValueError, match="private_key is not PEM"):
        TLSConfig(cert, b"secret")
    with pytest.raises(ValueError, match="no file at"):
        TLSConfig(tmp_path / "missing.pem", key)


# ---- a real server over a scripted backend ----------------------------------------------------
class ScriptedBackend:
    """Generates "a", "b" then a final event, or raises what ``fail_with`` holds; ``healthy``
    is what health() answers. Records the requests it saw and the streams that were closed."""

    def __init__(self):
        self.fail_with: Exception | None = None
        self.healthy = True
        self.requests = []
        self.closed = 0

    async def generate(self, request):
        self.requests.append(request)
        try:
            if self.fail_with is not None:
                raise self.fail_with
            yield {"kind": "delta", "text": "a", "token_ids": [1]}
            yield {"kind": "delta", "text": "b", "token_ids": [2]}
            yield {
                "kind": "final", "request_id": "r", "text": "ab", "token_ids": [1, 2],
                "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 2, "seed": 3,
            }  # fmt: skip
        finally:
            self.closed += 1

    async def abort(self, request_id):
        return False

    async def model_info(self):
        raise RuntimeError("secret internal detail at /srv/model")

    async def health(self):
        return self.healthy


@pytest.fixture
def scripted():
    """``(backend, target, token_target)``: plaintext, and with bearer token "t0k"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(10)

    backend = ScriptedBackend()
    plain, port = run(start_grpc_server(backend, host="127.0.0.1", health_interval_s=0.05))
    secured, token_port = run(start_grpc_server(backend, host="127.0.0.1", auth_token="t0k"))
    yield backend, f"127.0.0.1:{port}", f"127.0.0.1:{token_port}"
    run(plain.stop(0))
    run(secured.stop(0))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_errors_map_to_their_status_and_never_leak_internals(scripted):
    backend, target, _ = scripted
    with Client(target, max_retries=0) as client:
        completion = client.generate("x", timeout=5)
        assert (completion.text, completion.token_ids, completion.seed) == ("ab", (1, 2), 3)
        assert backend.requests[-1].timeout_s is not None  # the deadline reached the backend
        backend.fail_with = OverloadedError("the queue is full (256 waiting)")
        with pytest.raises(SpecrayClientError) as caught:
            client.generate("x")
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert caught.value.message == "the queue is full (256 waiting)" and caught.value.retriable
        with pytest.raises(SpecrayClientError) as caught:
            client.model_info()
        assert caught.value.code == grpc.StatusCode.INTERNAL
        assert caught.value.message == "internal error"  # not the exception's text
    assert backend.requests[-1].timeout_s is None  # no deadline, none passed on


def test_complete_answers_with_the_final_alone_and_closes_the_events(scripted):
    backend, target, _ = scripted
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        final = stub.Complete(pb.GenerateRequest(text="x"), timeout=5)
        assert (final.text, list(final.token_ids), final.finish_reason) == ("ab", [1, 2], "length")
        assert backend.requests[-1].stream is False  # whole output only: no per-round deltas
        assert backend.closed == 1
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(pb.GenerateRequest(text=""), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "prompt must not be empty, got ''"
        backend.fail_with = OverloadedError("the queue is full (256 waiting)")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(pb.GenerateRequest(text="x"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_follows_the_backend(scripted):
    backend, target, _ = scripted
    with Client(target) as client, grpc.insecure_channel(target) as channel:
        assert client.health() is True
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        backend.healthy = False
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # polled
        assert client.health() is False
        watch.cancel()
        backend.healthy = True
        assert client.health() is True  # Check re-reads at once


def test_bearer_token_guards_streaming_and_unary_calls(scripted):
    _, _, target = scripted
    with Client(target, max_retries=0) as client:
        calls = (lambda: client.generate("x"), lambda: list(client.stream("x")))
        for call in (*calls, lambda: client.abort("r")):
            with pytest.raises(SpecrayClientError) as caught:
                call()
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert client.health() is True  # health needs no token
    with Client(target, token="t0k") as client:
        assert client.generate("x").text == "ab"
        assert client.abort("r") is False
