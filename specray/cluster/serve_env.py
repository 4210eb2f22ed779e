"""The Ray Serve settings specray runs with.

Serve reads these from the environment of every Ray process (controller, proxies, replicas)
when it is imported, so they are set where Ray starts, never in the application: the embedded
local Ray (:func:`specray.cluster.distributed.connect`), ``specray cluster up --local`` (its
``ray start`` nodes) and the chart's pods (``rayServe`` in ``helm/specray/values.yaml``). A
variable already in the environment wins, so an operator can turn any of them off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from specray.cluster.ports import free_ports

# HTTP straight to the ingress replicas: HAProxy (bundled with ray[serve]) listens on the HTTP
# port and forwards each connection to a replica's own uvicorn server, where Serve's Python
# proxy would relay every request and body chunk over actor calls (docs/bench/history.md).
# The parts of Serve's throughput profile that hold for any caller: user code on the
# replica's own event loop (no hop to a second loop per request and per body chunk), access
# logs written in batches. Not its router on the caller's loop, which breaks deployment
# handles used outside asyncio (a driver's script).
SERVE_ENV: Mapping[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}

# An ingress replica that stops keeps serving this long so that load balancers in front
# notice first; Ray's default (30 s) is for external ones. On one machine the only balancer is
# Serve's own HAProxy, which hears of the change within a fraction of a second.
LOCAL_DRAIN_S = 2.0
LOCAL_SERVE_ENV: Mapping[str, str] = {
    **SERVE_ENV,
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(LOCAL_DRAIN_S),
}


# HAProxy's own listeners (Prometheus exporter, stats page) default to fixed ports (9101,
# 8404): a second cluster on the same machine could not start its HAProxy. A local cluster
# takes free ones.
HAPROXY_PORT_VARIABLES = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT")


def serve_env(*, local: bool, https: bool = False) -> dict[str, str]:
    """The variables for Ray processes about to start. ``local``: every node on this machine.
    ``https``: Serve's HTTP options carry a certificate; Ray's HAProxy ingress does not
    terminate TLS (Ray 2.60), so Serve's own proxy, which does, stays in front."""
    if https:
        return {}
    if not local:
        return dict(SERVE_ENV)
    # HAProxy binds these on every interface.
    ports = free_ports(len(HAPROXY_PORT_VARIABLES), host="")
    haproxy = dict(zip(HAPROXY_PORT_VARIABLES, map(str, ports), strict=True))
    return {**LOCAL_SERVE_ENV, **haproxy}


def terminates_https(deploy_config: Mapping) -> bool:
    """Whether a Serve deploy config has Serve itself serve HTTPS (its HTTP options carry a
    certificate): the ``https`` of :func:`serve_env`."""
    return bool((deploy_config.get("http_options") or {}).get("ssl_certfile"))


def apply_serve_env(env: Mapping[str, str], target: dict | None = None) -> dict:
    """Set ``env`` in ``target`` (default: this process's environment, which Ray processes
    started from here inherit) where it holds no value yet; returns what was set."""
    target = os.environ if target is None else target
    applied = {key: value for key, value in env.items() if key not in target}
    target.update(applied)
    return applied
