"""One real multi-node Ray cluster on this machine for every test that needs Ray (Ray joins
one cluster per process): a head (driver only), a draft node and a target node, told apart by
the ``draft`` / ``target`` resources.

Markers (declared in pyproject.toml, ``--strict-markers``): every test gets its tier from its
folder (``tests/unit/`` -> ``unit``), and ``ray`` when it uses that cluster, so ``make
test-fast`` (``-m "(unit or statistical) and not ray and not slow"``) cannot pick up a Ray test
by a forgotten marker. ``slow`` is set by hand where the cost is not visible in the fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from specray.cluster.serve_env import apply_serve_env, serve_env

TESTS = Path(__file__).parent
TIERS = ("unit", "statistical", "integration", "e2e", "chaos", "fuzz", "security")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        tier = item.path.relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
        if "cluster" in item.fixturenames:  # the whole fixture closure, so indirect uses too
            item.add_marker("ray")


@pytest.fixture(scope="session")
def cluster():
    # Serve as `specray serve` runs it (HAProxy ingress, throughput profile): the nodes'
    # processes inherit this environment.
    apply_serve_env(serve_env(local=True))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    draft_node = cluster.add_node(num_cpus=2, resources={"draft": 4})
    target_node = cluster.add_node(num_cpus=2, resources={"target": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, draft_node, target_node
    ray.shutdown()
    cluster.shutdown()
