"""No pickle on bytes that arrive from the network.

Dynamic: a tripwire replaces every unpickling entry point (``pickle`` / ``_pickle``
``loads``, ``load``, ``Unpickler``; ``ray.cloudpickle`` ``loads``, ``load``; ``shelve.open``;
``torch.load``) with one that records and raises, and an audit hook records
``pickle.find_class`` and ``marshal.load*`` events (they catch a ``loads`` bound before the
patch; the import system's own unmarshalling of .pyc files is left out). Armed, real requests
run in this, the receiving, process: the HTTP API (completions and chat, streaming and not,
models, metrics, health), the gRPC API (Generate, GetModelInfo, Abort, health), and the
internal draft -> target gRPC stream (real blocks from the in-process draft worker, plus a
hand-made block and non-protobuf bytes sent straight to the Verifier). Nothing may trip.
Negative controls: a test-only handler that unpickles its body trips the patch, and one using
a ``loads`` bound before arming trips the audit hook.

Static: no module under ``specray/`` imports a pickle-family module or calls ``yaml.load``
(unsafe loaders), ``torch.load`` without ``weights_only=True``, anything with
``weights_only=False``, ``numpy.load(allow_pickle=True)``, ``eval`` or ``exec``. The
scanner's own negative control flags each pattern in a snippet.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import importlib
import pickle
import sys
import threading
import traceback
from pathlib import Path
from pickle import loads as loads_bound_before_arming

import grpc
import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from specray.client import Client
from specray.rpc.messages import block_to_pb
from specray.sampling import DraftProbsEncoding, encode_draft_probs
from specray.serve.openai_api import build_http_app
from specray.v1 import speculation_pb2, speculation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "specray"
# Entry points that unpickle: module -> names (marshal: by the audit hook, which can tell the
# import system's .pyc loading apart).
UNPICKLERS = {
    "pickle": ("loads", "load", "Unpickler"),
    "_pickle": ("loads", "load", "Unpickler"),
    "ray.cloudpickle": ("loads", "load"),  # pickle's own, bound to names of its own
    "shelve": ("open",),
    "torch": ("load",),
}
AUDIT_EVENTS = ("pickle.find_class", "marshal.loads", "marshal.load")


class PickleTripped(RuntimeError):
    pass


def _importing() -> bool:
    """Whether Python's import system is the caller (it unmarshals .pyc files)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == "<frozen importlib._bootstrap_external>":
            return True
        frame = frame.f_back
    return False


class Tripwire:
    """Records (entry point, thread, stack) of every unpickling attempt while armed."""

    def __init__(self):
        self.armed = False
        self.calls: list[tuple[str, str, str]] = []
        sys.addaudithook(self._audit)  # cannot be removed: it only records while armed

    def _record(self, name: str) -> None:
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        self.calls.append((name, threading.current_thread().name, stack))

    def _audit(self, event: str, args) -> None:
        if self.armed and event in AUDIT_EVENTS and not _importing():
            self._record(f"audit:{event}")

    def _trap(self, name: str):
        def trapped(*args, **kwargs):
            self._record(name)
            raise PickleTripped(f"{name} called on inbound bytes")

        return trapped

    @contextlib.contextmanager
    def arm(self, monkeypatch):
        for module_name, names in UNPICKLERS.items():
            module = importlib.import_module(module_name)
            for name in names:
                monkeypatch.setattr(module, name, self._trap(f"{module_name}.{name}"))
        self.calls.clear()
        self.armed = True
        try:
            yield self.calls
        finally:
            self.armed = False
            monkeypatch.undo()

    def report(self) -> str:
        return "\n".join(
            f"{name} on thread {thread}:\n{stack}" for name, thread, stack in self.calls
        )


@pytest.fixture(scope="module")
def tripwire() -> Tripwire:
    return Tripwire()


