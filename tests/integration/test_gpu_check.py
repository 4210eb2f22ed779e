"""`scripts/gpu-check --device cpu --quick`: the GPU check's smoke test on this machine, run as
the GPU machine runs it (its own process, Ray and pydantic unavailable: that machine has
neither). Every part must report, the statistical part must pass with its negative control
rejected, and the step costs must load as a `specray simulate` latency section."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specray.sim.model import sim_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
RUN_WITHOUT_RAY = (
    "import runpy, sys; sys.modules['ray'] = None; sys.modules['pydantic'] = None; "
    "sys.argv = ['scripts/gpu-check', '--device', 'cpu', '--quick']; "
    "runpy.run_path('scripts/gpu-check', run_name='__main__')"
)


@pytest.mark.timeout(300)
def test_the_gpu_check_runs_here_without_ray():
    done = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_RAY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["environment"]["device"] == "cpu" and report["passed"]
    greedy = report["greedy_identity"]
    assert greedy["identical"] == greedy["prompts"] == 8 and greedy["violations"] == []
    distribution = report["distribution"]
    assert distribution["speculative"]["p_value"] >= distribution["alpha"]
    assert distribution["negative_control"]["p_value"] < distribution["alpha"]
    assert set(report["speed"]["tokens_per_s"]) == {"target_only", "speculative_k4"}
    costs = report["step_costs"]
    assert len(costs["verify_s"]) == 27 and len(costs["draft_step_s"]) == 3
    config = sim_config_from_dict(
        {
            "latency": costs["simulate_latency"],
            "acceptance": {"per_position": [0.7, 0.7, 0.7, 0.7]},
        }
    )
    assert config.latency.verify.seconds(8, 5) > 0
    invariance = report["batch_invariance"]  # the CPU's kernels: exact, the control not
    assert invariance["batch_invariant_max_abs"] == 0.0 < invariance["default_max_abs"]
    mixed = report["mixed_round"]  # packed and padded compute the same logits
    assert mixed["packed_ms"] > 0 and mixed["padded_ms"] > 0
    assert mixed["max_abs_logit_difference"] < 1e-4
