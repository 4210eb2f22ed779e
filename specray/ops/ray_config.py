"""Offline checks of ``ray up`` cluster configs for specray (``deploy/ray/*.yaml``).

``validate(config, base_dir=...)`` returns problems in words; an empty list means the config
passes every check below. No cloud account, no cluster, nothing launched:

1. Ray's own JSON schema (``ray/autoscaler/ray-schema.json``): unknown keys, wrong types.
2. Node types: an explicit global ``max_workers`` that covers every node type's
   ``min_workers`` and ``max_workers``; explicit per-type ``max_workers``; a head type that
   starts no extra nodes and declares ``CPU: 0`` (``ray up`` hands a node type's resources to
   ``ray start`` as ``RAY_OVERRIDE_RESOURCES``, which beats its ``--num-cpus``).
3. The head: ``ray start --head`` with ``--num-cpus=0 --num-gpus=0``, no draft / target / GPU
   resources (flags and node type), the dashboard on loopback; workers join with ``--address``.
4. The Serve config the head deploys (the path after ``serve deploy`` in the head start
   commands, mapped through ``file_mounts`` to a local file under ``base_dir``): Ray Serve's
   ``ServeDeploySchema``, the specray application's args as ``AppArgs``, its autoscaling
   policy's bounds equal to those args.
5. Placement (:mod:`specray.ops.node_types`): the node types hold the app at its largest.
6. Provider details: an AWS security group opens only the Serve HTTP and gRPC ports to
   clients; GCP disk types name the zone the nodes launch in.

``summary(config)`` is a table of the node types, for ``specray cluster up`` / ``validate``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from specray.cluster.placement import PlacementConfig
from specray.cluster.serve_env import SERVE_ENV

if TYPE_CHECKING:
    from specray.serve.config import AppArgs

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
ICMP_PROTOCOLS = frozenset({"icmp", "icmpv6", "1", "58"})  # their "ports" are ICMP types
SPECRAY_POLICY = "specray.cluster.autoscaling:ApplicationPolicy"
# Policy bounds that must equal the app's args (AppArgs.autoscaling_settings()).
POLICY_BOUNDS = (
    "min_drafts_per_group",
    "max_drafts_per_group",
    "min_target_groups",
    "max_target_groups",
)

# `serve deploy [options] CONFIG`: the words after it up to a shell separator or a quote
# (the command may sit inside `bash -c '...'`).
_SERVE_DEPLOY = re.compile(r"\bserve\s+deploy((?:\s+[^\s;&|'\"]+)+)")
_SERVE_DEPLOY_VALUE_OPTIONS = frozenset(
    {"-a", "--address", "--runtime-env", "--runtime-env-json", "--working-dir", "--name"}
)


def load(path: str | os.PathLike) -> dict:
    """A cluster config YAML as a dict (ValueError if it is not a mapping)."""
    with open(path) as handle:
        config = yaml.safe_load(handle)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a ray up config must be a YAML mapping, got {config!r}")
    return config


def validate(config: Mapping, *, base_dir: str | os.PathLike) -> list[str]:
    """Every problem found in ``config``; [] if none. ``base_dir``: where relative local paths
    in ``file_mounts`` start (the directory ``ray up`` runs in: the repository root)."""
    problems = _schema_problems(config)
    if problems:  # the checks below read the structure the schema guarantees
        return problems
    problems += _worker_count_problems(config)
    problems += _gcp_disk_zone_problems(config)
    app, app_problems = _read_app(config, Path(base_dir))
    if app is None:
        defaults = PlacementConfig()
        names = (defaults.draft_resource, defaults.target_resource)
    else:
        names = (app.args.draft_resource, app.args.target_resource)
    problems += _start_command_problems(config, names)
    problems += app_problems
    if app is not None:
        problems += _app_problems(config, app)
    return problems


def served_app(config: Mapping, *, base_dir: str | os.PathLike) -> ServedApp | None:
    """The specray application the head deploys, or None where it cannot be read (``validate``
    says why)."""
    app, _ = _read_app(config, Path(base_dir))
    return app


def summary(config: Mapping) -> list[str]:
    """The node types as table lines: name, role, instance type, resources, min, max.

    >>> summary({"provider": {"type": "aws", "region": "us-west-2"}, "max_workers": 1,
    ...     "head_node_type": "head", "available_node_types": {
    ...     "head": {"resources": {"CPU": 0}, "node_config": {"InstanceType": "m6i.large"}}}})
    ... # doctest: +NORMALIZE_WHITESPACE
    ['node type  role  instance   resources  min  max',
     'head       head  m6i.large  CPU=0        1    1',
     'provider aws us-west-2; at most 1 worker node(s) besides the head']
    """
    head = config.get("head_node_type")
    rows = [("node type", "role", "instance", "resources", "min", "max")]
    for name, spec in (config.get("available_node_types") or {}).items():
        node = spec.get("node_config") or {}
        instance = node.get("InstanceType") or node.get("machineType") or "-"
        resources = " ".join(f"{k}={v}" for k, v in (spec.get("resources") or {}).items())
        if name == head:
            rows.append((name, "head", instance, resources or "-", "1", "1"))
        else:
            low, high = spec.get("min_workers", 0), spec.get("max_workers", "?")
            rows.append((name, "worker", instance, resources or "-", str(low), str(high)))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = [
        "  ".join(
            cell.rjust(width) if i >= 4 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    provider = config.get("provider") or {}
    where = " ".join(str(provider[k]) for k in ("type", "region") if provider.get(k))
    lines.append(
        f"provider {where}; at most {config.get('max_workers', '?')} worker node(s) "
        "besides the head"
    )
    return lines


# ---- 1. Ray's schema -----------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _ray_schema() -> dict:
    import ray.autoscaler

    with open(Path(ray.autoscaler.__file__).parent / "ray-schema.json") as handle:
        return json.load(handle)


def _schema_problems(config: Mapping) -> list[str]:
    # The schema alone, not ray.autoscaler._private.util.validate_config: that one also demands
    # fields `ray up` fills in from the provider's defaults before validating (e.g.
    # cluster_synced_files), which a config as written need not have.
    import jsonschema

    schema = _ray_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(dict(config)), key=lambda e: list(map(str, e.path)))
    problems = [
        f"ray-schema: {'/'.join(map(str, error.path)) or '(top level)'}: {error.message}"
        for error in errors
    ]
    head = config.get("head_node_type")
    if not problems and head not in (config.get("available_node_types") or {}):
        problems.append(f"head_node_type {head!r} is not one of available_node_types")
    return problems


# ---- 2. node types and worker counts -------------------------------------------------------------
def _worker_count_problems(config: Mapping) -> list[str]:
    problems = []
    head = config["head_node_type"]
    types = config["available_node_types"]
    if "max_workers" not in config:
        problems.append("set max_workers: Ray's provider defaults cap the cluster at 2 workers")
    cap = config.get("max_workers", 2)
    for name, spec in types.items():
        low, high = spec.get("min_workers", 0), spec.get("max_workers")
        if name == head:
            if low or high:
                problems.append(
                    f"head node type {name!r}: min_workers/max_workers must be 0 or absent "
                    f"(got {low}/{high}): more nodes of it would be workers with nothing to do"
                )
        elif high is None:
            problems.append(
                f"node type {name!r}: set max_workers (Ray would default it to the global "
                f"max_workers={cap}, the placement check to 0)"
            )
        elif low > high:
            problems.append(f"node type {name!r}: min_workers {low} > max_workers {high}")
    workers = [spec for name, spec in types.items() if name != head]
    total_min = sum(spec.get("min_workers", 0) for spec in workers)
    total_max = sum(spec.get("max_workers", 0) for spec in workers)
    if total_min > cap:
        problems.append(f"max_workers={cap} is below the sum of min_workers ({total_min})")
    if total_max > cap:
        problems.append(
            f"max_workers={cap} is below the sum of the node types' max_workers ({total_max}): "
            "they cannot all reach their maximum, which the placement check assumes"
        )
    head_resources = types[head].get("resources") or {}
    if head_resources.get("CPU") != 0:
        problems.append(
            f"head node type {head!r} must declare resources CPU: 0 (got "
            f"{head_resources.get('CPU')!r}): `ray up` exports a node type's resources as "
            "RAY_OVERRIDE_RESOURCES, which overrides --num-cpus=0 (AWS fills in the vCPUs)"
        )
    return problems


# ---- 3. start commands ---------------------------------------------------------------------------
def _ray_start_flags(command: str) -> dict[str, str | None] | None:
    """Flags of the first ``ray start`` in a shell command ({flag: value or None}), or None."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: not a command this check can read
        return None
    for i in range(len(words) - 1):
        if words[i] == "ray" and words[i + 1] == "start":
            flags: dict[str, str | None] = {}
            rest = words[i + 2 :]
            for j, word in enumerate(rest):
                if word and set(word) <= set(";&|()<>"):  # the command ends
                    break
                if not word.startswith("--"):
                    continue
                name, eq, value = word.partition("=")
                if eq:
                    flags[name] = value
                elif j + 1 < len(rest) and not rest[j + 1].startswith("-"):
                    flags[name] = rest[j + 1]
                else:
                    flags[name] = None
            return flags
    return None


