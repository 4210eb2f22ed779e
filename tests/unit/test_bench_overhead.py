"""The overhead report's per-turn ratios (specray.bench.overhead): each turn of a path against
the waves of the same turn, so that a slow spell of the machine moves both sides of a ratio."""

from __future__ import annotations

import pytest

from specray.bench.overhead import format_overhead, turn_ratios


def test_each_turn_is_compared_with_the_waves_of_that_turn():
    # Turn 2 ran in a slow spell: both the waves and the path took twice as long.
    waves = [([0.1] * 16, 1.0), ([0.2] * 16, 2.0)]
    path = [([0.1] * 16, 1.25), ([0.2] * 16, 2.5)]
    assert turn_ratios(path, waves) == pytest.approx([0.8, 0.8])
    # A path slow in one turn only: its ratio drops in that turn alone.
    path = [([0.1] * 16, 1.0), ([0.2] * 16, 4.0)]
    assert turn_ratios(path, waves) == pytest.approx([1.0, 0.5])
    with pytest.raises(ValueError):
        turn_ratios(path[:1], waves)


def test_the_report_prints_the_median_and_range_of_the_turns():
    row = {
        "path": "grpc", "concurrency": 16, "requests": 32, "ms_per_request": 100.0,
        "ms_per_token": 3.1, "tokens_per_s": 900.0, "overhead_ms_per_request": 20.0,
        "overhead_ms_per_token": 0.6, "turn_ratios": [0.85, 0.95, 0.9],
    }  # fmt: skip
    ray = {**row, "path": "ray", "tokens_per_s": 1000.0, "turn_ratios": [1.0, 1.0, 1.0]}
    config = {"target": "tiny", "draft": None, "max_tokens": 32}
    text = format_overhead({"rows": [ray, row], "config": config})
    assert "0.90x  0.90x (0.85-0.95)" in text.splitlines()[2]
