"""Shared fuzz fixtures: the case tally of each test, and one real server for the HTTP and gRPC
fuzz tests: a :class:`LocalBackend` (coordinator, in-process target and draft workers) on the
tiny chat pair, with the OpenAI app (open and bearer-authenticated) and the gRPC server on
loopback, all on one event loop thread. HTTP cases reach the app in process (httpx's ASGI
transport, on that loop); gRPC cases go over a real loopback channel."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc
import httpx
import pytest

from specray.engine_core.coordinator import CoordinatorConfig
from specray.serve.grpc_api import start_grpc_server
from specray.serve.openai_api import build_http_app
from specray.serve.service import LocalBackend
from tests.fuzz.budget import Tally
from tests.helpers.tiny_models import save_tiny_chat_pair

MODEL = "tiny"
TOKEN = "fuzz-secret-token"
MAX_POSITIONS = 96  # bounds every generation, whatever max_tokens a case asks for
CASE_TIMEOUT_S = 60.0  # one case taking longer than this is a hang


@pytest.fixture
def tally(request):
    counter = Tally(request.node.nodeid)
    yield counter
    counter.record()


@dataclass
class HttpResult:
    status: int
    headers: httpx.Headers
    content: bytes


@dataclass
class Served:
    loop: asyncio.AbstractEventLoop
    backend: LocalBackend
    vocab_size: int
    grpc_address: str
    clients: dict  # app name ("open" | "auth") -> httpx.AsyncClient on the loop

    def run(self, coroutine, timeout_s: float = CASE_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def http(self, method: str, url: str, *, app: str = "open", **kwargs) -> HttpResult:
        """One in-process request; raises TimeoutError when the app hangs."""

        async def send() -> HttpResult:
            response = await self.clients[app].request(method, url, **kwargs)
            return HttpResult(response.status_code, response.headers, response.content)

        return self.run(send())

    def idle(self) -> bool:
        coordinator = self.backend.engine
        return coordinator.num_running == 0 and coordinator.num_waiting == 0


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    target, draft = save_tiny_chat_pair(
        tmp_path_factory.mktemp("fuzz-chat"), max_positions=MAX_POSITIONS
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-server", daemon=True)
    thread.start()

    async def start():
        config = CoordinatorConfig(num_speculative_tokens=4)
        backend = await LocalBackend.start(target, draft, model_name=MODEL, config=config)
        server, port = await start_grpc_server(backend, host="127.0.0.1", port=0)
        clients = {
            name: httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                base_url="http://specray.fuzz",
            )
            for name, app in (
                ("open", build_http_app(backend)),
                ("auth", build_http_app(backend, auth_token=TOKEN)),
            )
        }
        return backend, server, port, clients

    backend, server, port, clients = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
    served = Served(loop, backend, backend.engine.vocab_size, f"127.0.0.1:{port}", clients)
    yield served

    async def stop():
        for client in clients.values():
            await client.aclose()
        await server.stop(1)
        await backend.stop(drain=False)

    served.run(stop())
    # The loop stays open (gRPC's poller may still post to it); its daemon thread ends with us.


@pytest.fixture(scope="session")
def grpc_channel(served):
    channel = grpc.insecure_channel(served.grpc_address)
    grpc.channel_ready_future(channel).result(timeout=30)
    yield channel
    channel.close()
