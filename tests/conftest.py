"""One real multi-node Ray cluster on this machine for every test that needs Ray (Ray joins
one cluster per process): a head (driver only), a draft node and a target node, told apart by
the ``draft`` / ``target`` resources."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster


@pytest.fixture(scope="session")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    draft_node = cluster.add_node(num_cpus=2, resources={"draft": 4})
    target_node = cluster.add_node(num_cpus=2, resources={"target": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, draft_node, target_node
    ray.shutdown()
    cluster.shutdown()
