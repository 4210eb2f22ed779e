"""The served application with its draft colocated (``draft_placement="colocated"``): no
DraftWorker deployment, the draft inside the target group's rank 0, exchanging the stream's
messages with the engine core in memory. Outputs over HTTP and gRPC equal the offline engine's
with drafts accepted, finished requests are freed on both sides, and a killed rank 0 comes
back with its draft."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray
from ray import serve

from specray import Engine, SamplingParams
from specray.client import Client
from specray.serve import launch
from specray.serve.config import AppArgs
from specray.serve.registry import get_registry
from tests.e2e.test_serve_app import _pid_of, _replaced, free_port
from tests.helpers.tiny_models import save_tiny_chat_pair

PROMPTS = [f"Colocated test {i}: the river" for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def colocated(cluster, tmp_path_factory):
    target, draft = save_tiny_chat_pair(tmp_path_factory.mktemp("colocated"))
    args = AppArgs(
        target=target,
        draft=draft,
        draft_placement="colocated",
        model_name="tiny",
        grpc_port=free_port(),
        num_speculative_tokens=3,
        adaptive_k=False,  # speculate every round
        target_num_cpus=0.25,
    )
    endpoints = launch.start(launch.deploy_config(args, http_port=free_port()))
    engine = Engine(target, draft, num_speculative_tokens=3)
    expected = engine.generate(PROMPTS, GREEDY, use_chat_template=False)
    engine.shutdown()
    yield endpoints, [e.token_ids for e in expected]
    launch.stop()


def _leader():
    targets = ray.get(get_registry(launch.APP_NAME).workers.remote())["targets"]
    assert len(targets) == 1
    return next(iter(targets.values()))


def _freed(leader, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        held = ray.get(leader.held_requests.remote())
        drafting = ray.get(leader.draft_stats.remote())["num_requests"]
        if not held and not drafting:
            return
        assert time.monotonic() < deadline, f"held: target {held}, draft {drafting} requests"
        time.sleep(0.2)


def test_no_draft_pool_and_outputs_equal_the_engine_with_drafts_accepted(colocated):
    endpoints, expected = colocated
    deployments = serve.status().applications[launch.APP_NAME].deployments
    assert set(deployments) == {"Ingress", "Coordinator", "TargetWorker"}
    with Client(endpoints.grpc) as client:
        outputs = [client.generate(p, max_tokens=12, temperature=0) for p in PROMPTS]
    assert [list(o.token_ids) for o in outputs] == expected
    accepted = sum(int(o.speculative_decoding.get("num_accepted_tokens", 0)) for o in outputs)
    assert accepted > 0, "the colocated draft's blocks were verified and accepted"
    with httpx.Client(base_url=endpoints.http, timeout=60) as http:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
        reply = http.post("/v1/completions", json=body).json()
    assert reply["usage"]["completion_tokens"] == len(expected[0])
    assert reply["speculative_decoding"]["num_draft_tokens"] > 0
    leader = _leader()
    stats = ray.get(leader.engine_core_stats.remote())
    assert stats["num_draft_workers"] == 1 and stats["pool"]["commands_sent"] > 0
    _freed(leader)


def test_a_killed_rank_0_restarts_with_its_draft(colocated):
    """SIGKILL rank 0 (and with it the draft in its process): the replica restarts the group
    in place, the draft colocated again; greedy output after it is the engine's, with drafts.
    (Last in this module: it kills a worker.)"""
    endpoints, expected = colocated
    registry = get_registry(launch.APP_NAME)
    key, handle = sorted(ray.get(registry.workers.remote())["targets"].items())[0]
    os.kill(_pid_of(handle), signal.SIGKILL)
    leader = _replaced("targets", key, handle._actor_id.hex())
    with Client(endpoints.grpc) as client:
        output = client.generate(PROMPTS[1], max_tokens=12, temperature=0, timeout=60)
    assert list(output.token_ids) == expected[1]
    assert int(output.speculative_decoding.get("num_draft_tokens", 0)) > 0
    _freed(leader)
