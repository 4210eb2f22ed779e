"""``specray cluster up|status|down --local`` as a user runs it: a head, one draft and one target
node as separate ``ray start`` processes, the app deployed, one request through the client
library (equal to the offline engine's greedy output), and a teardown that leaves none of the
processes it started (asserted by pid)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specray import Engine, SamplingParams
from specray.client import Client
from specray.ops import cloud
from specray.ops.local import STATE_FILE, ClusterState
from specray.ops.processes import pid_alive, session_members, stop_session
from tests.helpers.tiny_models import save_tiny_chat_pair

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray  # its own cluster, `ray start` processes (not the cluster fixture)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def specray(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "specray.cli", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("cluster-local-models"))


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, models):
    target, draft = models
    result = specray(
        "up", "--local", "--dry-run", "--state-dir", str(tmp_path), "--target", target,
        "--draft", draft, "--draft-nodes", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    starts = [line for line in result.stdout.splitlines() if "ray start" in line]
    assert len(starts) == 4  # head + 2 draft + 1 target
    assert "--head" in starts[0] and "--num-cpus=0" in starts[0]
    assert "--dashboard-host=127.0.0.1" in starts[0]
    assert sum('{"draft": 4}' in line for line in starts) == 2
    assert sum('{"target": 4}' in line for line in starts) == 1
    assert "ingress_on_head: true" in result.stdout
    assert not (tmp_path / STATE_FILE).exists()


def test_a_plan_that_cannot_hold_the_app_is_refused_before_starting(tmp_path, models):
    target, draft = models
    result = specray(
        "up", "--local", "--state-dir", str(tmp_path), "--target", target, "--draft", draft,
        "--tp-size", "2", "--target-units", "1",
    )  # fmt: skip
    assert result.returncode == 2
    assert "cannot hold one target group (tp_size=2)" in result.stderr
    assert not (tmp_path / STATE_FILE).exists()


def test_up_generate_status_down_leaves_no_process(tmp_path, models):
    target, draft = models
    http_port, grpc_port = free_port(), free_port()
    state_dir = tmp_path / "state"
    up = specray(
        "up", "--local", "--state-dir", str(state_dir), "--target", target, "--draft", draft,
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--set", "num_speculative_tokens=3",
    )  # fmt: skip
    state = ClusterState.load(state_dir)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        print(up.stderr + up.stdout)  # the transcript, with -s
        assert f"gRPC         127.0.0.1:{grpc_port}" in up.stdout
        assert "application specray: RUNNING" in up.stdout
        for name in ("head", "draft-0", "target-0"):
            assert any(line.startswith(name) and "ALIVE" in line for line in up.stdout.splitlines())
        assert [node.kind for node in state.nodes] == ["head", "draft", "target"]
        pids = session_members(state.sessions())
        assert len(pids) > 10  # raylets, GCS, agents, the replicas' workers...
        assert set(pids.values()) == state.sessions()  # every node's session has processes

        expected = _offline_greedy(target, draft, "The cluster says", 10)
        with Client(f"127.0.0.1:{grpc_port}") as client:
            completion = client.generate("The cluster says", max_tokens=10, temperature=0)
        assert completion.text == expected

        # The Helm chart's `helm test` hook script, run against this real deployment.
        hook = _chart_hook_script()
        env = dict(os.environ, SPECRAY_URL=f"http://127.0.0.1:{http_port}", no_proxy="127.0.0.1")
        hooked = subprocess.run(
            [sys.executable, "-c", hook], env=env, capture_output=True, text=True, timeout=300
        )
        assert hooked.returncode == 0 and "PASS model" in hooked.stdout, hooked.stdout

        # Serve's own CLI against the cluster's dashboard, with the cluster's Ray token.
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state.auth_token_path)
        serve_status = subprocess.run(
            [str(Path(sys.executable).parent / "serve"), "status", "--address", state.dashboard],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert cloud.application_status(serve_status.stdout, "specray") == "RUNNING"

        status = specray("status", "--local", "--state-dir", str(state_dir), timeout=120)
        assert status.returncode == 0, status.stderr
        assert "application specray: RUNNING" in status.stdout
        pids = session_members(state.sessions())  # again: replicas have started workers since

        down = specray("down", "--local", "--state-dir", str(state_dir), timeout=300)
        print(down.stderr)
        assert down.returncode == 0, down.stderr
        assert "none left" in down.stderr
        assert [pid for pid in pids if pid_alive(pid)] == []
        assert session_members(state.sessions()) == {}
        assert not _processes_mentioning(state.temp_dir)
        assert not (state_dir / STATE_FILE).exists()
    finally:
        if state is not None:  # a failed run must not leave the nodes behind
            for session in state.sessions():
                stop_session(session, grace_s=5)


def _offline_greedy(target: str, draft: str, prompt: str, max_tokens: int) -> str:
    engine = Engine(target, draft, num_speculative_tokens=3)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return engine.generate([prompt], params, use_chat_template=False)[0].text
    finally:
        engine.shutdown()


def _chart_hook_script() -> str:
    from specray.ops import chart

    docs = chart.render(ROOT / "helm" / "specray")
    pod = next(doc for doc in docs if doc["kind"] == "Pod")
    return pod["spec"]["containers"][0]["args"][0]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_state_file_records_nodes_in_start_order(tmp_path):
    state = ClusterState("127.0.0.1:1", "http://127.0.0.1:2", "/tmp/x", str(tmp_path / "t"))
    state.save(tmp_path)
    loaded = json.loads((tmp_path / STATE_FILE).read_text())
    assert loaded["nodes"] == [] and ClusterState.load(tmp_path) == state
