"""``specray cluster up|status|down CONFIG``: Ray's cluster launcher (``ray up`` / ``ray down``)
with specray's checks first and its endpoints after.

``up`` refuses a config that fails :func:`specray.ops.ray_config.validate` before any cloud
call; the config's head start commands deploy the app (``serve deploy``), and ``up`` then waits
for the application to run and prints where clients connect. Commands run from the current
directory, which ``ray up`` resolves ``file_mounts`` against (run from the repository root).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

Say = Callable[[str], None]
DASHBOARD = "http://127.0.0.1:8265"  # on the head, loopback only (the configs bind it there)
APP_WAIT_S = 3600.0  # a cold 8-GPU node pulls an image and loads a large model


def up_commands(config_path: Path, *, yes: bool) -> list[list[str]]:
    return [["ray", "up", str(config_path), *(["--yes"] if yes else [])]]


def status_command(config_path: Path) -> list[str]:
    remote = f"ray status; serve status --address {DASHBOARD}"
    return ["ray", "exec", str(config_path), remote]


def down_commands(config_path: Path, *, yes: bool) -> list[list[str]]:
    drain = f"serve shutdown --yes --address {DASHBOARD}"  # drains requests, then deletes
    return [
        ["ray", "exec", str(config_path), drain],
        ["ray", "down", str(config_path), *(["--yes"] if yes else [])],
    ]


def _checked(config_path: Path, say: Say):
    from specray.ops import ray_config

    if not config_path.is_file():
        raise ValueError(f"config: no such file: {str(config_path)!r}")
    config = ray_config.load(config_path)
    problems = ray_config.validate(config, base_dir=Path.cwd())
    for line in ray_config.summary(config):
        say(f"      {line}")
    if problems:
        raise ValueError(
            f"{config_path} fails {len(problems)} check(s), nothing launched:\n  "
            + "\n  ".join(problems)
        )
    return config, ray_config.served_app(config, base_dir=Path.cwd())


def up(config_path: Path, *, yes: bool, dry_run: bool, say: Say) -> int:
    say(f"[1/4] checking {config_path} (Ray's schema, head rules, Serve config, placement)")
    _, app = _checked(config_path, say)
    commands = up_commands(config_path, yes=yes)
    if dry_run:
        say("dry run: these commands would run")
        for command in [*commands, status_command(config_path)]:
            print(f"  {shlex.join(command)}", flush=True)
        return 0
    say("[2/4] ray up: head node, setup commands, Ray, then `serve deploy` of the app")
    for command in commands:
        _run(command, say)
    say("[3/4] waiting for the application (Serve brings up draft and target nodes on demand)")
    _wait_running(config_path, app.entry.get("name", "specray"), say)
    say("[4/4] endpoints")
    head = _output(["ray", "get-head-ip", str(config_path)]).strip().splitlines()[-1]
    print(f"OpenAI HTTP  http://{head}:{app.http_port}/v1", flush=True)
    if app.args.grpc_port is not None:
        print(f"gRPC         {head}:{app.args.grpc_port}  (specray.v1.Generation)", flush=True)
    if app.args.auth_token_env:
        print(f"token        ray exec {config_path} 'cat ~/.specray/auth_token'", flush=True)
    return 0


def status(config_path: Path, *, say: Say) -> int:
    say(f"status of {config_path}")
    _run(status_command(config_path), say)
    return 0


def down(config_path: Path, *, yes: bool, dry_run: bool, say: Say) -> int:
    commands = down_commands(config_path, yes=yes)
    if dry_run:
        say("dry run: these commands would run")
        for command in commands:
            print(f"  {shlex.join(command)}", flush=True)
        return 0
    say("[1/2] draining and deleting the Serve applications")
    try:
        _run(commands[0], say)
    except RuntimeError as error:  # a head that is already gone has nothing to drain
        say(f"      {error}; going on")
    say("[2/2] ray down: terminating the nodes")
    _run(commands[1], say)
    return 0


def _run(command: list[str], say: Say) -> None:
    say(f"      $ {shlex.join(command)}")
    result = subprocess.run(command, stdin=sys.stdin if sys.stdin.isatty() else None)
    if result.returncode != 0:
        raise RuntimeError(f"`{shlex.join(command[:2])}` exited with status {result.returncode}")


def _output(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{shlex.join(command[:2])}` failed: {result.stderr.strip()[-500:]}")
    return result.stdout


def _wait_running(config_path: Path, app_name: str, say: Say) -> None:
    remote = f"serve status --address {DASHBOARD}"
    deadline = time.monotonic() + APP_WAIT_S
    seen = None
    while True:
        try:
            text = _output(["ray", "exec", str(config_path), remote])
            state = application_status(text, app_name)
        except RuntimeError as error:
            state = f"unknown ({error})"
        if state != seen:
            say(f"      {app_name}: {state}")
            seen = state
        if state == "RUNNING":
            return
        if state == "DEPLOY_FAILED":
            raise RuntimeError(f"{app_name} failed to deploy: see `specray cluster status`")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{app_name} not running after {APP_WAIT_S:.0f} s: {state}")
        time.sleep(15)


def application_status(serve_status_yaml: str, app_name: str) -> str:
    """The status of ``app_name`` in ``serve status`` output (YAML, after any log lines)."""
    start = serve_status_yaml.find("proxies:")
    start = start if start >= 0 else serve_status_yaml.find("applications:")
    if start < 0:
        return "NOT_STARTED"
    data = yaml.safe_load(serve_status_yaml[start:]) or {}
    app = (data.get("applications") or {}).get(app_name)
    return str(app.get("status")) if app else "NOT_STARTED"
