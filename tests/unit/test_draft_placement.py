"""Where a draft runs (``specray/cluster/placement.py``): the rule of ``"auto"``."""

from __future__ import annotations

import pytest

from specray.cluster.placement import resolve_draft_placement
from specray.distill import DRAFT_FILE


@pytest.mark.parametrize(
    "draft, target, expected",
    [
        ("ngram", "/any/target", "colocated"),  # no model
        ("distilled", "default", "colocated"),  # the shipped few-layer draft
        ("distilled:fp16", "default", "colocated"),
        ("ngram+distilled", "default", "colocated"),
        ("default", "default", "colocated"),  # the bundled target's recorded winner
        ("auto", "default", "colocated"),
        ("default", "/another/target", "workers"),  # never measured: the target's own weights
        ("self:bf16", "default", "workers"),
        ("ngram+self:fp32", "default", "workers"),
        ("/a/model/directory", "default", "workers"),
    ],
)
def test_auto_colocates_drafts_small_beside_their_target(draft, target, expected):
    assert resolve_draft_placement("auto", draft, target) == expected


def test_a_distilled_directory_is_small_and_a_sized_pool_or_an_explicit_choice_wins(tmp_path):
    (tmp_path / DRAFT_FILE).write_text("{}")
    assert resolve_draft_placement("auto", str(tmp_path), "default") == "colocated"
    assert resolve_draft_placement("auto", "ngram", "default", pool_sized=True) == "workers"
    assert resolve_draft_placement("workers", "ngram", "default") == "workers"
    assert resolve_draft_placement("colocated", "self:bf16", "default") == "colocated"
    assert resolve_draft_placement("auto", None, "default") == "workers"  # nothing to place


def test_an_unknown_placement_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"draft_placement must be one of .* got 'beside'"):
        resolve_draft_placement("beside", "ngram", "default")
