"""``specray cluster`` without launching anything: the `ray up` wrapper's dry runs and its
refusal of a bad config before any cloud call, ``validate`` on the shipped configs and chart,
the local launcher's plan and its input checks, and reading ``serve status`` output."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from specray.cli import main
from specray.ops import cloud
from specray.ops.local import LocalClusterSpec, Ports, plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # `ray up` resolves file_mounts from here, and so do the checks


@pytest.mark.parametrize("cloud_config", ["deploy/ray/aws.yaml", "deploy/ray/gcp.yaml"])
def test_up_dry_run_checks_then_prints_the_commands(cloud_config, capsys):
    assert main(["cluster", "up", cloud_config, "--dry-run", "--yes"]) == 0
    out, err = capsys.readouterr()
    assert f"ray up {cloud_config} --yes" in out
    assert f"ray exec {cloud_config} 'ray status; serve status" in out
    assert "[1/4] checking" in err and "target=8" in err  # the node-type table


def test_down_dry_run_drains_then_downs(capsys):
    assert main(["cluster", "down", "deploy/ray/aws.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "serve shutdown --yes" in out[0] and out[1].strip() == "ray down deploy/ray/aws.yaml"


def test_up_refuses_a_config_that_fails_the_checks_before_any_cloud_call(
    tmp_path, monkeypatch, capsys
):
    config = yaml.safe_load((ROOT / "deploy/ray/aws.yaml").read_text())
    config["available_node_types"]["target"]["resources"]["GPU"] = 4  # TP 8 needs 8
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))

    def no_cloud(*args, **kwargs):
        raise AssertionError(f"a command ran: {args}")

    monkeypatch.setattr(subprocess, "run", no_cloud)
    assert main(["cluster", "up", str(bad), "--yes"]) == 2
    err = capsys.readouterr().err
    assert "nothing launched" in err and "cannot hold one target group (tp_size=8)" in err


def test_validate_the_shipped_configs_and_chart(capsys):
    assert main(["cluster", "validate", "deploy/ray/gcp.yaml"]) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")
    assert main(["cluster", "validate", "helm/specray"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "PASS placement" in out


def test_validate_fails_on_bad_chart_values(tmp_path, capsys):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"targetGroup": {"gpus": 4}}))
    assert main(["cluster", "validate", "helm/specray", "--values", str(values)]) == 1
    assert "FAIL placement" in capsys.readouterr().out


def test_bad_paths_and_states_are_clear_errors(tmp_path, capsys):
    assert main(["cluster", "validate", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["cluster", "status", "--local", "--state-dir", str(tmp_path)]) == 2
    assert "no local cluster recorded" in capsys.readouterr().err
    assert main(["cluster", "up", "--local", "--draft-nodes", "-1", "--dry-run"]) == 2
    assert "draft_nodes must be an integer >= 0, got -1" in capsys.readouterr().err


def test_local_spec_checks_name_the_parameter():
    with pytest.raises(ValueError, match="target_nodes must be >= 1"):
        LocalClusterSpec(target_nodes=0)
    with pytest.raises(ValueError, match="draft_cpus must be > 0"):
        LocalClusterSpec(draft_cpus=0)
    with pytest.raises(ValueError, match="object_store_mb must be >= 80"):
        LocalClusterSpec(object_store_mb=10)


def test_local_plan_head_first_distinct_ports_and_node_resources():
    spec = LocalClusterSpec(draft_nodes=2, target_nodes=1, target_cpus=2, target_units=2)
    ports = Ports.pick(4)
    assert len({ports.gcs, ports.dashboard, ports.client_server, *ports.agents}) == 7
    launches = plan(spec, "draft", "target", ports, temp_dir="/tmp/specray-x")
    assert [launch.name for launch in launches] == ["head", "draft-0", "draft-1", "target-0"]
    head = launches[0].argv
    assert "--head" in head and "--num-cpus=0" in head and "--num-gpus=0" in head
    assert all(f"--address=127.0.0.1:{ports.gcs}" in launch.argv for launch in launches[1:])
    target = launches[-1].argv
    assert "--num-cpus=2" in target
    assert f"--resources={json.dumps({'target': 2})}" in target
    assert all("--block" in launch.argv for launch in launches)  # down stops each session


SERVE_STATUS = """\
2026-11-29 20:40:10,533 INFO worker.py:1841 -- Connecting to existing Ray cluster...
proxies:
  a1b2: HEALTHY
applications:
  specray:
    status: DEPLOYING
    message: ''
    deployments:
      Ingress:
        status: UPDATING
target_capacity: null
"""


def test_application_status_reads_serve_status_output():
    assert cloud.application_status(SERVE_STATUS, "specray") == "DEPLOYING"
    assert cloud.application_status(SERVE_STATUS, "other") == "NOT_STARTED"
    assert cloud.application_status("no serve here", "specray") == "NOT_STARTED"


@pytest.mark.slow  # a fresh Python process through the shell script
def test_the_cluster_local_script_is_the_cli(tmp_path):
    script = ROOT / "scripts" / "cluster-local"
    result = subprocess.run(
        [str(script), "up", "--dry-run", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sum("ray start" in line for line in result.stdout.splitlines()) == 3
    wrong = subprocess.run([str(script), "launch"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "usage" in wrong.stderr
