"""A multi-node Ray cluster on this machine: a head plus draft and target nodes, each its own
``ray start`` (own raylet, own processes), with the specray application deployed on it.

    specray cluster up --local --draft-nodes 1 --target-nodes 1
    specray cluster status --local
    specray cluster down --local

What it starts is recorded in ``<state dir>/cluster.json`` (node sessions, pids, ports, the
Ray temp dir); ``down`` stops exactly those sessions (:mod:`specray.ops.processes`) and nothing
else, so it is safe next to other Ray clusters on the machine. The cluster gets its own Ray
auth token (``RAY_AUTH_MODE=token``) kept in the state dir, and Ray's dashboard listens on
127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specray.cluster.ports import free_ports
from specray.cluster.serve_env import apply_serve_env, serve_env, terminates_https
from specray.ops.node_types import NodeType, PlacementAsk, placement_problems
from specray.ops.processes import pid_alive, session_members, stop_session

NODE_TYPE_LABEL = "specray.io/node-type"
NODE_NAME_LABEL = "specray.io/node-name"  # head, draft-0, target-0: find a node in Ray's view
STATE_FILE = "cluster.json"
NODE_START_TIMEOUT_S = 180.0
STARTED_MARKER = "Ray runtime started"  # what `ray start` prints once its node is up

Say = Callable[[str], None]


def default_state_dir() -> Path:
    return Path(os.environ.get("SPECRAY_STATE_DIR", "~/.specray/cluster-local")).expanduser()


@dataclass(frozen=True)
class LocalClusterSpec:
    """The nodes to start. ``*_units``: how much of the draft / target custom resource one node
    advertises, i.e. how many draft workers / TP ranks it may host."""

    draft_nodes: int = 1
    target_nodes: int = 1
    draft_cpus: float = 1.0
    target_cpus: float = 1.0
    draft_units: int = 4
    target_units: int = 4
    object_store_mb: int = 512  # per node; Ray's default (30% of memory) is far too much here

    def __post_init__(self) -> None:
        for name in ("draft_nodes", "target_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.target_nodes < 1:
            raise ValueError(f"target_nodes must be >= 1, got {self.target_nodes}")
        for name in ("draft_cpus", "target_cpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name in ("draft_units", "target_units", "object_store_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.object_store_mb < 80:
            raise ValueError(
                f"object_store_mb must be >= 80 (Ray's minimum), got {self.object_store_mb}"
            )

    def node_types(self, draft_resource: str, target_resource: str) -> list[NodeType]:
        """The node types as the placement check sees them."""
        return [
            NodeType("head", {"CPU": 0.0}, 1, is_head=True),
            NodeType(
                "draft",
                {"CPU": float(self.draft_cpus), draft_resource: float(self.draft_units)},
                self.draft_nodes,
            ),
            NodeType(
                "target",
                {"CPU": float(self.target_cpus), target_resource: float(self.target_units)},
                self.target_nodes,
            ),
        ]


@dataclass(frozen=True)
class NodeLaunch:
    name: str  # head, draft-0, target-0, ...
    kind: str  # head | draft | target
    argv: list[str]


@dataclass
class NodeRecord:
    name: str
    kind: str
    pid: int  # the `ray start --block` process; its session holds the node's processes
    session: int
    log: str


@dataclass
class ClusterState:
    gcs_address: str
    dashboard: str
    temp_dir: str
    auth_token_path: str
    nodes: list[NodeRecord] = field(default_factory=list)
    app_name: str | None = None
    endpoints: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    def save(self, state_dir: Path) -> None:
        path = state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)  # atomic: an interrupted write never leaves half a state file

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        data["nodes"] = [NodeRecord(**node) for node in data["nodes"]]
        return cls(**data)

    def sessions(self) -> set[int]:
        return {node.session for node in self.nodes}

    def alive(self) -> bool:
        return bool(session_members(self.sessions()))


@dataclass(frozen=True)
class Ports:
    gcs: int
    dashboard: int
    client_server: int
    agents: tuple[int, ...]  # one dashboard-agent port per node: the default (52365) is fixed

    @classmethod
    def pick(cls, num_nodes: int) -> Ports:
        ports = free_ports(3 + num_nodes)
        return cls(ports[0], ports[1], ports[2], tuple(ports[3:]))


def ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"  # the ray of this environment first
    found = str(beside) if beside.is_file() else shutil.which("ray")
    if not found:
        raise RuntimeError("the `ray` command is not installed (pip install 'specray[server]')")
    return found


def plan(
    spec: LocalClusterSpec,
    draft_resource: str,
    target_resource: str,
    ports: Ports,
    temp_dir: str,
    ray: str = "ray",
) -> list[NodeLaunch]:
    """The ``ray start`` command of every node, head first (pure: the dry run prints it)."""
    common = [
        "--block",  # stays in the foreground: its session is the node, ended by down
        "--node-ip-address=127.0.0.1",
        "--num-gpus=0",
        f"--object-store-memory={spec.object_store_mb * 1024 * 1024}",
        "--disable-usage-stats",
    ]
    head = NodeLaunch(
        "head",
        "head",
        [
            ray,
            "start",
            "--head",
            f"--port={ports.gcs}",
            "--num-cpus=0",  # no model work on the head: Serve's controller, proxy, ingress
            "--dashboard-host=127.0.0.1",  # Ray's ports are never public
            f"--dashboard-port={ports.dashboard}",
            f"--ray-client-server-port={ports.client_server}",
            f"--dashboard-agent-listen-port={ports.agents[0]}",
            f"--temp-dir={temp_dir}",
            f"--labels={_labels('head', 'head')}",
            *common,
        ],
    )
    launches = [head]
    kinds = [("draft", spec.draft_nodes, spec.draft_cpus, draft_resource, spec.draft_units)]
    kinds.append(
        ("target", spec.target_nodes, spec.target_cpus, target_resource, spec.target_units)
    )
    agent_ports = iter(ports.agents[1:])
    for kind, count, cpus, resource, units in kinds:
        for index in range(count):
            launches.append(
                NodeLaunch(
                    f"{kind}-{index}",
                    kind,
                    [
                        ray,
                        "start",
                        f"--address=127.0.0.1:{ports.gcs}",
                        f"--num-cpus={cpus:g}",
                        f"--resources={json.dumps({resource: units})}",
                        f"--labels={_labels(kind, f'{kind}-{index}')}",
                        f"--dashboard-agent-listen-port={next(agent_ports)}",
                        *common,
                    ],
                )
            )
    return launches


def _labels(kind: str, name: str) -> str:
    return json.dumps({NODE_TYPE_LABEL: kind, NODE_NAME_LABEL: name})


def up(
    spec: LocalClusterSpec,
    config: dict,
    state_dir: Path,
    *,
    say: Say,
    dry_run: bool = False,
    deploy_timeout_s: float = 900.0,
) -> ClusterState | None:
    """Start the nodes, deploy ``config`` (a Serve deploy config) and return the state; on a
    failure, stop what was started and raise. ``dry_run``: print the plan, start nothing."""
    from specray.serve.config import AppArgs

    application = config["applications"][0]
    args = AppArgs(**application.get("args", {}))
    serve = serve_env(local=True, https=terminates_https(config))
    total = 5
    say(f"[1/{total}] checking the plan: {_describe(spec)}")
    problems = placement_problems(
        PlacementAsk.from_app_args(args), spec.node_types(args.draft_resource, args.target_resource)
    )
    if problems:
        raise ValueError("the nodes cannot hold the application: " + "; ".join(problems))
    existing = ClusterState.load(state_dir)
    if existing is not None and existing.alive():
        raise ValueError(
            f"a local cluster from {state_dir} is already up (head pid {existing.nodes[0].pid}); "
            "run `specray cluster down --local` first"
        )
    launches = plan(
        spec,
        args.draft_resource,
        args.target_resource,
        Ports.pick(1 + spec.draft_nodes + spec.target_nodes),
        temp_dir=f"/tmp/specray-{secrets.token_hex(4)}",  # short: unix socket paths are bounded
        ray="ray" if dry_run else ray_executable(),
    )
    temp_dir = _flag(launches[0].argv, "--temp-dir")
    if dry_run:
        say("dry run: these commands would run, each in its own session, in this order")
        settings = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": state_dir / "auth_token"}
        shown = settings | apply_serve_env(serve, dict(os.environ))  # what the nodes would get
        env = " ".join(f"{key}={value}" for key, value in shown.items())
        for launch in launches:
            print(f"  [{launch.name}] {env} {shlex.join(launch.argv)}", flush=True)
        print("  then deploy this Serve config:", flush=True)
        import yaml

        print(_indent(yaml.safe_dump(config, sort_keys=False), "    "), flush=True)
        return None
    if existing is not None:
        (state_dir / STATE_FILE).unlink()  # stale: none of its processes is alive
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    token_path = _write_token(state_dir)
    gcs = _flag(launches[0].argv, "--port")
    state = ClusterState(
        gcs_address=f"127.0.0.1:{gcs}",
        dashboard=f"http://127.0.0.1:{_flag(launches[0].argv, '--dashboard-port')}",
        temp_dir=temp_dir,
        auth_token_path=str(token_path),
    )
    env = _ray_env(token_path, serve)
    try:
        for number, launch in enumerate(launches):
            step = "[2/5] starting the head" if number == 0 else f"[3/5] starting {launch.name}"
            say(f"{step} ({_node_summary(launch)})")
            began = time.monotonic()
            state.nodes.append(_start_node(launch, state_dir, env))
            state.save(state_dir)  # written before the next start: `down` can always clean up
            say(f"      {launch.name} up in {time.monotonic() - began:.1f} s")
        say(f"[4/5] connecting to {state.gcs_address} and waiting for {len(launches)} nodes")
        _connect(state)
        _wait_for_nodes(len(launches))
        say("[5/5] deploying the application (the replicas load the models)")
        from specray.serve import launch as serve_launch

        endpoints = serve_launch.start(
            config,
            timeout_s=deploy_timeout_s,
            progress=lambda line: say(f"      status: {line}"),
        )
        state.app_name = application["name"]
        state.endpoints = endpoints.lines()
        state.save(state_dir)
    except BaseException:
        say("start failed: stopping what was started")
        _disconnect()
        _stop_nodes(state, say)
        raise
    return state


def status_lines(state: ClusterState) -> list[str]:
    """A table of the nodes (from the recorded sessions and Ray's view) and the application."""
    lines = [f"{'node':<10} {'kind':<7} {'pid':>7} {'procs':>5}  {'resources':<26} ray"]
    members = session_members(state.sessions())
    per_session: dict[int, int] = {}
    for session in members.values():
        per_session[session] = per_session.get(session, 0) + 1
    ray_nodes = _ray_nodes_by_kind() if members else {}
    for node in state.nodes:
        seen = ray_nodes.get(node.kind, [])
        ray_node = seen.pop(0) if seen else None
        resources = _resources_text(ray_node["Resources"]) if ray_node else "-"
        alive = "ALIVE" if ray_node and ray_node["Alive"] else "DOWN"
        procs = per_session.get(node.session, 0)
        lines.append(
            f"{node.name:<10} {node.kind:<7} {node.pid:>7} {procs:>5}  {resources:<26} {alive}"
        )
    if members and state.app_name:
        lines.extend(_app_lines(state.app_name))
    return lines


def status(state_dir: Path, say: Say) -> list[str]:
    state = ClusterState.load(state_dir)
    if state is None:
        raise ValueError(f"no local cluster recorded in {state_dir}")
    if not state.alive():
        return [f"the local cluster recorded in {state_dir} is down (no process left)"]
    _connect(state)
    try:
        return [*status_lines(state), "", *state.endpoints]
    finally:
        _disconnect()


def down(state_dir: Path, say: Say, *, drain: bool = True) -> list[int]:
    """Stop the app (drained) and every node recorded in ``state_dir``; return the pids that
    were running. Raises if any recorded process is left."""
    state = ClusterState.load(state_dir)
    if state is None:
        raise ValueError(f"no local cluster recorded in {state_dir}")
    pids = sorted(session_members(state.sessions()))
    head_up = state.nodes and pid_alive(state.nodes[0].pid)
    if drain and head_up and state.app_name:
        say(f"[1/3] draining and deleting the application {state.app_name!r}")
        try:
            _connect(state)
            from specray.serve import launch as serve_launch

            serve_launch.stop(state.app_name)
        except Exception as error:  # a broken app must not keep the nodes up
            say(f"      could not drain ({type(error).__name__}: {error}); stopping anyway")
        finally:
            _disconnect()
    else:
        say("[1/3] no application to drain")
    say(f"[2/3] stopping {len(state.nodes)} nodes ({len(pids)} processes)")
    _stop_nodes(state, say)
    left = session_members(state.sessions())
    if left:
        raise RuntimeError(f"processes left after down: {sorted(left)}")
    say(f"[3/3] removing {state.temp_dir} and the state file")
    shutil.rmtree(state.temp_dir, ignore_errors=True)
    (state_dir / STATE_FILE).unlink()
    return pids


# -- helpers ------------------------------------------------------------------------------


def _start_node(launch: NodeLaunch, state_dir: Path, env: dict) -> NodeRecord:
    log_path = state_dir / "logs" / f"{launch.name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            launch.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the node's own session: `down` stops exactly it
        )
    record = NodeRecord(launch.name, launch.kind, process.pid, process.pid, str(log_path))
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    # One node at a time: raylets starting together on one machine race for socket names.
    while STARTED_MARKER not in log_path.read_text(errors="replace"):
        if process.poll() is not None:
            raise RuntimeError(
                f"{launch.name}: `ray start` exited with status {process.returncode}:\n"
                + _tail(log_path)
            )
        if time.monotonic() > deadline:
            stop_session(record.session)
            raise RuntimeError(
                f"{launch.name}: not up after {NODE_START_TIMEOUT_S:.0f} s:\n" + _tail(log_path)
            )
        time.sleep(0.3)
    return record


