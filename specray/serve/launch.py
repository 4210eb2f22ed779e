"""Run the application on a Ray cluster (the embedded local one by default) and stop it.

One path for ``specray serve``, the demo and the end-to-end tests: a Serve deploy config
(what ``serve deploy serve_config.yaml`` takes), so that the application-level autoscaling
policy applies — ``serve.run`` cannot carry it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specray.serve.config import AppArgs

APP_NAME = "specray"
IMPORT_PATH = "specray.serve:build_app"


def http_options(args: AppArgs, *, host: str, port: int) -> dict:
    """Serve's HTTP proxy options: HTTPS with the gRPC API's certificate when there is one.

    ``tls_client_ca`` is left out on purpose: Serve (Ray 2.60) gives uvicorn ``ssl_ca_certs``
    without ``ssl_cert_reqs``, so its proxy would never ask for a client certificate. mTLS
    applies to the gRPC API; the HTTP API relies on the bearer token.
    """
    options = {"host": host, "port": port}
    if args.tls_cert is not None:
        options |= {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
    return options


def deploy_config(
    args: AppArgs, *, app_name: str = APP_NAME, http_host: str = "127.0.0.1", http_port: int = 8000
) -> dict:
    """The Serve deploy config (``ServeDeploySchema``) of one specray application."""
    application = {"name": app_name, "route_prefix": "/", "import_path": IMPORT_PATH}
    if args.autoscaled:
        from specray.cluster.autoscaling import (
            application_autoscaling_policy,
            supports_custom_policies,
        )

        scope = "application" if supports_custom_policies() else "plain"
        args = args.model_copy(update={"autoscaling": scope})
        if scope == "application":
            policy = application_autoscaling_policy(args.autoscaling_settings())
            application["autoscaling_policy"] = policy
    application["args"] = args.model_dump(exclude_defaults=True)
    return {
        "proxy_location": "HeadOnly",
        "http_options": http_options(args, host=http_host, port=http_port),
        "applications": [application],
    }


@dataclass(frozen=True)
class Endpoints:
    http: str  # base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000
    grpc: str | None  # host:port of the gRPC API

    def lines(self) -> list[str]:
        lines = [
            f"OpenAI HTTP  {self.http}/v1  (completions, chat/completions, models)",
            f"health       {self.http}/health",
            f"metrics      {self.http}/metrics",
        ]
        if self.grpc:
            lines.insert(1, f"gRPC         {self.grpc}  (specray.v1.Generation)")
        return lines


def start(
    config: dict,
    *,
    timeout_s: float = 900.0,
    progress: Callable[[str], None] = lambda line: None,
) -> Endpoints:
    """Deploy ``config`` (a Serve deploy config) on the connected Ray cluster and wait until
    every application runs. Raises RuntimeError with Serve's message if a deploy fails."""
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema(**config)
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(), proxy_location=schema.proxy_location
    )
    client.deploy_apps(schema, _blocking=False)
    names = [app.name for app in schema.applications]
    deadline = time.monotonic() + timeout_s
    seen = ""
    while True:
        status = serve.status()
        states = {name: status.applications.get(name) for name in names}
        line = ", ".join(
            f"{name}: {getattr(app.status, 'value', app.status) if app else 'pending'}"
            for name, app in states.items()
        )
        if line != seen:
            progress(line)
            seen = line
        failed = [(n, a) for n, a in states.items() if a and a.status == "DEPLOY_FAILED"]
        if failed:
            name, app = failed[0]
            raise RuntimeError(f"application {name!r} failed to deploy: {app.message}")
        if all(app and app.status == "RUNNING" for app in states.values()):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"applications not running after {timeout_s:.0f} s: {line}")
        time.sleep(1.0)
    http = schema.http_options
    host = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
    args = AppArgs(**schema.applications[0].args)
    grpc = f"{host}:{args.grpc_port}" if args.grpc_port is not None else None
    scheme = "https" if http.ssl_certfile else "http"
    return Endpoints(http=f"{scheme}://{host}:{http.port}", grpc=grpc)


def stop(app_name: str = APP_NAME) -> None:
    """Drain and delete the application, then stop Serve (the registry goes with it)."""
    from ray import serve

    from specray.serve.registry import kill_registry

    serve.delete(app_name, _blocking=True)
    kill_registry(app_name)
    serve.shutdown()
