"""The verification-rules benchmark: configuration errors, and one tiny run through the CLI
(figures are timings, so only their presence and sign are checked)."""

import json

import pytest

from specray import cli
from specray.bench.verify import VerifyBenchConfig, format_verify, run_verify_bench

FIGURES = ("ms_per_round", "ms_check_blocks", "ms_verify_batch")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vocab", 0, "vocab must be a positive integer, got 0"),
        ("batch", -1, "batch must be a positive integer"),
        ("threads", 1.5, "threads must be a positive integer"),
        ("encoding", "top0", "draft_probs_encoding must be one of"),
    ],
)
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        VerifyBenchConfig(**{field: value})


def test_tiny_run_reports_every_figure(capsys):
    argv = ["bench", "--verify", "--vocab", "1000", "--batch", "2", "--verify-k", "3", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == {
        "vocab": 1000,
        "batch": 2,
        "k": 3,
        "encoding": "top64",
        "threads": 1,
        "repeats": 15,
        "seed": 0,
    }
    for figures in (report, report["dense"]):
        assert all(figures[name] > 0 for name in FIGURES), figures
        assert 0 <= figures["mean_accepted"] <= 3
    assert report["ms_reference"] > 0 and report["ms_pipeline"] > 0
    text = format_verify(run_verify_bench(VerifyBenchConfig(vocab=200, batch=1, repeats=1)))
    assert "top64: rules" in text and "fp32: rules" in text
