"""The client library on its own: retries (against a real gRPC server on loopback whose tiny
servicer fails on cue), request building, configuration checks, and that it imports without
torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from specray.client import (
    AsyncClient,
    Chunk,
    Client,
    ClientConfig,
    Completion,
    RetryPolicy,
    SpecrayClientError,
    StructuredOutputs,
    TokenLogprob,
)
from specray.client.requests import build_request
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02)


class FlakyServicer(generation_pb2_grpc.GenerationServicer):
    """GetModelInfo: UNAVAILABLE ``failures`` times, then an answer. Generate: one delta, then
    UNAVAILABLE (after ``delta_first``) or UNAVAILABLE at once. Abort: INVALID_ARGUMENT."""

    def __init__(self, failures: int, *, delta_first: bool = False):
        self.failures = failures
        self.delta_first = delta_first
        self.calls = Counter()

    def GetModelInfo(self, request, context):
        self.calls["GetModelInfo"] += 1
        if self.calls["GetModelInfo"] <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return pb.ModelInfo(model="flaky", vocab_size=7)

    def Generate(self, request, context):
        self.calls["Generate"] += 1
        if self.delta_first:
            yield pb.GenerateResponse(delta=pb.Delta(text="a", token_ids=[1]))
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    def Abort(self, request, context):
        self.calls["Abort"] += 1
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")


@pytest.fixture
def flaky():
    """Start a loopback server around a servicer: ``flaky(servicer) -> target``."""
    servers = []

    def start(servicer: FlakyServicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


# ---- retries --------------------------------------------------------------------------------
def test_unary_calls_retry_unavailable_with_backoff(flaky):
    servicer = FlakyServicer(failures=2)
    with Client(flaky(servicer), retry=FAST) as client:
        assert client.model_info().model == "flaky"
    assert servicer.calls["GetModelInfo"] == 3  # two UNAVAILABLE, then the answer

    servicer = FlakyServicer(failures=2)
    client = Client(flaky(servicer), retry=FAST, max_retries=1)
    with client, pytest.raises(SpecrayClientError) as caught:
        client.model_info()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.retriable
    assert caught.value.message == "warming up"
    assert servicer.calls["GetModelInfo"] == 2  # the first try and one retry


def test_async_unary_calls_retry_too(flaky):
    servicer = FlakyServicer(failures=2)
    target = flaky(servicer)

    async def ask():
        async with AsyncClient(target, retry=FAST) as client:
            return await client.model_info()

    assert asyncio.run(ask()).vocab_size == 7
    assert servicer.calls["GetModelInfo"] == 3


def test_other_codes_are_not_retried(flaky):
    servicer = FlakyServicer(failures=0)
    client = Client(flaky(servicer), retry=FAST)
    with client, pytest.raises(SpecrayClientError) as caught:
        client.abort("x")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and not caught.value.retriable
    assert servicer.calls["Abort"] == 1


def test_generate_is_retried_only_before_its_first_chunk(flaky):
    # UNAVAILABLE at once: nothing was delivered, so the call is retried (5 retries allowed).
    servicer = FlakyServicer(failures=0)
    target = flaky(servicer)
    with Client(target, retry=FAST, max_retries=5) as client:
        with pytest.raises(SpecrayClientError) as caught:
            client.generate(prompt="hi")
        assert client.generate_retries == 5
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["Generate"] == 6

    # UNAVAILABLE after a delta: a retry could duplicate output, so none.
    servicer = FlakyServicer(failures=0, delta_first=True)
    target = flaky(servicer)
    with Client(target, retry=FAST, max_retries=5) as client:
        chunks = []
        with pytest.raises(SpecrayClientError):
            for chunk in client.stream(prompt="hi"):
                chunks.append(chunk)
        assert client.generate_retries == 0
    assert len(chunks) == 1 and servicer.calls["Generate"] == 1

    async def generate(delta_first: bool) -> int:
        async with AsyncClient(
            flaky(FlakyServicer(0, delta_first=delta_first)), retry=FAST, max_retries=2
        ) as client:
            with pytest.raises(SpecrayClientError):
                await client.generate(prompt="hi")
            return client.generate_retries

    assert asyncio.run(generate(False)) == 2
    assert asyncio.run(generate(True)) == 0


class CompletingServicer(FlakyServicer):
    """FlakyServicer with ``Complete``: UNAVAILABLE ``failures`` times, then a Final."""

    def Complete(self, request, context):
        self.calls["Complete"] += 1
        if self.calls["Complete"] <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        return pb.Final(request_id="r", text="ok", token_ids=[5], finish_reason="length")


def test_generate_calls_complete_and_retries_it_on_unavailable(flaky):
    servicer = CompletingServicer(failures=2)
    with Client(flaky(servicer), retry=FAST) as client:
        assert client.generate(prompt="hi").text == "ok"
        assert client.generate_retries == 2
    assert servicer.calls == Counter(Complete=3)  # the stream was not used

    async def generate() -> tuple[str, int]:
        async with AsyncClient(flaky(CompletingServicer(failures=1)), retry=FAST) as client:
            return (await client.generate(prompt="hi")).text, client.generate_retries

    assert asyncio.run(generate()) == ("ok", 1)


class ServicerWithoutComplete(FlakyServicer):
    """A server from before ``Complete``: the status gRPC answers for an unknown method."""

    def Complete(self, request, context):
        self.calls["Complete"] += 1
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


def test_generate_falls_back_to_the_stream_on_a_server_without_complete(flaky):
    servicer = ServicerWithoutComplete(failures=0, delta_first=True)
    with Client(flaky(servicer), retry=FAST, max_retries=0) as client:
        for _ in range(2):
            with pytest.raises(SpecrayClientError) as caught:
                client.generate(prompt="hi")
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE  # Generate's own failure
    # Complete was refused once; from then on the client went straight to the stream.
    assert servicer.calls == Counter(Complete=1, Generate=2)


def test_the_timeout_bounds_retries_and_their_delays(flaky):
    servicer = FlakyServicer(failures=100)
    slow = RetryPolicy(max_retries=50, initial_backoff_s=0.2, max_backoff_s=0.2, jitter=0)
    with Client(flaky(servicer), retry=slow) as client:
        started = time.monotonic()
        with pytest.raises(SpecrayClientError) as caught:
            client.model_info(timeout=0.5)
        elapsed_s = time.monotonic() - started
    # Tries at about 0, 0.2 and 0.4 s; a slow machine may fit only two, or see the deadline
    # pass during the last. Without the bound, 50 retries would take 10 s.
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed_s < 1.0 and 2 <= servicer.calls["GetModelInfo"] <= 3


def test_backoff_policy_worked_example():
    policy = RetryPolicy()  # 0.1 s doubling, capped at 2 s, up to half taken off at random
    assert policy.backoff_s(2, uniform=0.0) == pytest.approx(0.4)
    assert policy.backoff_s(2, uniform=0.5) == pytest.approx(0.3)
    assert policy.backoff_s(10, uniform=0.0) == pytest.approx(2.0)
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert policy.next_delay_s(0, unavailable, None, 0.0) == pytest.approx(0.1)
    assert policy.next_delay_s(3, unavailable, None, 0.0) is None  # retries used up
    assert policy.next_delay_s(0, unavailable, 0.05, 0.0) is None  # would pass the deadline
    assert policy.next_delay_s(0, grpc.StatusCode.RESOURCE_EXHAUSTED, None, 0.0) is None
    with pytest.raises(ValueError, match="max_retries must be >= 0, got -1"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="jitter must be in"):
        RetryPolicy(jitter=2)


# ---- requests and configuration -------------------------------------------------------------
def test_requests_leave_unset_options_unset():
    request = build_request("hi", None, None, {"temperature": 0, "seed": None, "stop": "x"})
    assert request.text == "hi" and request.HasField("temperature") and request.temperature == 0
    assert not request.HasField("seed") and not request.HasField("max_tokens")
    assert list(request.stop) == ["x"]
    request = build_request(None, None, [], {"allowed_token_ids": []})
    assert request.HasField("token_ids") and request.HasField("allowed_token_ids")  # sent empty


def test_logprob_options_are_sent_and_results_typed():
    request = build_request(
        "hi", None, None, {"logprobs": 0, "prompt_logprobs": 2, "logprobs_mode": "processed"}
    )
    assert request.HasField("logprobs") and request.logprobs == 0  # 0 is asked: own only
    assert request.prompt_logprobs == 2 and request.logprobs_mode == "processed"
    assert not build_request("hi", None, None, {}).HasField("logprobs")
    entry = pb.TokenLogprob(
        token_id=5, logprob=-0.5, rank=1, top_token_ids=[5, 7], top_logprobs=[-0.5, -1.5]
    )
    completion = Completion.from_proto(
        pb.Final(token_ids=[5], logprobs=[entry], prompt_logprobs=[entry])
    )
    assert completion.logprobs == (TokenLogprob(5, -0.5, 1, (5, 7), (-0.5, -1.5)),)
    assert completion.prompt_logprobs == (None, *completion.logprobs)  # vLLM's: None first
    unasked = Completion.from_proto(pb.Final(token_ids=[5]))
    assert unasked.logprobs is None and unasked.prompt_logprobs is None
    delta = pb.Delta(text="a", token_ids=[5], logprobs=[entry])
    assert Chunk.from_proto(pb.GenerateResponse(delta=delta)).logprobs == completion.logprobs


def test_structured_outputs_are_sent_as_a_pair():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    request = build_request(
        "hi", None, None, {"structured_outputs": StructuredOutputs.json(schema)}
    )
    assert request.HasField("structured_outputs")
    assert (request.structured_outputs.kind, json.loads(request.structured_outputs.spec)) == (
        "json",
        schema,
    )
    plain = build_request("hi", None, None, {"structured_outputs": ("regex", "[ab]+")})
    assert (plain.structured_outputs.kind, plain.structured_outputs.spec) == ("regex", "[ab]+")
    assert StructuredOutputs.choice(["a", "b"]) == ("choice", '["a", "b"]')
    assert not build_request("hi", None, None, {}).HasField("structured_outputs")
    for bad in ("regex", ("regex",), ("regex", 3), {"regex": "a"}):
        with pytest.raises(SpecrayClientError, match="structured_outputs"):
            build_request("hi", None, None, {"structured_outputs": bad})


@pytest.mark.parametrize(
    ("prompt", "messages", "ids", "options", "named"),
    [
        (None, None, None, {}, "exactly one of prompt"),
        ("hi", None, [1], {}, "exactly one of prompt"),
        ("hi", None, None, {"temprature": 1.0}, "temprature"),
        ("hi", None, None, {"temperature": "hot"}, "temperature"),
        ("hi", None, None, {"seed": -1}, "seed"),
        ("hi", None, None, {"logprobs": -1}, "logprobs"),
        (None, None, ["a"], {}, "prompt_token_ids"),
        (None, [{"role": "user"}], None, {}, "messages[0]"),
    ],
)
def test_malformed_requests_fail_before_sending(prompt, messages, ids, options, named):
    with pytest.raises(SpecrayClientError) as caught:
        build_request(prompt, messages, ids, options)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and named in caught.value.message


def test_client_config_is_validated():
    assert ClientConfig("localhost:1").tls is False
    assert ClientConfig("localhost:1", server_name="x").tls is True  # a TLS option means TLS
    with pytest.raises(ValueError, match="client_cert and client_key"):
        ClientConfig("localhost:1", client_cert=b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(ValueError, match="tls=False contradicts"):
        ClientConfig("localhost:1", tls=False, server_name="x")
    with pytest.raises(ValueError, match="root_certificates is not PEM") as caught:
        ClientConfig("localhost:1", root_certificates=b"secret")
    assert "secret" not in str(caught.value)
    with pytest.raises(ValueError, match="no file at"):
        ClientConfig("localhost:1", root_certificates="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="token must be a non-empty string"):
        ClientConfig("localhost:1", token="two words")
    assert "hunter2" not in repr(ClientConfig("localhost:1", token="hunter2"))


def test_the_client_and_the_grpc_front_end_import_without_torch():
    code = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
import specray.client
from specray.client import Client, SpecrayClientError
with Client("127.0.0.1:1", max_retries=0) as client:
    try:
        client.health(timeout=2)
    except SpecrayClientError as error:
        assert error.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), error
import specray.serve.grpc_api  # the gRPC front end needs no torch either (a Serve ingress)
heavy = [name for name in ("torch", "transformers", "ray") if sys.modules.get(name) is not None]
assert not heavy, heavy
import specray
try:
    specray.Engine
except ImportError:
    print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_serve_app_builds_and_validates_its_config_without_torch():
    """The Serve controller builds the app and the coordinator replicas run on configs alone:
    neither imports torch or transformers (seconds of CPU per process at start)."""
    code = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
from specray.serve.app import build_app
from specray.serve.config import AppArgs
args = AppArgs(target="default", draft="ngram", num_speculative_tokens=3)
build_app(args)
heavy = [name for name in ("torch", "transformers") if sys.modules.get(name) is not None]
assert not heavy, heavy
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