# ---- negative controls ---------------------------------------------------------------------
def _unpickling_app() -> FastAPI:
    """Test-only handlers that do what specray must never do."""
    app = FastAPI()

    @app.post("/unpickle")
    async def unpickle(request: Request):
        return JSONResponse({"keys": sorted(pickle.loads(await request.body()))})

    @app.post("/unpickle-early-bound")
    async def unpickle_early_bound(request: Request):
        return JSONResponse(
            {"type": type(loads_bound_before_arming(await request.body())).__name__}
        )

    return app


def test_negative_control_the_tripwire_catches_unpickling_handlers(servers, tripwire, monkeypatch):
    port = servers.http(_unpickling_app())
    payload = pickle.dumps(collections.OrderedDict(a=1))  # names a class: find_class runs
    with tripwire.arm(monkeypatch) as calls:
        response = httpx.post(f"http://127.0.0.1:{port}/unpickle", content=payload, timeout=10)
        assert response.status_code == 500  # PickleTripped, raised in the handler
        assert [name for name, _, _ in calls] == ["pickle.loads"]
        calls.clear()
        response = httpx.post(f"http://127.0.0.1:{port}/unpickle-early-bound", content=payload)
        assert response.json() == {"type": "OrderedDict"}  # the patch missed it ...
        assert [name for name, _, _ in calls] == ["audit:pickle.find_class"]  # ... the hook not


# ---- real requests through every inbound path ----------------------------------------------------
COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


def _http_requests(base: str) -> None:
    with httpx.Client(base_url=base, timeout=120) as client:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for stream in (False, True):
                response = client.post(path, json=body | {"stream": stream, "temperature": 0})
                assert response.status_code == 200, response.text
                if stream:
                    assert response.text.rstrip().endswith("data: [DONE]")
        for path in ("/v1/models", "/metrics", "/health"):
            assert client.get(path).status_code == 200


def _grpc_requests(target: str) -> None:
    with Client(target) as client:
        completion = client.generate("The quick brown fox", max_tokens=8, temperature=0)
        assert completion.token_ids
        chunks = list(client.stream(messages=[CHAT["messages"][0]], max_tokens=8))
        assert chunks[-1].completion is not None
        assert client.model_info().model == "tiny"
        assert client.abort("no-such-request") is False
        assert client.health()


def _verifier_requests(address: str, vocab_size: int) -> None:
    """A real block and bytes that are not a DraftBlock, straight to the internal Verifier."""
    probs = torch.softmax(
        torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(0)), -1
    )
    encoded = encode_draft_probs(probs, DraftProbsEncoding.parse("fp16"))
    block = block_to_pb("security-probe", 1, 3, probs.argmax(-1).tolist(), encoded)
    with grpc.insecure_channel(address) as channel:
        stub = speculation_pb2_grpc.VerifierStub(channel)
        hello = speculation_pb2.DraftUp(worker_id="security-probe")
        up = [hello, speculation_pb2.DraftUp(blocks=[block])]
        assert list(stub.Exchange(iter(up), timeout=30)) == []  # no round waits for it
        raw = channel.stream_stream("/specray.v1.Verifier/Exchange")
        with contextlib.suppress(grpc.RpcError):  # refused by protobuf, whatever the status
            list(raw(iter([b"\xff\xff\xff\xff"]), timeout=30))


def test_no_inbound_path_unpickles(local_backend, servers, tripwire, monkeypatch):
    http_port = servers.http(build_http_app(local_backend))
    grpc_port = servers.grpc(local_backend)
    target = local_backend.workers[0]  # the in-process TargetWorker and its Verifier
    inbox_before = dict(target.inbox.stats.__dict__)
    with tripwire.arm(monkeypatch) as calls:
        _http_requests(f"http://127.0.0.1:{http_port}")
        _grpc_requests(f"127.0.0.1:{grpc_port}")
        _verifier_requests(target.address, target.vocab_size)
    assert not calls, "unpickling on an inbound path:\n" + tripwire.report()
    # The draft -> target stream carried real blocks besides the probe.
    assert target.inbox.stats.received >= inbox_before["received"] + 2