def _stop_nodes(state: ClusterState, say: Say) -> None:
    """The worker nodes together, then the head (its GCS last)."""
    workers = [node for node in state.nodes if node.kind != "head"]
    heads = [node for node in state.nodes if node.kind == "head"]
    with ThreadPoolExecutor(max(len(workers), 1)) as pool:
        stopped = list(pool.map(lambda node: stop_session(node.session), workers))
    stopped += [stop_session(node.session) for node in heads]
    for node, result in zip(workers + heads, stopped, strict=True):
        if result.processes:
            forced = f", {result.killed} needed SIGKILL" if result.killed else ""
            say(
                f"      {node.name}: {result.processes} processes stopped in "
                f"{result.seconds:.1f} s{forced}"
            )


def _ray_env(token_path: Path, serve: dict[str, str]) -> dict:
    """The nodes' environment: this one's, token auth, and ``serve``
    (:func:`specray.cluster.serve_env.serve_env`) where this one does not set them."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_USAGE_STATS_ENABLED="0",
    )
    apply_serve_env(serve, env)
    return env


def _connect(state: ClusterState) -> None:
    import logging

    import ray

    if ray.is_initialized():
        ray.shutdown()
    os.environ.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=state.auth_token_path,
        RAY_USAGE_STATS_ENABLED="0",
    )
    # Ray caches its config (auth mode included) when first imported: re-read the environment,
    # as Ray itself does when it turns token auth on.
    from ray._raylet import Config

    Config.initialize("")
    ray.init(address=state.gcs_address, log_to_driver=False, logging_level=logging.WARNING)


def _disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _wait_for_nodes(expected: int, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= expected:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(alive)} of {expected} nodes joined in {timeout_s:.0f} s")
        time.sleep(0.5)


def _ray_nodes_by_kind() -> dict[str, list[dict]]:
    import ray

    by_kind: dict[str, list[dict]] = {}
    for node in ray.nodes():
        kind = (node.get("Labels") or {}).get(NODE_TYPE_LABEL)
        if kind and node["Alive"]:
            by_kind.setdefault(kind, []).append(node)
    return by_kind


def _app_lines(app_name: str) -> list[str]:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return [f"application {app_name}: not deployed"]
    lines = [f"application {app_name}: {_name(app.status)}"]
    for name, deployment in app.deployments.items():
        replicas = ", ".join(
            f"{n} {_name(s).lower()}" for s, n in deployment.replica_states.items()
        )
        lines.append(f"  {name:<12} {_name(deployment.status):<10} replicas: {replicas or 'none'}")
    return lines


def _name(value) -> str:
    return str(getattr(value, "value", value))  # Serve's status enums print their class name


def _resources_text(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if k == "CPU" or k in ("draft", "target", "GPU")}
    custom = [
        k
        for k in resources
        if not k.startswith(("node:", "memory", "object_store")) and k not in ("CPU", "GPU")
    ]
    shown.update({k: resources[k] for k in custom})
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) or "-"


def _write_token(state_dir: Path) -> Path:
    path = state_dir / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    return path


def _flag(argv: list[str], name: str) -> str:
    for item in argv:
        if item.startswith(name + "="):
            return item.split("=", 1)[1]
    raise KeyError(name)


def _node_summary(launch: NodeLaunch) -> str:
    if launch.kind == "head":
        return f"GCS 127.0.0.1:{_flag(launch.argv, '--port')}, no CPUs for model work"
    return f"{_flag(launch.argv, '--num-cpus')} CPU, {_flag(launch.argv, '--resources')}"


def _describe(spec: LocalClusterSpec) -> str:
    return (
        f"head + {spec.draft_nodes} draft node(s) ({spec.draft_cpus:g} CPU, {spec.draft_units} "
        f"draft units each) + {spec.target_nodes} target node(s) ({spec.target_cpus:g} CPU, "
        f"{spec.target_units} target units each)"
    )


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())
