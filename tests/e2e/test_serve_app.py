"""The served application end to end on a local multi-node Ray cluster (head, draft node,
target node): the Ray Serve app deployed from a deploy config as ``specray serve`` does, driven
through the OpenAI-compatible HTTP API (raw HTTP and the official ``openai`` client) and the
gRPC API (``Client`` and ``AsyncClient``). Greedy outputs must equal the offline ``Engine``'s;
bad input, overload, cancellation and deadlines must end in the right codes with worker state
freed; the draft pool must scale up under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import ray

from specray import Engine, SamplingParams
from specray.client import AsyncClient, Client, SpecrayClientError
from specray.serve import launch
from specray.serve.config import AppArgs
from specray.serve.registry import get_registry
from tests.helpers.tiny_models import save_tiny_chat_pair

MAX_RUNNING, MAX_QUEUE = 4, 2
MAX_POSITIONS = 4096  # room for requests long enough to hold admission while a test looks
LONG = {"max_tokens": 3000, "ignore_eos": True, "num_speculative_tokens": 0}
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Served:
    http: str
    grpc: str
    target: str
    draft: str


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    target, draft = save_tiny_chat_pair(
        tmp_path_factory.mktemp("served"), max_positions=MAX_POSITIONS
    )
    args = AppArgs(
        target=target,
        draft=draft,
        model_name="tiny",
        grpc_port=free_port(),
        num_speculative_tokens=4,
        adaptive_k=False,  # speculate every round: the draft pool is busy from the start
        max_running=MAX_RUNNING,
        max_queue=MAX_QUEUE,
        num_draft_workers=1,
        max_draft_workers=2,
        draft_num_cpus=0.25,
        target_num_cpus=0.25,
    )
    endpoints = launch.start(launch.deploy_config(args, http_port=free_port()))
    yield Served(endpoints.http, endpoints.grpc, target, draft)
    launch.stop()


@pytest.fixture(scope="module")
def engine(served):
    engine = Engine(served.target, served.draft, num_speculative_tokens=4)
    yield engine
    engine.shutdown()


def worker_state() -> tuple[list, list]:
    """Requests still held by the target groups and the draft workers."""
    workers = ray.get(get_registry(launch.APP_NAME).workers.remote())
    held_target = ray.get([leader.held_requests.remote() for leader in workers["targets"].values()])
    held_draft = ray.get([d.held_requests.remote() for d in workers["drafts"].values()])
    return [r for rs in held_target for r in rs], [r for rs in held_draft for r in rs]


def wait_until_freed(timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        target, draft = worker_state()
        if not target and not draft:
            return
        time.sleep(0.2)
    raise AssertionError(f"worker state not freed: target {target}, draft {draft}")


def gauge(http: str, name: str) -> float:
    text = httpx.get(f"{http}/metrics", timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"specray:{name}{{")
    ]
    assert values, f"specray:{name} missing from /metrics"
    return sum(values)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- the served path equals the offline engine --------------------------------------------
def test_http_completions_and_chat_equal_the_engine(served, engine):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    offline = engine.generate(PROMPTS, greedy, use_chat_template=False)
    offline_chat = engine.generate(PROMPTS[:1], greedy, use_chat_template=True)[0]
    with httpx.Client(base_url=served.http, timeout=60) as http:
        for prompt, expected in zip(PROMPTS, offline, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            reply = http.post("/v1/completions", json=body).json()
            assert reply["choices"][0]["text"] == expected.text
            assert reply["usage"]["completion_tokens"] == len(expected.token_ids)
            spec = reply["speculative_decoding"]
            assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
                events = sse_events(stream)
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == (
                expected.text
            )
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 12,
            "temperature": 0,
        }
        reply = http.post("/v1/chat/completions", json=chat).json()
        assert reply["choices"][0]["message"]["content"] == offline_chat.text
        body = chat | {"stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            events = sse_events(stream)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == len(offline_chat.token_ids)
        content = "".join(
            e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"]
        )
        assert content == offline_chat.text
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert "specray:spec_decode_num_draft_tokens_total" in http.get("/metrics").text


def test_official_openai_client(served, engine):
    openai = pytest.importorskip("openai")
    expected = engine.generate(
        PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=10), use_chat_template=True
    )[0]
    client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=10,
        temperature=0,
    )
    assert reply.choices[0].message.content == expected.text
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    direct = engine.generate(
        PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=10), use_chat_template=False
    )[0]
    assert text == direct.text
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in str(error.value)


def test_grpc_client_and_async_client_equal_the_engine(served, engine):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    offline = engine.generate(PROMPTS, greedy, use_chat_template=False)
    with Client(served.grpc) as client:
        assert client.health()
        assert client.model_info().model == "tiny"
        for prompt, expected in zip(PROMPTS, offline, strict=True):
            completion = client.generate(prompt, max_tokens=12, temperature=0)
            assert list(completion.token_ids) == expected.token_ids
            assert completion.text == expected.text

    async def concurrently() -> list:
        async with AsyncClient(served.grpc) as client:
            return await asyncio.gather(
                *(client.generate(p, max_tokens=12, temperature=0) for p in PROMPTS)
            )

    for completion, expected in zip(asyncio.run(concurrently()), offline, strict=True):
        assert list(completion.token_ids) == expected.token_ids


def test_specray_generate_through_the_server(served, engine, capsys):
    from specray.cli import main

    expected = engine.generate(
        PROMPTS[2:], SamplingParams(temperature=0, max_tokens=8), use_chat_template=True
    )[0]
    argv = ["generate", "--prompt", PROMPTS[2], "--server", served.grpc, "--temperature", "0"]
    assert main([*argv, "--max-tokens", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["token_ids"] == expected.token_ids
    assert main([*argv, "--max-tokens", "0"]) == 1  # a clear error, no traceback
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


# ---- bad input ------------------------------------------------------------------------
BAD_HTTP = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "word " * (MAX_POSITIONS + 10), "max_tokens": 4}, "prompt"),  # too long
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_HTTP)
def test_bad_input_over_http(served, fields, param):
    body = {"model": "tiny", "max_tokens": 4} | fields
    reply = httpx.post(f"{served.http}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["message"] or error["param"] == param
    assert httpx.get(f"{served.http}/health", timeout=10).status_code == 200


def test_malformed_requests_over_http(served):
    url = f"{served.http}/v1/completions"
    assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
    reply = httpx.post(url, content=b"prompt=x", headers={"content-type": "text/plain"})
    assert reply.status_code in (400, 415)
    unknown = httpx.post(url, json={"model": "nope", "prompt": "x"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{served.http}/health", timeout=10).status_code == 200


def test_bad_input_over_grpc(served):
    with Client(served.grpc) as client:
        for fields, word in [
            ({"temperature": -1.0}, "temperature"),
            ({"max_tokens": MAX_POSITIONS + 1}, "max_tokens"),
            ({"top_k": -2}, "top_k"),
        ]:
            with pytest.raises(SpecrayClientError) as error:
                client.generate("hello", **({"max_tokens": 4} | fields))
            assert error.value.code.name == "INVALID_ARGUMENT"
            assert word in error.value.message
        with pytest.raises(SpecrayClientError) as error:
            client.generate(prompt_token_ids=[10**9], max_tokens=4)
        assert error.value.code.name == "INVALID_ARGUMENT"
        assert client.health()


# ---- overload, cancellation, deadlines ----------------------------------------------------
def test_overload_is_immediate_and_cancelled_requests_free_the_workers(served):
    stop = threading.Event()
    started: list = []

    def hold(index: int) -> None:
        with Client(served.grpc) as client:
            stream = client.stream(f"hold {index}", **LONG)
            try:
                for _ in stream:
                    started.append(index)
                    if stop.is_set():
                        break
            except SpecrayClientError:
                pass
            finally:
                stream.close()

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(MAX_RUNNING + MAX_QUEUE)]
    deadline = time.monotonic() + 60
    for count, thread in enumerate(holders, start=1):  # one at a time: a burst would overflow
        thread.start()  # the queue before the round loops admit the first ones
        while (
            gauge(served.http, "num_requests_running") + gauge(served.http, "num_requests_waiting")
            < count
        ):
            assert time.monotonic() < deadline, "admission never filled"
            time.sleep(0.05)
    assert gauge(served.http, "num_requests_running") == MAX_RUNNING
    try:
        began = time.monotonic()
        reply = httpx.post(
            f"{served.http}/v1/completions",
            json={"model": "tiny", "prompt": "one more", "max_tokens": 4},
            timeout=30,
        )
        http_s = time.monotonic() - began
        assert reply.status_code == 503, reply.text
        assert int(reply.headers["retry-after"]) >= 1
        assert reply.json()["error"]["type"] == "overloaded_error"
        with Client(served.grpc) as client, pytest.raises(SpecrayClientError) as error:
            client.generate("one more", max_tokens=4)
        assert error.value.code.name == "RESOURCE_EXHAUSTED"
        assert http_s < 2.0  # at once, not after a queue wait
    finally:
        stop.set()
        for thread in holders:
            thread.join(timeout=60)
    wait_until_freed()
    deadline = time.monotonic() + 30  # and nothing is left running or waiting
    while gauge(served.http, "num_requests_running") + gauge(served.http, "num_requests_waiting"):
        assert time.monotonic() < deadline, "requests left in the coordinator"
        time.sleep(0.2)


def test_client_deadline_propagates_and_frees_the_workers(served):
    with Client(served.grpc) as client, pytest.raises(SpecrayClientError) as error:
        client.generate("slow", **LONG, timeout=0.5)
    assert error.value.code.name == "DEADLINE_EXCEEDED"
    wait_until_freed()


def test_http_client_disconnect_frees_the_workers(served):
    body = {
        "model": "tiny",
        "prompt": "disconnect",
        **LONG,
        "stream": True,
    }
    with (
        httpx.Client(base_url=served.http, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        for line in stream.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    wait_until_freed()


def test_http_reaches_the_ingress_replica_through_haproxy(served):
    """As `specray serve` runs it (specray.cluster.serve_env): HAProxy owns the HTTP port and
    the ingress replica answers the API on a port of its own, so no request is relayed
    through Serve's Python proxy."""
    import psutil
    from ray.serve._private.constants import (
        RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
        RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
    )

    http_port = int(served.http.rsplit(":", 1)[1])
    listeners = {
        c.laddr.port: c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid is not None
    }
    assert psutil.Process(listeners[http_port]).name() == "haproxy"
    replica_ports = [
        port
        for port in listeners
        if RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT <= port < RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT
    ]
    models = [
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json() for port in replica_ports
    ]
    assert [m["data"][0]["id"] for m in models] == ["tiny"], (replica_ports, models)


