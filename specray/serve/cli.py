"""``specray serve``: the application on an embedded local Ray (or a cluster), until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

# Flags that map one to one onto AppArgs fields (flag name -> field, type).
_APP_FLAGS = {
    "target": str,
    "draft": str,
    "model_name": str,
    "tp_size": int,
    "num_draft_workers": int,
    "max_draft_workers": int,
    "num_speculative_tokens": int,
    "max_running": int,
    "max_queue": int,
    "draft_probs_encoding": str,
    "draft_placement": str,
    "grpc_port": int,
    "auth_token": str,
    "tls_cert": str,
    "tls_key": str,
    "tls_client_ca": str,
    "device": str,
}


def add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP and gRPC APIs (Ray Serve), until Ctrl-C",
        description="Start the embedded local Ray cluster (or join --address), deploy the "
        "specray application and print where it listens. Ctrl-C drains and stops it.",
    )
    add_app_arguments(serve)
    serve.add_argument(
        "--address", default=None, help="a Ray cluster address; default: embedded local Ray"
    )


def add_app_arguments(parser) -> None:
    """The application's flags (--config, one flag per common AppArgs field, --set K=V and
    the HTTP listen address), shared by ``specray serve`` and ``specray cluster up --local``."""
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML: a Serve deploy config (with 'applications') or specray app arguments",
    )
    for name, kind in _APP_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None)
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="identical logits for a token in any batch, with or without speculation (slower)",
    )
    parser.add_argument("--http-host", default="127.0.0.1", help="0.0.0.0 to listen publicly")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other application argument (repeatable)",
    )


def load_app_config(args: argparse.Namespace) -> dict:
    """A Serve deploy config from --config and the flags (flags win)."""
    import yaml

    from specray.serve.config import AppArgs
    from specray.serve.launch import deploy_config, http_options

    loaded: dict = {}
    if args.config is not None:
        if not args.config.is_file():
            raise ValueError(f"--config: no such file: {str(args.config)!r}")
        loaded = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--config: expected a mapping, got {type(loaded).__name__}")
    overrides = {name: getattr(args, name) for name in _APP_FLAGS if getattr(args, name)}
    if getattr(args, "batch_invariant", None):
        overrides["batch_invariant"] = True
    if os.environ.get("SPECRAY_AUTH_TOKEN") and "auth_token" not in overrides:
        overrides["auth_token"] = os.environ["SPECRAY_AUTH_TOKEN"]
    for item in args.extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = value
    if "applications" in loaded:
        application = loaded["applications"][0]
        application["args"] = {**application.get("args", {}), **overrides}
        app_args = AppArgs(**application["args"])  # fail here, not in a replica
        loaded.setdefault(
            "http_options", http_options(app_args, host=args.http_host, port=args.http_port)
        )
        return loaded
    app_args = AppArgs(**{**loaded, **overrides})
    return deploy_config(app_args, http_host=args.http_host, http_port=args.http_port)


def run_serve(args: argparse.Namespace) -> int:
    import ray
    from pydantic import ValidationError

    from specray.cluster.distributed import connect
    from specray.cluster.placement import PlacementConfig
    from specray.cluster.serve_env import serve_env, terminates_https
    from specray.serve import launch

    try:
        config = load_app_config(args)
    except ValidationError as error:
        raise ValueError(validation_message(error)) from None
    application = config["applications"][0]
    placement = PlacementConfig(
        draft_resource=application["args"].get("draft_resource", "draft"),
        target_resource=application["args"].get("target_resource", "target"),
    )
    say = lambda line: print(f"specray: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if application["args"].get("tls_client_ca"):
        say("mTLS (tls_client_ca) is enforced on the gRPC API only: Serve's HTTP proxy cannot "
            "require client certificates, so keep a bearer token on")  # fmt: skip
    say("starting Ray" if args.address is None else f"joining Ray at {args.address}")
    env = serve_env(local=True, https=terminates_https(config))
    connect(args.address or "auto", placement, env=env)
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        say("deploying the application (models load in the replicas; first start converts the "
            "bundled model)")  # fmt: skip
        endpoints = launch.start(config, progress=lambda line: say(f"status: {line}"))
        say("ready")
        for line in endpoints.lines():
            print(line, flush=True)
        print("Ctrl-C to stop", flush=True)
        stopping.wait()
        say("draining and stopping")
    finally:
        try:
            launch.stop(application["name"])
        finally:
            ray.shutdown()
    say("stopped")
    return 0


def validation_message(error) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "arguments"
    value = first.get("input")
    return f"{where}: {first['msg']} (got {value!r})"
