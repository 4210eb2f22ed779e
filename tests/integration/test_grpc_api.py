"""The public gRPC API end to end: the client library against ``start_grpc_server`` over a real
:class:`LocalBackend` (coordinator plus in-process target and draft workers) on loopback.

The servers run on an event loop of their own thread, as a deployment's would; the blocking
client calls from the test thread and the asyncio client runs on a second loop thread (one loop
for the whole module: gRPC's asyncio poller may still deliver a late event to a loop, so the
tests never close one under it).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import specray
from specray.client import (
    AsyncClient,
    Client,
    SpecrayClientError,
    StructuredOutputs,
    TokenLogprob,
)
from specray.engine_core.coordinator import CoordinatorConfig
from specray.serve.grpc_api import REFLECTION_V1, SERVICE_NAME, TLSConfig, start_grpc_server
from specray.serve.service import LocalBackend
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc
from tests.helpers.tiny_models import save_tiny_chat_pair

MAX_POSITIONS = 1024  # room for long generations: an abort must land while one runs
NUM_SPECULATIVE_TOKENS = 4
PROMPT_IDS = [28, 1048, 314, 5248, 29]
CHAT = [{"role": "user", "content": "Name three colours."}]
TOKEN = "s3cret-token"


class LoopThread:
    """An event loop on a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout_s: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def client_loop():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("chat"), max_positions=MAX_POSITIONS)


# ---- certificates ------------------------------------------------------------------------------
def _certificates(folder):
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, as PEM
    files under ``folder``: {"ca", "server_cert", "server_key", "client_cert", "client_key"}."""
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def issue(subject, key, issuer, issuer_key, *, ca=False, san=None, usage=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(file_name: str, data: bytes) -> str:
        path = folder / file_name
        path.write_bytes(data)
        return str(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    pem = serialization.Encoding.PEM
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = issue(name("specray test CA"), ca_key, name("specray test CA"), ca_key, ca=True)
    server = issue(
        name("localhost"), server_key, ca.subject, ca_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
    )  # fmt: skip
    client = issue(
        name("client"), client_key, ca.subject, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    return {
        "ca": write("ca.pem", ca.public_bytes(pem)),
        "server_cert": write("server.pem", server.public_bytes(pem)),
        "server_key": write("server.key", key_pem(server_key)),
        "client_cert": write("client.pem", client.public_bytes(pem)),
        "client_key": write("client.key", key_pem(client_key)),
    }


# ---- servers -----------------------------------------------------------------------------------
class Served:
    """One backend behind three servers: plaintext, TLS + token, mutual TLS."""

    def __init__(self, target_dir: str, draft_dir: str, certs: dict):
        self.loop = LoopThread()
        self.certs = certs
        self.backend = self.loop.run(
            LocalBackend.start(
                target_dir,
                draft_dir,
                model_name="tiny",
                config=CoordinatorConfig(
                    num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
                    adaptive_k=False,  # always speculate: the metrics below are non-zero
                    num_micro_batches=1,
                ),
            )
        )
        tls = TLSConfig(certs["server_cert"], certs["server_key"])
        mtls = TLSConfig(certs["server_cert"], certs["server_key"], client_ca=certs["ca"])
        self.servers = []
        self.port = self._start(host="127.0.0.1")
        self.tls_port = self._start(host="127.0.0.1", tls=tls, auth_token=TOKEN)
        self.mtls_port = self._start(host="127.0.0.1", tls=mtls)

    def _start(self, **options) -> int:
        server, port = self.loop.run(start_grpc_server(self.backend, **options))
        self.servers.append(server)
        return port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def in_flight(self, request_id: str) -> bool:
        return self.backend.engine.output_so_far(request_id) is not None

    def wait_released(self, request_id: str, timeout_s: float = 2.0) -> None:
        """Wait until the coordinator no longer holds ``request_id`` (its workers freed it);
        a 900-token generation takes seconds, so a quick release is the abort's doing."""
        end = time.monotonic() + timeout_s
        while self.in_flight(request_id):
            assert time.monotonic() < end, f"request {request_id} still in flight"
            time.sleep(0.02)

    def close(self) -> None:
        for server in self.servers:
            self.loop.run(server.stop(0))
        self.loop.run(self.backend.stop(drain=False))
        self.loop.close()


@pytest.fixture(scope="module")
def served(tiny_chat, tmp_path_factory):
    target_dir, draft_dir = tiny_chat
    served = Served(target_dir, draft_dir, _certificates(tmp_path_factory.mktemp("certs")))
    yield served
    served.close()