def _start_command_problems(config: Mapping, resource_names: tuple[str, ...]) -> list[str]:
    """``resource_names``: the app's draft and target resources, which the head must not have."""
    problems = []
    head_commands = config.get("head_start_ray_commands") or []
    starts = [(i, f) for i, c in enumerate(head_commands) if (f := _ray_start_flags(c))]
    heads = [(i, flags) for i, flags in starts if "--head" in flags]
    if not heads:
        return ["head_start_ray_commands: no `ray start --head`"]
    _, flags = heads[0]
    for flag in ("--num-cpus", "--num-gpus"):
        if _number(flags.get(flag)) != 0:
            problems.append(
                f"head start: pass {flag}=0 (got {flags.get(flag)!r}): model work stays off "
                "the head (GCS, dashboard, autoscaler, Serve controller and proxy live there)"
            )
    try:
        extra = json.loads(flags.get("--resources") or "{}")
    except json.JSONDecodeError:
        problems.append(f"head start: --resources is not JSON: {flags['--resources']!r}")
        extra = {}
    for name, amount in extra.items():
        if name in ("GPU", *resource_names) and amount:
            problems.append(f"head start: --resources advertises {name!r} on the head")
    host = flags.get("--dashboard-host")
    if host not in LOOPBACK_HOSTS:
        problems.append(
            f"head start: pass --dashboard-host=127.0.0.1 (got {host!r}): the dashboard runs "
            "jobs for whoever reaches it; use `ray dashboard CONFIG` (an SSH tunnel) instead"
        )
    worker_starts = [
        f for c in config.get("worker_start_ray_commands") or [] if (f := _ray_start_flags(c))
    ]
    if not any("--address" in f and "--head" not in f for f in worker_starts):
        problems.append("worker_start_ray_commands: no `ray start --address=...` joining the head")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        problems += _serve_env_problems(key, config.get(key) or [])
    return problems