# ---- autoscaling ----------------------------------------------------------------------
def draft_replicas(state: str | None = "RUNNING") -> int:
    """DraftWorker replicas in a state (None: in any state, i.e. what the policy decided)."""
    from ray import serve

    deployment = serve.status().applications[launch.APP_NAME].deployments["DraftWorker"]
    states = deployment.replica_states
    return sum(states.values()) if state is None else states.get(state, 0)


def test_draft_pool_scales_up_under_load(served, engine):
    """Closed-loop speculative load keeps the one draft worker busy above the policy's target
    utilisation (0.7), so the application policy grows the pool to its ceiling (2); the new
    worker joins the coordinator's pool, and greedy output is unchanged."""
    from ray import serve

    assert draft_replicas() == 1
    stop = threading.Event()
    errors: list[BaseException] = []

    def load(index: int) -> None:
        try:
            with Client(served.grpc) as client:
                while not stop.is_set():
                    client.generate(f"load {index}", max_tokens=200, ignore_eos=True, temperature=0)
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)
            stop.set()

    clients = [threading.Thread(target=load, args=(i,)) for i in range(MAX_RUNNING)]
    started = time.monotonic()
    for thread in clients:
        thread.start()
    handle = serve.get_deployment_handle("DraftWorker", launch.APP_NAME)
    readings, decided_s = [], None
    try:
        while draft_replicas() < 2:
            assert not errors, (
                f"the load failed: {errors[0]!r}; running "
                f"{gauge(served.http, 'num_requests_running')}, waiting "
                f"{gauge(served.http, 'num_requests_waiting')}"
            )
            assert time.monotonic() - started < 240, f"no scale-up; utilisation {readings}"
            if decided_s is None and draft_replicas(None) >= 2:
                decided_s = time.monotonic() - started
            readings.append(round(handle.status.remote().result()["util"], 2))
            time.sleep(1.0)
        scaled_s = time.monotonic() - started
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    print(
        f"\ndraft pool 1 -> 2: decided after {decided_s or scaled_s:.1f} s of load, running "
        f"after {scaled_s:.1f} s; draft utilisation each second: {readings}"
    )
    registry = get_registry(launch.APP_NAME)
    deadline = time.monotonic() + 30
    while len(ray.get(registry.workers.remote())["drafts"]) < 2:
        assert time.monotonic() < deadline, "the new draft worker never joined the pool"
        time.sleep(0.5)
    expected = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12), use_chat_template=False
    )[0]
    with Client(served.grpc) as client:
        assert list(client.generate(PROMPTS[0], max_tokens=12, temperature=0).token_ids) == (
            expected.token_ids
        )


