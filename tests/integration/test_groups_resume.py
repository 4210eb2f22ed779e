"""The ingress's sessions with the target groups' engine cores (``specray.serve.groups``) on
a real Ray cluster: requests spread over the groups, and a request whose group dies midway
resumes on another from the tokens it delivered, with exactly the tokens and text of an
undisturbed run."""

from __future__ import annotations

import asyncio

import pytest
import ray

from specray import Engine, SamplingParams
from specray.cluster.distributed import DistributedBackend
from specray.engine_core.coordinator import CoordinatorConfig
from specray.serve.config import AppArgs
from specray.serve.groups import GroupsBackend
from specray.serve.protocol import GenerateRequest
from specray.serve.registry import Registry
from tests.helpers.tiny_models import save_tiny_chat_pair

PROMPT = "The groups take turns"
TOKENS = 120  # long enough to be killed midway


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("groups-pair"))[0]


@pytest.fixture(scope="module")
def groups(cluster, target):
    """Two target-only groups, each with its engine core, in a registry."""
    backends = [DistributedBackend(target, None) for _ in range(2)]
    registry = ray.remote(Registry).options(num_cpus=0).remote()
    for index, backend in enumerate(backends):
        sessions = backend.start_engine(CoordinatorConfig(num_speculative_tokens=0))
        ray.get(
            registry.add_target.remote(f"g{index}", backend.leader, backend.address, {}, sessions)
        )
    yield backends, registry
    for backend in backends:
        backend.shutdown()


def test_a_request_whose_group_dies_resumes_on_another_exactly(groups, target):
    backends, registry = groups
    params = {"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True}
    reference = Engine(target, None).generate(
        PROMPT, SamplingParams(**params), use_chat_template=False
    )[0]

    async def main():
        ingress = GroupsBackend(AppArgs(target=target, draft=None), registry)
        await ingress.start()
        try:
            assert sorted(ingress.groups) == ["g0", "g1"]
            # Two requests at once go to different groups (the fewest in flight).
            both = await asyncio.gather(
                *(_final(ingress, GenerateRequest(prompt=f"{PROMPT} {i}", params=params))
                  for i in range(2))
            )  # fmt: skip
            assert len({event["request_id"].rsplit("-", 1)[0] for event in both}) == 2
            request = GenerateRequest(prompt=PROMPT, params=params, request_id="moving")
            texts, tokens, killed = [], [], None
            async for event in ingress.generate(request):
                if event["kind"] == "delta":
                    texts.append(event["text"])
                    tokens += event["token_ids"]
                    if killed is None and len(tokens) >= 10:  # kill its group's rank 0
                        killed = ingress._where["moving"].group_id
                        ray.kill(backends[int(killed[1])].leader, no_restart=True)
                elif event["kind"] == "final":
                    final = event
            return final, "".join(texts), tokens, killed, ingress.resumes
        finally:
            await ingress.close()

    final, text, tokens, killed, resumes = asyncio.run(main())
    assert killed is not None and resumes == 1
    assert tokens == reference.token_ids == final["token_ids"]
    assert text == final["text"] == reference.text


async def _final(ingress: GroupsBackend, request: GenerateRequest) -> dict:
    async for event in ingress.generate(request):
        if event["kind"] == "final":
            return event
    raise AssertionError("no final event")
