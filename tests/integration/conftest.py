"""Tiny model pairs for the integration tests (the Ray cluster is in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_models import perturbed_copy, tiny_llama

LONG_POSITIONS = 1024


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny target (2 KV heads: TP = 2 shards them) and a different draft, saved to disk."""
    folder = tmp_path_factory.mktemp("tiny")
    target = tiny_llama(5, seed=0, num_attention_heads=2, num_key_value_heads=2)
    draft = perturbed_copy(target, seed=1, noise=0.5)
    for model in (target, draft):  # room for requests that must outlive a short deadline
        model.config.max_position_embeddings = LONG_POSITIONS
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return target, str(folder / "target"), str(folder / "draft")