def _pid_of(handle) -> int:
    from ray.util.state import get_actor

    return get_actor(handle._actor_id.hex()).pid


def _replaced(kind: str, key: str, old_actor_id: str, timeout_s: float = 90.0):
    """Wait until the registry lists a live actor other than ``old_actor_id`` under the same
    ``key`` (a target group id): the replica replaced it in place."""
    registry = get_registry(launch.APP_NAME)
    deadline = time.monotonic() + timeout_s
    while True:
        handle = ray.get(registry.workers.remote())[kind].get(key)
        if handle is not None and handle._actor_id.hex() != old_actor_id:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(handle.ping.remote())
                return handle
        assert time.monotonic() < deadline, f"{kind} {key} was not replaced in place"
        time.sleep(0.5)


def test_a_killed_target_rank_restarts_its_group_in_place(served, engine):
    """SIGKILL the target group's rank 0: its replica notices at its next heartbeat and
    restarts the group under the same group id, where Serve would replace the whole replica
    only after three failed health checks (30 s). Greedy output after it is the engine's,
    the group is claimed again, and the draft workers, moved to the new engine core, hold
    nothing of the old one. (Last in this module: it kills workers.)"""
    expected = engine.generate(
        PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=12), use_chat_template=False
    )[0]
    registry = get_registry(launch.APP_NAME)
    key, handle = sorted(ray.get(registry.workers.remote())["targets"].items())[0]
    killed_at = time.monotonic()
    os.kill(_pid_of(handle), signal.SIGKILL)
    _replaced("targets", key, handle._actor_id.hex())
    print(f"\ntarget group {key}: restarted in place after {time.monotonic() - killed_at:.1f} s")
    with Client(served.grpc) as client:
        output = client.generate(PROMPTS[1], max_tokens=12, temperature=0, timeout=60)
    assert list(output.token_ids) == expected.token_ids
    deadline = time.monotonic() + 30
    while None in (claims := ray.get(registry.summary.remote())["targets"]).values():
        assert time.monotonic() < deadline, f"the restarted group is not claimed: {claims}"
        time.sleep(0.5)
    assert len(claims) == 1
    wait_until_freed()  # the drafts moved to the restarted engine core hold nothing of the old
