"""``specray bench --drafters``: the k rule, a real run on a tiny target, and the recorded
winner that ``draft="auto"`` resolves to."""

from __future__ import annotations

from pathlib import Path

import pytest

from specray.bench.drafters import (
    DraftersBenchConfig,
    best_k,
    parse_drafters,
    record_winner,
    run_drafters_bench,
)
from specray.drafters import FALLBACK_DRAFT, measured_winner
from specray.models.loading import LoadedModel
from tests.helpers.tiny_models import save_tiny_chat_pair

FLAT = {k: 1.0 + 0.1 * k for k in range(1, 9)}  # verify(k+1)/verify(1)


def test_best_k_follows_acceptance_and_cost():
    assert best_k(0.0, 0.1, FLAT)[0] == 1  # nothing accepted: the smallest block
    assert best_k(0.98, 0.05, FLAT)[0] == 8  # near-perfect and cheap: the largest
    low, _ = best_k(0.4, 0.1, FLAT)
    high, _ = best_k(0.8, 0.1, FLAT)
    assert low < high
    cheap, _ = best_k(0.7, 0.01, FLAT)
    dear, _ = best_k(0.7, 0.4, FLAT)
    assert dear < cheap
    k, bound = best_k(0.5, 0.1, {1: 1.0})
    assert k == 1 and bound == pytest.approx(1.5 / 1.1)


def test_parse_drafters():
    assert {"distilled:fp32", "distilled:fp16", "distilled:int8", "self:fp16"} <= set(
        parse_drafters("all")
    )
    assert parse_drafters("ngram, self:int8") == ("ngram", "self:int8")
    with pytest.raises(ValueError, match="drafters"):
        parse_drafters(",")


@pytest.mark.slow  # a whole benchmark run: calibration, then every drafter timed
def test_tiny_run_records_a_winner_that_auto_resolves_to(tmp_path):
    target, _ = save_tiny_chat_pair(tmp_path / "models")
    config = DraftersBenchConfig(
        target=target,
        drafters=("ngram", "self:int8", "ngram+self:fp32"),
        max_tokens=8,
        num_prompts=3,
        max_k=3,
    )
    report = run_drafters_bench(config)
    rows = {row["draft"]: row for row in report["rows"]}
    assert set(rows) == {"none", "ngram", "self:int8", "ngram+self:fp32"}
    assert all(row["matches_target_only"] for row in rows.values())
    assert 1 <= rows["self:int8"]["k"] <= 3
    assert 0.0 <= rows["self:int8"]["alpha"] <= 1.0
    per_position = rows["self:int8"]["acceptance_per_position"]
    assert len(per_position) == rows["self:int8"]["k"]  # one rate per drafted position
    assert per_position[0] == rows["self:int8"]["first_position_acceptance"]
    assert per_position == sorted(per_position, reverse=True)  # position j+1 needs j
    assert rows["self:int8"]["draft_profile"]["forward_ms_per_step"] > 0
    assert report["winner"]["draft"] in rows
    path = record_winner(target, report, tmp_path / "drafters.json")
    loaded = LoadedModel(None, None, Path(target))
    assert measured_winner(loaded, path) == report["winner"]["draft"]
    other, _ = save_tiny_chat_pair(tmp_path / "other", seed=3, max_positions=128)
    assert measured_winner(LoadedModel(None, None, Path(other)), path) == FALLBACK_DRAFT


def test_served_draft_names_resolve_from_the_target_description(tmp_path):
    """What ``model_info`` reports: the drafter that runs, not ``default``."""
    from specray.drafters import resolve_draft_name
    from specray.models.loading import load_model_info

    target, draft = save_tiny_chat_pair(tmp_path / "models")
    info = load_model_info(target)  # no weights: the description the ingress holds
    assert resolve_draft_name("default", info) == FALLBACK_DRAFT  # nothing measured for it
    assert resolve_draft_name("auto", info) == FALLBACK_DRAFT
    assert resolve_draft_name(draft, info) == draft
    assert resolve_draft_name("ngram", info) == "ngram"
