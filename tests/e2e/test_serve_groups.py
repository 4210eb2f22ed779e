"""Two target groups in one served application: each coordinator claims its own group, the
draft pool is split between them, requests spread over both with outputs equal to the offline
engine's, and ``/metrics`` merges both coordinators' series."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from specray import Engine, SamplingParams
from specray.client import Client
from specray.serve import launch
from specray.serve.config import AppArgs
from specray.serve.registry import get_registry
from tests.e2e.test_serve_app import free_port
from tests.helpers.tiny_models import save_tiny_chat_pair

PROMPTS = [f"Group test {i}: the river" for i in range(8)]


@pytest.fixture(scope="module")
def two_groups(cluster, tmp_path_factory):
    target, draft = save_tiny_chat_pair(tmp_path_factory.mktemp("groups"))
    args = AppArgs(
        target=target,
        draft=draft,
        model_name="tiny",
        grpc_port=free_port(),
        num_target_groups=2,
        num_draft_workers=1,  # per group
        num_speculative_tokens=3,
        adaptive_k=False,
        draft_num_cpus=0.25,
        target_num_cpus=0.25,
    )
    endpoints = launch.start(launch.deploy_config(args, http_port=free_port()))
    yield endpoints, target, draft
    launch.stop()


def test_each_coordinator_claims_its_own_group_and_outputs_match(two_groups):
    endpoints, target, draft = two_groups
    registry = get_registry(launch.APP_NAME)
    deadline = time.monotonic() + 60
    while True:  # the draft workers register a heartbeat after their replicas start
        summary = ray.get(registry.summary.remote())
        if len(set(summary["drafts"].values()) - {None}) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    claimed = list(summary["targets"].values())
    assert len(claimed) == 2 and None not in claimed and len(set(claimed)) == 2
    assert sorted(summary["drafts"].values()) == sorted(summary["targets"])  # one per group

    engine = Engine(target, draft, num_speculative_tokens=3)
    expected = engine.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_chat_template=False
    )
    engine.shutdown()
    with Client(endpoints.grpc) as client, ThreadPoolExecutor(8) as pool:
        outputs = list(
            pool.map(lambda p: client.generate(p, max_tokens=10, temperature=0), PROMPTS)
        )
    for output, reference in zip(outputs, expected, strict=True):
        assert list(output.token_ids) == reference.token_ids
    served_by = {output.request_id.rsplit("-", 1)[0] for output in outputs}
    assert len(served_by) == 2, f"every request went to one coordinator: {served_by}"

    time.sleep(3)  # one heartbeat: both coordinators have published their latest metrics
    text = httpx.get(f"{endpoints.http}/metrics", timeout=10).text
    per_replica = {
        line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("specray:generation_tokens_total{")
    }
    assert len(per_replica) == 2
    assert sum(per_replica.values()) == sum(len(o.token_ids) for o in outputs)
