"""``specray cluster``: bring a Ray cluster with draft and target nodes up, inspect it, take it
down, and validate cluster configs and the Helm chart offline.

    specray cluster up --local [--draft-nodes 1 --target-nodes 1] [app flags] [--dry-run]
    specray cluster status --local
    specray cluster down --local
    specray cluster up deploy/ray/aws.yaml [--yes] [--dry-run]     # wraps `ray up`
    specray cluster status deploy/ray/aws.yaml
    specray cluster down deploy/ray/aws.yaml [--yes]
    specray cluster validate deploy/ray/aws.yaml | helm/specray [--values my-values.yaml]
    specray cluster render helm/specray [--values my-values.yaml] > manifests.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_cluster_parser(commands) -> None:
    from specray.ops.local import default_state_dir
    from specray.serve.cli import add_app_arguments

    cluster = commands.add_parser(
        "cluster",
        help="launch, inspect and stop clusters (local multi-node or `ray up`); validate configs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = cluster.add_subparsers(dest="action", required=True)

    def target(parser, verb: str) -> None:
        where = parser.add_mutually_exclusive_group(required=True)
        where.add_argument("--local", action="store_true", help=f"{verb} the local cluster")
        where.add_argument("config", nargs="?", type=Path, help="a `ray up` cluster YAML")
        parser.add_argument(
            "--state-dir",
            type=Path,
            default=default_state_dir(),
            help="where the local cluster's state, token and logs live (default: "
            "$SPECRAY_STATE_DIR or ~/.specray/cluster-local)",
        )

    up = actions.add_parser("up", help="start a cluster and deploy specray on it")
    target(up, "start")
    up.add_argument("--dry-run", action="store_true", help="print what would run; start nothing")
    up.add_argument("--yes", "-y", action="store_true", help="`ray up`: do not ask to confirm")
    local = up.add_argument_group("local cluster (--local)")
    local.add_argument("--draft-nodes", type=int, default=1)
    local.add_argument("--target-nodes", type=int, default=1)
    local.add_argument("--draft-cpus", type=float, default=1.0, help="CPUs per draft node")
    local.add_argument("--target-cpus", type=float, default=1.0, help="CPUs per target node")
    local.add_argument("--draft-units", type=int, default=4, help="draft workers per node")
    local.add_argument("--target-units", type=int, default=4, help="TP ranks per node")
    local.add_argument("--object-store-mb", type=int, default=512, help="per node")
    local.add_argument("--deploy-timeout", type=float, default=900.0, help="seconds")
    add_app_arguments(local)

    status = actions.add_parser("status", help="nodes, processes and the application")
    target(status, "show")

    down = actions.add_parser("down", help="stop everything `up` started")
    target(down, "stop")
    down.add_argument("--dry-run", action="store_true", help="print what would run")
    down.add_argument("--yes", "-y", action="store_true", help="`ray down`: do not ask")
    down.add_argument(
        "--no-drain", action="store_true", help="local: stop the nodes without draining the app"
    )

    validate = actions.add_parser(
        "validate", help="check a `ray up` YAML or the Helm chart offline (schemas, placement)"
    )
    validate.add_argument("path", type=Path, help="a `ray up` YAML, or a chart directory")
    validate.add_argument(
        "--values", type=Path, action="append", default=[], help="chart values file(s)"
    )

    render = actions.add_parser(
        "render",
        help="print the Helm chart's manifests, rendered offline as `helm template` renders them",
    )
    render.add_argument("path", type=Path, help="a chart directory")
    render.add_argument(
        "--values", type=Path, action="append", default=[], help="chart values file(s)"
    )
    render.add_argument("--name", default="specray", help="the release name (default: specray)")
    render.add_argument("--namespace", default="default", help="the release namespace")


def run_cluster(args: argparse.Namespace) -> int:
    say = lambda line: print(f"specray: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if args.action == "validate":
        return _validate(args)
    if args.action == "render":
        return _render(args)
    if getattr(args, "local", False):
        return _run_local(args, say)
    from specray.ops import cloud

    if args.action == "up":
        return cloud.up(args.config, yes=args.yes, dry_run=args.dry_run, say=say)
    if args.action == "down":
        return cloud.down(args.config, yes=args.yes, dry_run=args.dry_run, say=say)
    return cloud.status(args.config, say=say)


def _run_local(args: argparse.Namespace, say) -> int:
    from pydantic import ValidationError

    from specray.ops import local
    from specray.serve.cli import load_app_config, validation_message

    if args.action == "status":
        for line in local.status(args.state_dir, say):
            print(line, flush=True)
        return 0
    if args.action == "down":
        if args.dry_run:
            state = local.ClusterState.load(args.state_dir)
            if state is None:
                raise ValueError(f"no local cluster recorded in {args.state_dir}")
            for node in reversed(state.nodes):
                print(f"  stop session {node.session} ({node.name}, `ray start` pid {node.pid})")
            return 0
        pids = local.down(args.state_dir, say, drain=not args.no_drain)
        say(f"down: {len(pids)} processes stopped, none left")
        return 0
    spec = local.LocalClusterSpec(
        draft_nodes=args.draft_nodes,
        target_nodes=args.target_nodes,
        draft_cpus=args.draft_cpus,
        target_cpus=args.target_cpus,
        draft_units=args.draft_units,
        target_units=args.target_units,
        object_store_mb=args.object_store_mb,
    )
    # On a cluster the gRPC API sits next to the HTTP proxy, on the head.
    if not any(item.startswith("ingress_on_head=") for item in args.extra):
        args.extra = ["ingress_on_head=true", *args.extra]
    try:
        config = load_app_config(args)
    except ValidationError as error:
        raise ValueError(validation_message(error)) from None
    state = local.up(
        spec,
        config,
        args.state_dir,
        say=say,
        dry_run=args.dry_run,
        deploy_timeout_s=args.deploy_timeout,
    )
    if state is None:
        return 0
    say("ready")
    for line in state.endpoints:
        print(line, flush=True)
    print(flush=True)
    for line in local.status(args.state_dir, say):
        if line in state.endpoints:
            continue
        print(line, flush=True)
    print(f"stop with: specray cluster down --local --state-dir {args.state_dir}", flush=True)
    return 0


def _render(args: argparse.Namespace) -> int:
    """The chart's manifests on stdout, through the Helm library `validate` uses (the values
    checked against values.schema.json first, as `helm template` checks them)."""
    import helm_python

    from specray.ops import chart

    if not (args.path / "Chart.yaml").is_file():
        raise ValueError(f"path: no chart directory (no Chart.yaml): {str(args.path)!r}")
    values = chart.values_from_files(args.values) if args.values else None
    try:
        text = chart.render_text(args.path, values, name=args.name, namespace=args.namespace)
    except helm_python.HelmError as error:
        raise ValueError(" ".join(str(error).split())) from None
    print(text, end="", flush=True)
    return 0


def _validate(args: argparse.Namespace) -> int:
    path: Path = args.path
    if (path / "Chart.yaml").is_file():
        from specray.ops import chart

        values = chart.values_from_files(args.values) if args.values else None
        report = chart.validate_chart(path, values)
        for line in report.lines():
            print(line, flush=True)
        return 0 if report.ok else 1
    if args.values:
        raise ValueError("--values applies to a chart directory only")
    from specray.ops import ray_config

    if not path.is_file():
        raise ValueError(f"path: no such file or chart directory: {str(path)!r}")
    config = ray_config.load(path)
    # `ray up` resolves file_mounts' local paths from where it runs: here, as in `cluster up`.
    problems = ray_config.validate(config, base_dir=Path.cwd())
    for line in ray_config.summary(config):
        print(line, flush=True)
    for problem in problems:
        print(f"FAIL {problem}", flush=True)
    print("PASS" if not problems else f"{len(problems)} problem(s)", flush=True)
    return 0 if not problems else 1
