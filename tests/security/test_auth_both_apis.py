"""Bearer-token auth on both public APIs, over plaintext and TLS.

No token, a wrong one, or the right one under another scheme or in another place is refused:
HTTP 401 with OpenAI's error body and ``WWW-Authenticate: Bearer``, gRPC UNAUTHENTICATED;
neither answer carries any part of the token, and the backend is never reached. The right
token works. ``/health`` and ``grpc.health.v1`` stay open (probes carry no credentials). The
comparison is ``hmac.compare_digest`` and nothing else decides: forced to say "different", it
refuses the right token.
"""

from __future__ import annotations

import base64
import hmac

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specray.serve.openai_api import build_http_app
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc
from tests.security.support import TOKEN, ScriptedBackend, client_ssl_context

TRANSPORTS = ["plaintext", "tls"]
BASIC = base64.b64encode(f"user:{TOKEN}".encode()).decode()
# Credentials that must not work: (label, headers, query string).
HTTP_REFUSED = {
    "no token": ({}, ""),
    "wrong token": ({"Authorization": "Bearer wrong-token"}, ""),
    "token prefix": ({"Authorization": f"Bearer {TOKEN[:-1]}"}, ""),
    "token plus a character": ({"Authorization": f"Bearer {TOKEN}x"}, ""),
    "bare scheme": ({"Authorization": "Bearer"}, ""),
    "basic scheme": ({"Authorization": f"Basic {BASIC}"}, ""),
    "token scheme": ({"Authorization": f"Token {TOKEN}"}, ""),
    "no scheme": ({"Authorization": TOKEN}, ""),
    "x-api-key header": ({"X-Api-Key": TOKEN}, ""),
    "query string": ({}, f"?api_key={TOKEN}"),
}
GRPC_REFUSED = {
    "no token": (),
    "wrong token": (("authorization", "Bearer wrong-token"),),
    "token prefix": (("authorization", f"Bearer {TOKEN[:-1]}"),),
    "basic scheme": (("authorization", f"Basic {BASIC}"),),
    "no scheme": (("authorization", TOKEN),),
    "x-api-key metadata": (("x-api-key", TOKEN),),
}
RIGHT = (("authorization", f"Bearer {TOKEN}"),)
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HTTP_ROUTES = [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
]


class Endpoints:
    def __init__(self, servers, certs):
        self.certs = certs
        self.backend = ScriptedBackend()
        app = build_http_app(self.backend, auth_token=TOKEN)
        tls = {"ssl_certfile": certs["server_cert"], "ssl_keyfile": certs["server_key"]}
        self.http_ports = {"plaintext": servers.http(app), "tls": servers.http(app, **tls)}
        from specray.serve.grpc_api import TLSConfig

        grpc_tls = TLSConfig(certs["server_cert"], certs["server_key"])
        self.grpc_ports = {
            "plaintext": servers.grpc(self.backend, auth_token=TOKEN),
            "tls": servers.grpc(self.backend, auth_token=TOKEN, tls=grpc_tls),
        }

    def http(self, transport: str) -> httpx.Client:
        if transport == "tls":
            verify = client_ssl_context(self.certs["ca"])
            base = f"https://localhost:{self.http_ports['tls']}"
        else:
            verify, base = True, f"http://127.0.0.1:{self.http_ports['plaintext']}"
        return httpx.Client(base_url=base, verify=verify, timeout=30)

    def channel(self, transport: str) -> grpc.Channel:
        target = f"localhost:{self.grpc_ports[transport]}"
        if transport == "plaintext":
            return grpc.insecure_channel(target)
        with open(self.certs["ca"], "rb") as handle:
            credentials = grpc.ssl_channel_credentials(root_certificates=handle.read())
        return grpc.secure_channel(target, credentials)


@pytest.fixture(scope="module")
def endpoints(servers, certs):
    return Endpoints(servers, certs)


def _no_token_trace(text: str) -> None:
    # Any 6-character slice of the token would be a hint; the whole token even more so.
    for start in range(len(TOKEN) - 5):
        assert TOKEN[start : start + 6] not in text, f"part of the token leaked: {text!r}"


