"""HTTPS on the OpenAI-compatible API, served the way Ray Serve's HTTP proxy serves it.

``deploy_config`` (what ``specray serve`` deploys) must put the gRPC API's certificate into
Serve's ``http_options``; the server here is started by Serve's own
``start_asgi_http_server`` from exactly those options (no Ray cluster: it is the function
Serve's proxy actor calls). A client trusting the CA gets 200; a plaintext client gets no HTTP
answer; a client trusting another CA, or only the system's roots, fails verification.

Known gap, pinned: Serve (Ray 2.60) hands ``ssl_ca_certs`` to uvicorn without
``ssl_cert_reqs``, so its proxy never asks for a client certificate. mTLS is enforced on the
gRPC API only (tests/integration/test_grpc_api.py); the HTTP API relies on the bearer token.
"""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from specray.serve.config import AppArgs
from specray.serve.launch import deploy_config
from specray.serve.openai_api import build_http_app
from tests.security.support import ScriptedBackend, client_ssl_context


def _serve_http_options(args: AppArgs, **extra):
    from ray.serve.config import HTTPOptions

    options = deploy_config(args, http_host="127.0.0.1", http_port=0)["http_options"]
    return HTTPOptions(**(options | extra))


def _start_with_serve(loop_thread, http_options) -> tuple[int, object]:
    """Serve's proxy HTTP server over the OpenAI app; returns (port, uvicorn server)."""
    from ray.serve._private.http_util import start_asgi_http_server

    app = build_http_app(ScriptedBackend())

    async def start():
        loop = asyncio.get_running_loop()
        _, server = await start_asgi_http_server(app, http_options, event_loop=loop)
        while not server.started:
            await asyncio.sleep(0.01)
        return server

    server = loop_thread.run(start())
    return server.servers[0].sockets[0].getsockname()[1], server


@pytest.fixture(scope="module")
def tls_args(certs) -> AppArgs:
    return AppArgs(tls_cert=certs["server_cert"], tls_key=certs["server_key"])


@pytest.fixture(scope="module")
def https_port(loop_thread, tls_args):
    port, server = _start_with_serve(loop_thread, _serve_http_options(tls_args))
    yield port
    server.should_exit = True


def test_deploy_config_gives_serves_http_proxy_the_certificate(certs, tls_args):
    options = deploy_config(tls_args)["http_options"]
    assert (options["ssl_certfile"], options["ssl_keyfile"]) == (
        certs["server_cert"],
        certs["server_key"],
    )
    plain = deploy_config(AppArgs())["http_options"]
    assert plain == {"host": "127.0.0.1", "port": 8000}  # loopback unless told otherwise


def test_a_client_trusting_the_ca_gets_200(https_port, certs):
    verify = client_ssl_context(certs["ca"])
    for host in ("localhost", "127.0.0.1"):
        response = httpx.get(f"https://{host}:{https_port}/v1/models", verify=verify)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["id"] == "tiny"


def test_a_plaintext_client_gets_no_http_answer(https_port):
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{https_port}/health", timeout=10)


@pytest.mark.parametrize("trust", ["other_ca", None])
def test_a_client_not_trusting_the_ca_fails_verification(https_port, certs, trust):
    verify = client_ssl_context(certs[trust] if trust else None)  # None: the system's roots
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://localhost:{https_port}/health", verify=verify, timeout=10)


def test_known_gap_serves_http_proxy_does_not_require_client_certificates(
    loop_thread, certs, tls_args
):
    """If this fails, Serve now enforces ``ssl_ca_certs``: pass ``tls_client_ca`` into
    ``http_options`` and update docs/security.md ("mTLS")."""
    options = _serve_http_options(tls_args, ssl_ca_certs=certs["ca"])
    port, server = _start_with_serve(loop_thread, options)
    try:
        verify = client_ssl_context(certs["ca"])  # no client certificate
        response = httpx.get(f"https://localhost:{port}/health", verify=verify, timeout=10)
        assert response.status_code == 200
        assert server.config.ssl_cert_reqs == ssl.CERT_NONE  # uvicorn's default, kept by Serve
    finally:
        server.should_exit = True