# ---- static: the source ------------------------------------------------------------------------
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "ray.cloudpickle", "dill"}
UNSAFE_MODULES |= {"marshal", "shelve", "joblib", "jsonpickle"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
# (path relative to the repository, finding) -> why it is safe. Empty: nothing needs one.
ALLOWED: dict[tuple[str, str], str] = {}


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_uses(source: str) -> list[str]:
    """Findings in one module's source: ``"line N: what"``."""
    findings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in UNSAFE_MODULES or alias.name.split(".")[0] in UNSAFE_MODULES:
                    findings.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module in UNSAFE_MODULES:
            findings.append(f"line {node.lineno}: from {node.module} import")
        elif isinstance(node, ast.ImportFrom) and node.module == "yaml":
            bad = [a.name for a in node.names if a.name in UNSAFE_YAML]
            if bad:
                findings.append(f"line {node.lineno}: from yaml import {', '.join(bad)}")
        elif isinstance(node, ast.Call):
            function = node.func
            if isinstance(function, ast.Name) and function.id in ("eval", "exec"):
                findings.append(f"line {node.lineno}: {function.id}()")
            if not isinstance(function, ast.Attribute):
                continue
            owner = function.value.id if isinstance(function.value, ast.Name) else None
            if owner == "yaml" and function.attr in UNSAFE_YAML:
                findings.append(f"line {node.lineno}: yaml.{function.attr}()")
            weights_only = _is_true(_keyword(node, "weights_only"))
            if owner == "torch" and function.attr == "load" and not weights_only:
                findings.append(f"line {node.lineno}: torch.load() without weights_only=True")
            allow_pickle = _is_true(_keyword(node, "allow_pickle"))
            if owner in ("np", "numpy") and function.attr == "load" and allow_pickle:
                findings.append(f"line {node.lineno}: numpy.load(allow_pickle=True)")
            weights = _keyword(node, "weights_only")
            if isinstance(weights, ast.Constant) and weights.value is False and owner != "torch":
                findings.append(f"line {node.lineno}: {function.attr}(weights_only=False)")
    return sorted(findings, key=lambda finding: int(finding.split()[1].rstrip(":")))


def test_scanner_negative_control_flags_every_pattern():
    snippet = "\n".join(
        [
            "import pickle",
            "import ray.cloudpickle",
            "from marshal import loads",
            "import shelve",
            "from yaml import load",
            "yaml.load(text, Loader=yaml.Loader)",
            "yaml.unsafe_load(text)",
            "torch.load(path)",
            "torch.load(path, weights_only=False)",
            "np.load(path, allow_pickle=True)",
            "eval(text)",
            "exec(text)",
            "AutoModelForCausalLM.from_pretrained(path, weights_only=False)",
            # Safe forms, not flagged:
            "yaml.safe_load(text)",
            "torch.load(path, weights_only=True)",
            "np.load(path)",
            "json.loads(text)",
        ]
    )
    assert [finding.split(":")[0] for finding in unsafe_uses(snippet)] == [
        f"line {n}" for n in range(1, 14)
    ]


def test_specray_source_uses_no_unsafe_deserializer():
    findings = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        for finding in unsafe_uses(path.read_text()):
            what = finding.split(": ", 1)[1]
            if (relative, what) not in ALLOWED:
                findings.append(f"{relative} {finding}")
    assert not findings, "unsafe deserialization (or allowlist it with a reason):\n" + "\n".join(
        findings
    )


def test_transformers_loads_legacy_checkpoints_weights_only():
    """specray's loaders leave ``weights_only`` at transformers' default: it must stay True."""
    import inspect

    from transformers import modeling_utils

    parameters = inspect.signature(modeling_utils.load_state_dict).parameters
    assert parameters["weights_only"].default is True
    from_pretrained = inspect.signature(modeling_utils.PreTrainedModel.from_pretrained)
    assert from_pretrained.parameters["weights_only"].default is True
