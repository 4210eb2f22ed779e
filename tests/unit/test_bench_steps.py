"""The runner-vs-transformers step benchmark: configuration errors, and one real run on a tiny
random model (figures are timings, so only their presence and consistency are checked)."""

import pytest

from specray.bench.steps import StepsConfig, format_steps, run_steps_bench
from specray.models.tiny import save_tiny_model


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batches", (), "batches must hold positive integers"),
        ("contexts", (0,), "contexts must hold positive integers"),
        ("widths", (1, -2), "widths must hold positive integers"),
        ("mixed_prompts", (0,), "mixed_prompts must hold positive integers"),
        ("repeats", 0, "repeats must be >= 1, got 0"),
    ],
)
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        StepsConfig(**{field: value})


def test_tiny_run_reports_every_point(tmp_path):
    target = save_tiny_model(tmp_path / "tiny")
    config = StepsConfig(
        target=target, batches=(1, 3), contexts=(8,), widths=(1, 4), mixed_prompts=(6,), repeats=2
    )
    report = run_steps_bench(config)
    points = [(row["batch"], row["context"], row["new_tokens"]) for row in report["rows"]]
    assert points == [(1, 8, 1), (1, 8, 4), (3, 8, 1), (3, 8, 4)]
    for row in report["rows"]:
        assert row["specray_ms"] > 0 and row["transformers_ms"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_ms"] / row["specray_ms"], 0.01)
    assert [(r["batch"], r["context"], r["prompt"]) for r in report["mixed_rows"]] == [(3, 8, 6)]
    (mixed,) = report["mixed_rows"]
    assert mixed["packed_ms"] > 0 and mixed["padded_ms"] > 0 and mixed["apart_ms"] > 0
    assert mixed["padded_over_packed"] == pytest.approx(
        mixed["padded_ms"] / mixed["packed_ms"], 0.01
    )
    assert "transformers ms" in format_steps(report) and "padded/packed" in format_steps(report)
