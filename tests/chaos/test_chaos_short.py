"""The chaos suite's short subset (``make test``): ``python -m tests.chaos.run --profile
short`` in its own process (it is a Ray driver of its own cluster), then its report checked.

Faults: a draft worker SIGKILLed, half the draft -> target blocks dropped for 8 s, the
coordinator replica SIGKILLed — under 3 streaming clients alternating greedy (40 tokens) and
sampled (top-k 3, 2 tokens, seeds 100000 * (client + 1) + turn) requests. The statistical
check: chi-square of the sampled 2-token outcomes against the target's exact distribution
(enumerated), significance 0.01, sample size whatever the run completes (reported; at least
30 asserted), with a stale-position sampler (second token from the first position's
distribution) as the negative control that must be rejected.
``make chaos`` runs the full profile (every fault kind, a soak) and prints the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos.run import ALPHA

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray  # its own cluster, in a child process (not the cluster fixture)


def test_short_chaos_run_loses_nothing_and_stays_exact(tmp_path):
    report_path = tmp_path / "chaos.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "tests.chaos.run", "--profile", "short", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["lost"] == []
    assert report["completed"] == report["sent"] > 0
    assert report["greedy_checked"] > 0 and report["greedy_mismatches"] == []
    assert report["sampled_n"] >= 30
    assert report["stat_p"] > ALPHA, report
    assert report["stat_negative_p"] < ALPHA, report  # the negative control is rejected
    assert report["held_after"] == {}
    kinds = [fault["kind"] for fault in report["faults"]]
    assert kinds == ["kill_draft_worker", "link_drop", "kill_coordinator"]
    assert all(fault["recovery_s"] == fault["recovery_s"] for fault in report["faults"])  # no NaN
