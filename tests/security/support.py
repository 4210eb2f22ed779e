"""What the security tests share: certificates, an event loop on a thread, servers for both
public APIs on loopback, and a scripted backend that loads no model."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

TOKEN = "tok-7f3a9c51e2d84b06"  # distinctive: a test can look for any trace of it
WAIT_S = 60.0
# What an error body must never carry: traces, file paths, internal exception class names.
LEAK_MARKERS = ("Traceback", ".py", "/work/", "site-packages", "RuntimeError", "KeyError")
LEAK_MARKERS += ("DecodeError", "<class ", 'File "')


# ---- certificates --------------------------------------------------------------------------
def certificates(folder: Path) -> dict[str, str]:
    """PEM files under ``folder``: a CA ("ca") with a server certificate for localhost /
    127.0.0.1 ("server_cert", "server_key") and a client certificate ("client_cert",
    "client_key"); an unrelated CA ("other_ca") with its own client certificate
    ("other_client_cert", "other_client_key")."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def issue(subject: str, key, issuer, issuer_key, *, san=None, usage=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer.subject if issuer is not None else name(subject))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    files: dict[str, str] = {}

    def write(label: str, file_name: str, data: bytes) -> None:
        path = folder / file_name
        path.write_bytes(data)
        files[label] = str(path)

    def write_key(label: str, file_name: str, key) -> None:
        no_password = serialization.NoEncryption()
        write(
            label, file_name, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_password)
        )

    keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(5)]
    ca_key, server_key, client_key, other_ca_key, other_client_key = keys
    ca = issue("specray security test CA", ca_key, None, ca_key)
    other_ca = issue("an unrelated CA", other_ca_key, None, other_ca_key)
    server = issue(
        "localhost", server_key, ca, ca_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
    )  # fmt: skip
    client_usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    client = issue("client", client_key, ca, ca_key, usage=client_usage)
    other_client = issue(
        "other client", other_client_key, other_ca, other_ca_key, usage=client_usage
    )
    write("ca", "ca.pem", ca.public_bytes(pem))
    write("other_ca", "other-ca.pem", other_ca.public_bytes(pem))
    write("server_cert", "server.pem", server.public_bytes(pem))
    write_key("server_key", "server.key", server_key)
    write("client_cert", "client.pem", client.public_bytes(pem))
    write_key("client_key", "client.key", client_key)
    write("other_client_cert", "other-client.pem", other_client.public_bytes(pem))
    write_key("other_client_key", "other-client.key", other_client_key)
    return files


def client_ssl_context(trust: str | None, cert: str | None = None, key: str | None = None):
    """An HTTPS client context trusting the CA file ``trust`` (None: the system's roots)."""
    context = ssl.create_default_context(cafile=trust)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


# ---- event loop and servers ------------------------------------------------------------------
class LoopThread:
    """An event loop on a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout_s: float = WAIT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class Servers:
    """HTTP (uvicorn) and gRPC servers on one loop thread, stopped together by :meth:`close`."""

    def __init__(self, loop: LoopThread):
        self.loop = loop
        self._uvicorn: list[uvicorn.Server] = []
        self._grpc: list = []

    def http(self, app, **ssl_options) -> int:
        """Serve the ASGI ``app`` on a free loopback port (``ssl_*``: uvicorn's TLS options)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, log_level="critical", lifespan="off", **ssl_options)
        server = uvicorn.Server(config)
        self._uvicorn.append(server)

        async def start() -> None:
            asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
            while not server.started:
                await asyncio.sleep(0.01)

        self.loop.run(start())
        return sock.getsockname()[1]

    def grpc(self, backend, **options) -> int:
        from specray.serve.grpc_api import start_grpc_server

        server, port = self.loop.run(start_grpc_server(backend, host="127.0.0.1", **options))
        self._grpc.append(server)
        return port

    def close(self) -> None:
        for server in self._uvicorn:
            server.should_exit = True
        for server in self._grpc:
            self.loop.run(server.stop(0))


# ---- a scripted backend ------------------------------------------------------------------------
def final_event(request_id: str, text: str) -> dict:
    return {
        "kind": "final",
        "request_id": request_id,
        "text": text,
        "token_ids": [1, 2],
        "finish_reason": "length",
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "seed": 7,
        "speculative_decoding": {
            "num_drafts": 1,
            "num_draft_tokens": 2,
            "num_accepted_tokens": 1,
            "num_accepted_tokens_per_pos": [1, 0],
            "acceptance_rate": 0.5,
            "mean_acceptance_length": 2.0,
        },
        "time_to_first_token_s": 0.01,
        "latency_s": 0.02,
    }


class ScriptedBackend:
    """A :class:`specray.serve.protocol.GenerationBackend` that answers "ok" at once, or raises
    ``fail()`` where ``fail_at`` says: "start" (before any event), "mid" (after a delta),
    "model_info", "abort"."""

    def __init__(self, fail: Callable[[], Exception] | None = None, fail_at: str = "start"):
        self.fail, self.fail_at = fail, fail_at
        self.requests: list = []

    def _maybe_fail(self, where: str) -> None:
        if self.fail is not None and self.fail_at == where:
            raise self.fail()

    async def generate(self, request):
        self.requests.append(request)
        self._maybe_fail("start")
        yield {"kind": "delta", "text": "o", "token_ids": [1]}
        self._maybe_fail("mid")
        yield final_event(request.request_id or "req", "ok")

    async def model_info(self) -> dict:
        self._maybe_fail("model_info")
        info = {"model": "tiny", "max_model_len": 64, "vocab_size": 8, "draft": "d"}
        return info | {"num_speculative_tokens": 2, "eos_token_ids": [0]}

    async def abort(self, request_id: str) -> bool:
        self._maybe_fail("abort")
        return False

    async def health(self) -> bool:
        return True

    async def metrics_text(self) -> bytes:
        return b"# specray metrics\n"


def assert_no_leak(text: str, *also: str) -> None:
    """``text`` (a body, a status message) carries none of :data:`LEAK_MARKERS` nor ``also``."""
    for marker in (*LEAK_MARKERS, *also):
        assert marker not in text, f"{marker!r} leaked to the client: {text!r}"