@pytest.fixture(scope="module")
def engine_greedy(tiny_chat):
    """The offline engine's greedy outputs (the oracle): token ids and chat token ids."""
    target_dir, draft_dir = tiny_chat
    engine = specray.Engine(target_dir, draft_dir, NUM_SPECULATIVE_TOKENS)
    params = specray.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine.generate([PROMPT_IDS], params)[0]
    chat = engine.generate([CHAT[0]["content"]], params)[0]  # one user turn, chat template
    return plain.token_ids, chat.token_ids


# ---- generation --------------------------------------------------------------------------------
def test_streamed_greedy_output_equals_the_engine(served, engine_greedy, client_loop):
    expected_plain, expected_chat = engine_greedy
    with Client(served.target) as client:
        chunks = list(
            client.stream(
                prompt_token_ids=PROMPT_IDS, temperature=0, max_tokens=24, ignore_eos=True
            )
        )
    completion = chunks[-1].completion
    assert completion is not None and all(chunk.completion is None for chunk in chunks[:-1])
    streamed = [token_id for chunk in chunks for token_id in chunk.token_ids]
    assert list(completion.token_ids) == streamed == expected_plain
    assert completion.text == "".join(chunk.text for chunk in chunks)
    assert completion.finish_reason == "length"
    assert (completion.prompt_tokens, completion.completion_tokens) == (len(PROMPT_IDS), 24)
    assert completion.usage["total_tokens"] == len(PROMPT_IDS) + 24
    spec = completion.speculative_decoding
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert len(spec["num_accepted_tokens_per_pos"]) <= NUM_SPECULATIVE_TOKENS
    assert 0 < completion.time_to_first_token_s <= completion.latency_s

    async def chat():
        async with AsyncClient(served.target) as client:
            chunks = [
                chunk
                async for chunk in client.stream(
                    messages=CHAT, temperature=0, max_tokens=24, ignore_eos=True
                )
            ]
            again = await client.generate(
                messages=CHAT, temperature=0, max_tokens=24, ignore_eos=True
            )
            return chunks, again

    chunks, again = client_loop.run(chat())
    assert list(chunks[-1].completion.token_ids) == list(again.token_ids) == expected_chat
    assert [t for chunk in chunks for t in chunk.token_ids] == expected_chat


def test_final_only_sends_the_final_message_alone(served, engine_greedy):
    """``final_only`` (what ``Client.generate`` sets): one Final message with the whole output,
    no Delta; without it the same request streams its deltas."""
    expected_plain, _ = engine_greedy
    fields = dict(max_tokens=24, ignore_eos=True, temperature=0.0)
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT_IDS), **fields)
        streamed = list(stub.Generate(request, timeout=120))
        request.final_only = True
        alone = list(stub.Generate(request, timeout=120))
    assert [r.WhichOneof("event") for r in alone] == ["final"]
    assert list(alone[0].final.token_ids) == expected_plain
    assert [r.WhichOneof("event") for r in streamed[:-1]] == ["delta"] * (len(streamed) - 1)
    assert len(streamed) > 2 and list(streamed[-1].final.token_ids) == expected_plain
    with Client(served.target) as client:
        completion = client.generate(prompt_token_ids=PROMPT_IDS, **fields)
    assert list(completion.token_ids) == expected_plain


def test_seeded_sampling_is_reproducible_and_reports_the_seed(served):
    # A seed fixes the sample for a fixed round structure: speculation off for these requests
    # (the coordinator's adaptive rounds give a different, equally exact sample; README).
    fixed = {"prompt_token_ids": PROMPT_IDS, "max_tokens": 12, "num_speculative_tokens": 0}
    with Client(served.target) as client:
        first = client.generate(**fixed, ignore_eos=True)
        again = client.generate(**fixed, ignore_eos=True, seed=first.seed)
        assert len(first.text) > 16
        stop = first.text[10:14]
        stopped = client.generate(**fixed, seed=first.seed, stop=stop)
    assert again.token_ids == first.token_ids and again.seed == first.seed
    assert stopped.finish_reason == "stop"
    assert stopped.text == first.text[: first.text.index(stop)]


def test_speculation_modes_per_request(served, engine_greedy):
    """The client library's ``speculation``: "on" drafts every round after the first (but the
    last), "off" never; both commit the target's greedy tokens."""
    fields = {"prompt_token_ids": PROMPT_IDS, "max_tokens": 12, "temperature": 0.0}
    with Client(served.target) as client:
        on = client.generate(**fields, speculation="on")
        off = client.generate(**fields, speculation="off")
        held = client.generate(**fields, min_tokens=12)  # no stop id before 12 tokens
    assert len(held.token_ids) == 12
    assert on.token_ids == off.token_ids
    assert off.speculative_decoding["num_drafts"] == 0
    assert on.speculative_decoding["num_drafts"] > 0


