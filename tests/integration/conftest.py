"""One real multi-node Ray cluster on this machine for all integration tests: a head (driver
only), a draft node and a target node, told apart by the ``draft`` / ``target`` resources."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.helpers.tiny_models import perturbed_copy, tiny_llama


@pytest.fixture(scope="session")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    draft_node = cluster.add_node(num_cpus=2, resources={"draft": 4})
    target_node = cluster.add_node(num_cpus=2, resources={"target": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, draft_node, target_node
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny target (2 KV heads: TP = 2 shards them) and a different draft, saved to disk."""
    folder = tmp_path_factory.mktemp("tiny")
    target = tiny_llama(5, seed=0, num_attention_heads=2, num_key_value_heads=2)
    draft = perturbed_copy(target, seed=1, noise=0.5)
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return target, str(folder / "target"), str(folder / "draft")