# ---- HTTP --------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("label", HTTP_REFUSED)
def test_http_refuses_without_the_right_bearer_token(endpoints, transport, label):
    headers, query = HTTP_REFUSED[label]
    seen = len(endpoints.backend.requests)
    with endpoints.http(transport) as client:
        for method, path, body in HTTP_ROUTES:
            response = client.request(method, path + query, headers=headers, json=body)
            assert response.status_code == 401, (label, path, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
            _no_token_trace(response.text + str(response.headers))
    assert len(endpoints.backend.requests) == seen, "the backend was reached"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_http_accepts_the_right_bearer_token(endpoints, transport):
    with endpoints.http(transport) as client:
        for method, path, body in HTTP_ROUTES:
            for scheme in ("Bearer", "bearer"):  # RFC 9110: the scheme is case-insensitive
                headers = {"Authorization": f"{scheme} {TOKEN}"}
                response = client.request(method, path, headers=headers, json=body)
                assert response.status_code == 200, (path, response.text)
        completion = client.post("/v1/completions", headers=dict([RIGHT[0]]), json=COMPLETION)
        assert completion.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_http_health_needs_no_token(endpoints, transport):
    with endpoints.http(transport) as client:
        response = client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


# ---- gRPC --------------------------------------------------------------------------------------
def _grpc_calls(channel: grpc.Channel, metadata):
    """Every public method once: (name, a callable that makes the call)."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    list_services = reflection_pb2.ServerReflectionRequest(list_services="")
    return {
        "Generate": lambda: list(
            stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2), metadata=metadata)
        ),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
        "Abort": lambda: stub.Abort(pb.AbortRequest(request_id="r-1"), metadata=metadata),
        "Reflection": lambda: list(
            reflection.ServerReflectionInfo(iter([list_services]), metadata=metadata)
        ),
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("label", GRPC_REFUSED)
def test_grpc_refuses_without_the_right_bearer_token(endpoints, transport, label):
    seen = len(endpoints.backend.requests)
    with endpoints.channel(transport) as channel:
        for method, call in _grpc_calls(channel, GRPC_REFUSED[label]).items():
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, (label, method)
            _no_token_trace(caught.value.details() or "")
    assert len(endpoints.backend.requests) == seen, "the backend was reached"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_grpc_accepts_the_right_bearer_token(endpoints, transport):
    with endpoints.channel(transport) as channel:
        calls = _grpc_calls(channel, RIGHT)
        responses = calls["Generate"]()
        assert responses[-1].final.text == "ok"
        assert calls["GetModelInfo"]().model == "tiny"
        assert calls["Abort"]().aborted is False
        assert calls["Reflection"]()[0].list_services_response.service


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_grpc_health_needs_no_token(endpoints, transport):
    with endpoints.channel(transport) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specray.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ---- constant-time comparison ----------------------------------------------------------------
def test_the_token_is_compared_by_compare_digest_alone(endpoints, monkeypatch):
    """Every check goes through ``hmac.compare_digest`` (recorded here); forced to answer
    "different", it makes both APIs refuse the right token, so no other comparison decides."""
    original, compared, verdict = hmac.compare_digest, [], {"force": None}

    def recording(given, expected):
        compared.append((given, expected))
        return original(given, expected) if verdict["force"] is None else verdict["force"]

    monkeypatch.setattr(hmac, "compare_digest", recording)
    with endpoints.http("plaintext") as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/v1/models", headers=dict(RIGHT)).status_code == 200
        assert len(compared) == 2
        verdict["force"] = False
        assert client.get("/v1/models", headers=dict(RIGHT)).status_code == 401
    verdict["force"] = None
    with endpoints.channel("plaintext") as channel:
        calls = _grpc_calls(channel, RIGHT)
        assert calls["GetModelInfo"]().model == "tiny"
        assert len(compared) == 4
        verdict["force"] = False
        with pytest.raises(grpc.RpcError) as caught:
            calls["GetModelInfo"]()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