def _serve_env_problems(key: str, commands) -> list[str]:
    """Serve reads its settings from the environment of every Ray process: each node's
    ``ray start`` must run with :data:`specray.cluster.serve_env.SERVE_ENV` exported."""
    starts = [c for c in commands if _ray_start_flags(c)]
    missing = [
        f"{name}={value}"
        for name, value in SERVE_ENV.items()
        if starts and not all(re.search(rf"\b{name}={value}\b", c) for c in starts)
    ]
    if not missing:
        return []
    return [
        f"{key}: export {' '.join(missing)} before `ray start` (Serve's HAProxy ingress, "
        "specray.cluster.serve_env)"
    ]


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


# ---- 4. the Serve config the head deploys --------------------------------------------------------
def _serve_deploy_path(commands) -> tuple[int, str] | None:
    """(index of the command, the config path) of the first ``serve deploy``, or None."""
    for index, command in enumerate(commands):
        for match in _SERVE_DEPLOY.finditer(command):
            words = iter(match.group(1).split())
            for word in words:
                if word in _SERVE_DEPLOY_VALUE_OPTIONS:
                    next(words, None)
                elif not word.startswith("-"):
                    return index, word
    return None


def _remote_key(path: str) -> str:
    path = re.sub(r"^(\$HOME|\$\{HOME\})(?=/|$)", "~", path)
    return path.rstrip("/") or "/"


def _local_path(remote: str, file_mounts: Mapping[str, str], base_dir: Path) -> Path | None:
    """Where ``remote`` (a path on the cluster) comes from locally, through file_mounts."""
    remote = _remote_key(remote)
    best = None
    for mount_remote, mount_local in file_mounts.items():
        key = _remote_key(mount_remote)
        inside = remote == key or remote.startswith(key.rstrip("/") + "/")
        if inside and (best is None or len(key) > len(best[0])):
            best = (key, mount_local)
    if best is None:
        return None
    local = Path(os.path.expanduser(best[1]))
    local = local if local.is_absolute() else base_dir / local
    rest = remote[len(best[0]) :].lstrip("/")
    return local / rest if rest else local


@dataclass(frozen=True)
class ServedApp:
    """The specray application of the Serve config the head deploys."""

    path: Path  # the local Serve config file
    http_port: int  # its http_options.port
    entry: dict  # the application's entry in the file, as written
    args: AppArgs