def test_logprobs_streamed_and_final(served):
    """``logprobs`` / ``prompt_logprobs``: typed TokenLogprob per output token on each chunk and
    on the Completion (the same, streamed or not), the prompt's on the Completion (None for
    the first token, as vLLM's); none when not asked."""
    fields = {"prompt_token_ids": PROMPT_IDS, "max_tokens": 12, "temperature": 0.0}
    asked = {"logprobs": 2, "prompt_logprobs": 1}
    with Client(served.target) as client:
        completion = client.generate(**fields, **asked)
        chunks = list(client.stream(**fields, **asked))
        plain = client.generate(**fields)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert len(completion.logprobs) == len(completion.token_ids) > 0
    for token_id, item in zip(completion.token_ids, completion.logprobs, strict=True):
        assert isinstance(item, TokenLogprob) and item.token_id == token_id
        assert len(item.top_token_ids) == len(item.top_logprobs) == 2
        assert item.rank >= 1 and item.logprob <= item.top_logprobs[0]
        if item.rank == 1:  # greedy: the token is its own most likely
            assert (item.top_token_ids[0], item.top_logprobs[0]) == (token_id, item.logprob)
    prompt = completion.prompt_logprobs
    assert prompt[0] is None and [item.token_id for item in prompt[1:]] == PROMPT_IDS[1:]
    assert all(len(item.top_token_ids) == 1 for item in prompt[1:])
    streamed = [item for chunk in chunks for item in chunk.logprobs or ()]
    assert [item.token_id for item in streamed] == list(completion.token_ids)
    assert [item.logprob for item in streamed] == pytest.approx(
        [item.logprob for item in completion.logprobs], abs=1e-4
    )
    final = chunks[-1].completion
    assert [item.token_id for item in final.logprobs] == list(completion.token_ids)
    assert [item.token_id for item in final.prompt_logprobs[1:]] == PROMPT_IDS[1:]


def test_structured_outputs(served):
    """``structured_outputs`` (kind, spec), typed by the client library's StructuredOutputs or
    a plain pair: every output follows its grammar and ends "stop", streamed or not."""
    schema = {
        "type": "object",
        # bounded both ways: an unbounded integer can outrun max_tokens (cut JSON)
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["ok", "n"],
    }
    grammars = [
        (StructuredOutputs.regex("[ab]{1,5}"), lambda text: re.fullmatch("[ab]{1,5}", text)),
        (StructuredOutputs.choice(["yes", "no"]), lambda text: text in ("yes", "no")),
        (StructuredOutputs.json(schema), lambda text: set(json.loads(text)) == {"ok", "n"}),
        (("grammar", 'root ::= "x" [0-9]'), lambda text: re.fullmatch("x[0-9]", text)),
    ]
    fields = {"messages": CHAT, "max_tokens": 40, "temperature": 1.0}
    with Client(served.target) as client:
        for grammar, follows in grammars:
            for seed in range(3):
                completion = client.generate(**fields, seed=seed, structured_outputs=grammar)
                assert completion.finish_reason == "stop" and follows(completion.text)
            chunks = list(client.stream(**fields, seed=3, structured_outputs=grammar))
            text = "".join(chunk.text for chunk in chunks)
            completion = chunks[-1].completion
            assert completion.finish_reason == "stop" and text == completion.text
            assert follows(text)
    assert StructuredOutputs.json_object() == ("json_object", "")


