"""Error answers never carry stack traces, internal paths, internal exception names or the raw
message of an internal error; the server logs the error instead.

Backends here raise ``RuntimeError`` / ``KeyError`` whose messages hold a file path and a secret
at every point a request passes (before the first event, mid-stream, model info, abort); both
APIs answer with the generic internal error. Malformed requests get a 4xx / INVALID_ARGUMENT
naming the problem, again without internals. The Serve ``Coordinator`` deployment's error
events obey the same rule.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from specray.serve.openai_api import MAX_BODY_BYTES, build_http_app
from specray.v1 import generation_pb2 as pb
from specray.v1 import generation_pb2_grpc
from tests.security.support import ScriptedBackend, assert_no_leak

SECRET_DETAIL = "sk-internal-4d1e"
INTERNAL_MESSAGE = f"cannot open /work/main/specray/secret_module.py: {SECRET_DETAIL}"
RAW = ("secret_module", SECRET_DETAIL)  # parts of the raw message a client must not see
FAILURES = {
    "RuntimeError before the first event": (lambda: RuntimeError(INTERNAL_MESSAGE), "start"),
    "RuntimeError mid-stream": (lambda: RuntimeError(INTERNAL_MESSAGE), "mid"),
    "KeyError in model_info": (lambda: KeyError(INTERNAL_MESSAGE), "model_info"),
}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def failing(servers):
    """Per failure: (HTTP port, gRPC port) over a backend that fails that way."""
    ports = {}
    for label, (fail, where) in FAILURES.items():
        backend = ScriptedBackend(fail, where)
        ports[label] = (servers.http(build_http_app(backend)), servers.grpc(backend))
    abort_backend = ScriptedBackend(lambda: RuntimeError(INTERNAL_MESSAGE), "abort")
    ports["abort"] = (None, servers.grpc(abort_backend))
    return ports


@pytest.fixture(scope="module")
def healthy(servers):
    backend = ScriptedBackend()
    return servers.http(build_http_app(backend)), servers.grpc(backend)


def _generic_internal(body: dict) -> None:
    assert body == {
        "error": {
            "message": "internal server error",
            "type": "internal_error",
            "param": None,
            "code": None,
        }
    }


# ---- HTTP --------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", FAILURES)
@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_http_internal_errors_are_generic_and_logged(failing, caplog, label, path, body):
    base = f"http://127.0.0.1:{failing[label][0]}"
    for stream in (False, True):
        caplog.clear()
        response = httpx.post(base + path, json=body | {"stream": stream}, timeout=30)
        assert_no_leak(response.text, *RAW)
        if stream and FAILURES[label][1] == "mid":
            # The stream had started: the error is its last event, and [DONE] never comes.
            assert response.status_code == 200
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] != "[DONE]"
            _generic_internal(json.loads(events[-1]))
        else:
            assert response.status_code == 500, response.text
            _generic_internal(response.json())
        assert INTERNAL_MESSAGE in caplog.text, "the error was not logged server-side"


def test_http_models_route_error_is_generic(failing, caplog):
    response = httpx.get(f"http://127.0.0.1:{failing['KeyError in model_info'][0]}/v1/models")
    assert response.status_code == 500
    assert_no_leak(response.text, *RAW)
    _generic_internal(response.json())
    assert INTERNAL_MESSAGE in caplog.text


MALFORMED = {
    "invalid JSON": ({"content": b"{not json"}, 400),
    "bad UTF-8": ({"content": b'{"prompt": "\xff\xfe"}'}, 400),
    "deeply nested JSON": ({"content": b"[" * 100_000 + b"]" * 100_000}, 400),
    "JSON array body": ({"json": [1, 2]}, 400),
    "wrong field type": ({"json": COMPLETION | {"max_tokens": "many"}}, 400),
    "unknown field": ({"json": COMPLETION | {"__class__": "x"}}, 400),
    "wrong content type": ({"content": b"x", "headers": {"Content-Type": "text/plain"}}, 415),
    "body too large": ({"content": b" " * (MAX_BODY_BYTES + 1)}, 413),
}


@pytest.mark.parametrize("label", MALFORMED)
def test_http_malformed_requests_name_the_problem_without_internals(healthy, label):
    options, status = MALFORMED[label]
    options = {"headers": {"Content-Type": "application/json"}} | options
    response = httpx.post(f"http://127.0.0.1:{healthy[0]}/v1/completions", timeout=30, **options)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["message"] != "internal server error"
    assert_no_leak(response.text)


@pytest.mark.parametrize("method, path", [("GET", "/nowhere/../etc/passwd"), ("DELETE", "/health")])
def test_http_routing_errors_are_openai_shaped(healthy, method, path):
    response = httpx.request(method, f"http://127.0.0.1:{healthy[0]}{path}")
    assert response.status_code in (404, 405)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert_no_leak(response.text)


# ---- gRPC --------------------------------------------------------------------------------------
def _grpc_error(port: int, call) -> grpc.RpcError:
    with (
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        call(generation_pb2_grpc.GenerationStub(channel), channel)
    return caught.value


GRPC_CALLS = {
    "Generate": lambda stub, _: list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2))),
    "GetModelInfo": lambda stub, _: stub.GetModelInfo(pb.GetModelInfoRequest()),
    "Abort": lambda stub, _: stub.Abort(pb.AbortRequest(request_id="r-1")),
}
GRPC_FAILING = [
    ("RuntimeError before the first event", "Generate"),
    ("RuntimeError mid-stream", "Generate"),
    ("KeyError in model_info", "GetModelInfo"),
    ("abort", "Abort"),
]


@pytest.mark.parametrize("label, method", GRPC_FAILING)
def test_grpc_internal_errors_are_generic_and_logged(failing, caplog, label, method):
    error = _grpc_error(failing[label][1], GRPC_CALLS[method])
    assert (error.code(), error.details()) == (grpc.StatusCode.INTERNAL, "internal error")
    assert_no_leak(error.details() + str(error.trailing_metadata()), *RAW)
    assert INTERNAL_MESSAGE in caplog.text, "the error was not logged server-side"


GRPC_MALFORMED = {
    "no prompt": lambda stub, _: list(stub.Generate(pb.GenerateRequest(max_tokens=2))),
    "negative token id": lambda stub, _: list(
        stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, -1])))
    ),
    "empty abort id": lambda stub, _: stub.Abort(pb.AbortRequest()),
    "bytes that are not protobuf": lambda _, channel: channel.unary_unary(
        "/specray.v1.Generation/GetModelInfo"
    )(b"\xff\xff\xff\xff", timeout=10),
}


@pytest.mark.parametrize("label", GRPC_MALFORMED)
def test_grpc_malformed_requests_carry_no_internals(healthy, label):
    error = _grpc_error(healthy[1], GRPC_MALFORMED[label])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert_no_leak(error.details() or "")


# ---- the Serve path: the Coordinator deployment's error events --------------------------------
class _RaisingService:
    def __init__(self, error: Exception):
        self.error = error

    async def generate(self, request):
        raise self.error
        yield  # an async generator, as the real service


@pytest.mark.parametrize("error", [ValueError(INTERNAL_MESSAGE), TypeError(INTERNAL_MESSAGE)])
def test_the_ingress_does_not_pass_internal_errors_as_invalid_requests(error):
    """A ValueError raised inside generation is a bug, not the client's input: the ingress's
    groups backend must not turn it into ``invalid_request_error`` (nor resume it); it reaches
    the API layer as is, which answers a generic 500 without its message."""
    from specray.errors import SpecrayError
    from specray.serve.groups import Group, GroupsBackend
    from specray.serve.protocol import GenerateRequest

    class _Session:
        healthy, in_flight = True, 0

    backend = object.__new__(GroupsBackend)  # only the groups are used by generate()
    backend.groups = {"g": Group("g", "", None, _Session(), _RaisingService(error))}
    backend._where, backend.resumes = {}, 0

    async def events() -> BaseException:
        try:
            async for _ in backend.generate(GenerateRequest(prompt="hi")):
                pass
        except Exception as raised:
            return raised
        raise AssertionError("the error vanished")

    raised = asyncio.run(events())
    assert raised is error and not isinstance(raised, SpecrayError)
    assert backend.resumes == 0