def _read_app(config: Mapping, base_dir: Path) -> tuple[ServedApp | None, list[str]]:
    """The Serve config ``serve deploy`` sends from the head, read from its local source."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from specray.serve.config import AppArgs
    from specray.serve.launch import IMPORT_PATH

    commands = config.get("head_start_ray_commands") or []
    found = _serve_deploy_path(commands)
    if found is None:
        return None, ["head_start_ray_commands: no `serve deploy CONFIG` deploying the app"]
    index, remote = found
    problems = []
    head_start = next(
        (i for i, c in enumerate(commands) if "--head" in (_ray_start_flags(c) or {})), None
    )
    if head_start is not None and index <= head_start:
        problems.append("head_start_ray_commands: `serve deploy` must come after `ray start`")
    path = _local_path(remote, config.get("file_mounts") or {}, base_dir)
    if path is None:
        problems.append(f"serve deploy {remote}: not under any file_mounts entry (not on the head)")
        return None, problems
    if not path.is_file():
        problems.append(f"serve deploy {remote}: its local source {path} does not exist")
        return None, problems
    with open(path) as handle:
        data = yaml.safe_load(handle)
    try:
        schema = ServeDeploySchema(**data)
    except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        problems.append(f"{path}: not a Serve deploy config: {_one_line(error)}")
        return None, problems
    apps = [i for i, app in enumerate(schema.applications) if app.import_path == IMPORT_PATH]
    if len(apps) != 1:
        problems.append(
            f"{path}: expected one application importing {IMPORT_PATH}, found {len(apps)}"
        )
        return None, problems
    entry = data["applications"][apps[0]]
    try:
        args = AppArgs(**(schema.applications[apps[0]].args or {}))
    except ValidationError as error:
        problems += [
            f"{path}: args.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()
        ]
        return None, problems
    return ServedApp(path, schema.http_options.port, entry, args), problems


# ---- 5. the app on these node types --------------------------------------------------------------
def _app_problems(config: Mapping, app: ServedApp) -> list[str]:
    from specray.cluster.scaling_rules import AutoscalingSettings
    from specray.ops.node_types import PlacementAsk, from_ray_up, placement_problems

    problems = []
    args = app.args
    policy = app.entry.get("autoscaling_policy") or {}
    ours = policy.get("policy_function") == SPECRAY_POLICY
    if args.autoscaled and args.autoscaling == "application" and not ours:
        problems.append(
            f"{app.path}: args autoscaling: application needs the application's "
            f"autoscaling_policy {{policy_function: {SPECRAY_POLICY}}}"
        )
    if ours:
        kwargs = policy.get("policy_kwargs") or {}
        try:
            AutoscalingSettings(**kwargs)
        except (TypeError, ValueError) as error:
            problems.append(f"{app.path}: autoscaling_policy.policy_kwargs: {_one_line(error)}")
        wanted = args.autoscaling_settings().to_dict()
        for key in POLICY_BOUNDS:
            if key in kwargs and kwargs[key] != wanted[key]:
                problems.append(
                    f"{app.path}: autoscaling_policy.policy_kwargs.{key}={kwargs[key]} "
                    f"disagrees with the args ({wanted[key]}: num_/max_draft_workers, "
                    "num_target_groups)"
                )

    problems += placement_problems(PlacementAsk.from_app_args(args), from_ray_up(config))
    public = {app.http_port: "Serve HTTP"}
    if args.grpc_port:
        public[args.grpc_port] = "specray gRPC"
    problems += _public_port_problems(config, public)
    return problems


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


# ---- 6. provider details -------------------------------------------------------------------------
def _public_port_problems(config: Mapping, public: Mapping[int, str]) -> list[str]:
    """AWS security group rules that open anything but the served ports to outside sources
    (rules naming only security groups are intra-cluster and fine)."""
    rules = ((config.get("provider") or {}).get("security_group") or {}).get("IpPermissions")
    problems = []
    allowed = ", ".join(f"{port} ({what})" for port, what in sorted(public.items()))
    for rule in rules or []:
        sources = [
            r.get("CidrIp") or r.get("CidrIpv6") or r.get("PrefixListId")
            for key in ("IpRanges", "Ipv6Ranges", "PrefixListIds")
            for r in rule.get(key) or []
        ]
        if not sources or str(rule.get("IpProtocol")).lower() in ICMP_PROTOCOLS:
            continue
        if str(rule.get("IpProtocol")) == "-1":
            low, high = 0, 65535
        else:
            low, high = int(rule.get("FromPort", 0)), int(rule.get("ToPort", 65535))
        if any(port not in public for port in range(low, high + 1)):
            span = str(low) if low == high else f"{low}-{high}"
            problems.append(
                f"provider.security_group opens port(s) {span} to {', '.join(sources)}: only "
                f"{allowed} may face clients; Ray's ports (6379, 8265, 10001, 8076, ...) stay "
                "internal"
            )
    return problems


def _gcp_disk_zone_problems(config: Mapping) -> list[str]:
    """GCP takes a VM's disk type as a zonal path: it must be the provider's zone."""
    provider = config.get("provider") or {}
    if provider.get("type") != "gcp":
        return []
    zone = provider.get("availability_zone")
    problems = []
    for name, spec in config["available_node_types"].items():
        for disk in (spec.get("node_config") or {}).get("disks") or []:
            disk_type = str((disk.get("initializeParams") or {}).get("diskType", ""))
            match = re.search(r"zones/([^/]+)/diskTypes/", disk_type)
            if match and match.group(1) != zone:
                problems.append(
                    f"node type {name!r}: diskType {disk_type} is in {match.group(1)}, but "
                    f"the nodes launch in availability_zone {zone}"
                )
    return problems