def test_model_info_health_and_reflection(served, tiny_chat):
    with Client(served.target) as client:
        info = client.model_info()
        assert client.health() is True
    assert info.model == "tiny" and info.draft == tiny_chat[1]
    assert (info.max_model_len, info.vocab_size) == (MAX_POSITIONS, 49152)
    assert info.num_speculative_tokens == NUM_SPECULATIVE_TOKENS and info.eos_token_ids

    with grpc.insecure_channel(served.target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", SERVICE_NAME):
            status = check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        v1alpha = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        # v1 carries the same messages under another package: called by its path.
        v1 = channel.stream_stream(
            f"/{REFLECTION_V1}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        for info in (v1alpha, v1):
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            answer = next(iter(info(iter([ask]), timeout=5)))
            services = {s.name for s in answer.list_services_response.service}
            assert {SERVICE_NAME, "grpc.health.v1.Health", REFLECTION_V1} <= services
            ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
            answer = next(iter(info(iter([ask]), timeout=5)))
            assert answer.file_descriptor_response.file_descriptor_proto  # the schema


# ---- abort, cancellation, deadlines ------------------------------------------------------------
def test_abort_ends_an_in_flight_request_with_cancelled(served):
    with Client(served.target) as client:
        chunks = client.stream(
            prompt_token_ids=PROMPT_IDS, max_tokens=900, ignore_eos=True, request_id="to-abort"
        )
        first = next(chunks)
        assert first.token_ids and served.in_flight("to-abort")
        assert client.abort("to-abort") is True
        with pytest.raises(SpecrayClientError) as caught:
            list(chunks)
        assert caught.value.code == grpc.StatusCode.CANCELLED
        assert client.abort("to-abort") is False  # gone
    served.wait_released("to-abort")


def test_closing_the_stream_cancels_the_request_on_the_server(served, client_loop):
    async def stream_then_leave():
        async with AsyncClient(served.target) as client:
            chunks = client.stream(
                prompt_token_ids=PROMPT_IDS, max_tokens=900, ignore_eos=True, request_id="async-x"
            )
            await anext(chunks)
            await chunks.aclose()

    client_loop.run(stream_then_leave())
    served.wait_released("async-x")
    with Client(served.target) as client:
        for chunk in client.stream(prompt_token_ids=PROMPT_IDS, max_tokens=900, request_id="x"):
            assert chunk.token_ids
            break  # the generator closes: the call is cancelled
    served.wait_released("x")


def test_client_deadline_is_deadline_exceeded_and_frees_the_request(served):
    with Client(served.target) as client:
        with pytest.raises(SpecrayClientError) as caught:
            client.generate(
                prompt_token_ids=PROMPT_IDS,
                max_tokens=900,
                ignore_eos=True,
                request_id="slow",
                timeout=0.3,
            )
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        served.wait_released("slow")
        assert client.health()


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_kwargs", "named"),
    [
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [1, -4]}, "prompt"),
        ({"prompt_token_ids": [10**6]}, "prompt"),
        ({"prompt_token_ids": [5] * (MAX_POSITIONS + 10)}, "prompt"),  # longer than the context
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"prompt": "hi", "logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "logprobs": 1, "logprobs_mode": "bogus"}, "logprobs_mode"),
        ({"prompt": "hi", "structured_outputs": ("yaml", "")}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": ("regex", "[ab")}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": ("choice", "[]")}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": ("json", "{")}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": ("regex", "a"), "min_tokens": 2}, "min_tokens"),
        ({"prompt": "hi", "structured_outputs": ("regex", "a"), "ignore_eos": True}, "ignore_eos"),
        (
            {"prompt": "hi", "structured_outputs": ("regex", "a"), "banned_token_ids": [2]},
            "banned_token_ids",
        ),
        (
            {"prompt": "hi", "structured_outputs": ("regex", "a"), "allowed_token_ids": [0]},
            "allowed_token_ids",
        ),
    ],
)
def test_invalid_input_is_invalid_argument_naming_the_parameter(served, request_kwargs, named):
    with Client(served.target) as client:
        with pytest.raises(SpecrayClientError) as caught:
            client.generate(**request_kwargs)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in caught.value.message
        assert "Traceback" not in caught.value.message
        assert client.health()  # still serving


def test_a_request_without_prompt_and_unknown_names_are_rejected(served):
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(pb.GenerateRequest(max_tokens=4), timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Abort(pb.AbortRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in caught.value.details()
    with Client(served.target) as client:
        with pytest.raises(SpecrayClientError) as caught:
            client.generate("hi", temprature=0.5)  # caught before anything is sent
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "temprature" in caught.value.message


# ---- TLS, mTLS, token ----------------------------------------------------------------------------
def test_tls_with_token_auth(served, client_loop):
    target = f"127.0.0.1:{served.tls_port}"
    tls = {"root_certificates": served.certs["ca"], "server_name": "localhost"}
    for token in (None, "wrong-token"):
        with Client(target, token=token, **tls) as client:
            with pytest.raises(SpecrayClientError) as caught:
                client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2)
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(SpecrayClientError) as caught:
                client.model_info()
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert client.health() is True  # health is open: probes carry no credentials
    with Client(target, token=TOKEN, **tls) as client:
        completion = client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=3, ignore_eos=True)
        assert len(completion.token_ids) == 3
        assert client.model_info().model == "tiny"

    async def async_call():
        async with AsyncClient(target, token=TOKEN, **tls) as client:
            return await client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2)

    assert client_loop.run(async_call()).completion_tokens >= 1
    with Client(target, token=TOKEN, max_retries=0) as plaintext:  # no TLS: no connection
        with pytest.raises(SpecrayClientError) as caught:
            plaintext.model_info(timeout=5)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(served):
    target = f"127.0.0.1:{served.mtls_port}"
    certs = served.certs
    with Client(
        target, root_certificates=certs["ca"], server_name="localhost", max_retries=0
    ) as client:
        with pytest.raises(SpecrayClientError) as caught:
            client.model_info(timeout=5)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(
        target,
        root_certificates=certs["ca"],
        server_name="localhost",
        client_cert=certs["client_cert"],
        client_key=certs["client_key"],
    ) as client:
        assert client.model_info().model == "tiny"
        assert len(client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2).token_ids) >= 1
