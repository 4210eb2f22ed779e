"""The Serve settings specray starts Ray with (specray.cluster.serve_env): HAProxy ingress
unless Serve itself terminates HTTPS, a short drain on one machine, and an operator's own
environment always wins."""

from __future__ import annotations

import socket

from specray.cluster.serve_env import (
    HAPROXY_PORT_VARIABLES,
    LOCAL_SERVE_ENV,
    SERVE_ENV,
    apply_serve_env,
    serve_env,
)


def test_haproxy_ingress_unless_serve_terminates_https():
    assert serve_env(local=False)["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert serve_env(local=True, https=True) == {}
    assert serve_env(local=False, https=True) == {}


def test_only_a_local_cluster_shortens_the_drain():
    drain = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
    assert drain not in serve_env(local=False)  # Ray's default: for balancers in front
    assert float(serve_env(local=True)[drain]) < 30
    assert set(LOCAL_SERVE_ENV) - set(SERVE_ENV) == {drain}


def test_a_local_cluster_gives_haproxy_free_ports_of_its_own():
    """Two clusters on one machine: each HAProxy's exporter and stats page on a free port,
    not Ray's fixed 9101 / 8404."""
    first, second = serve_env(local=True), serve_env(local=True)
    ports = [int(env[name]) for env in (first, second) for name in HAPROXY_PORT_VARIABLES]
    assert not {9101, 8404} & set(ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))  # free when handed out
    assert not set(HAPROXY_PORT_VARIABLES) & set(serve_env(local=False))


def test_the_environment_already_set_wins():
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "0", "OTHER": "x"}
    applied = apply_serve_env(serve_env(local=True), env)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in applied
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["OTHER"] == "x"
