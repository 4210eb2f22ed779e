"""The OpenAI-compatible HTTP app over a LocalBackend, served by uvicorn on a thread of its own
(the backend lives on that thread's event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from specray.serve.openai_api import build_http_app
from specray.serve.service import LocalBackend


@contextlib.contextmanager
def serve_backend(
    start: Callable[[], Awaitable[LocalBackend]], timeout_s: float = 120.0
) -> Iterator[str]:
    """Start the backend ``start()`` makes and its HTTP app; yields the API's base URL
    (``http://127.0.0.1:<port>/v1``); stops both on exit."""
    ready, state = threading.Event(), {}

    async def main() -> None:
        backend = await start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(
            uvicorn.Config(build_http_app(backend), log_level="warning", lifespan="off")
        )
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        state.update(url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server=server)
        ready.set()
        try:
            await task
        finally:
            await backend.stop(drain=False)

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="uvicorn", daemon=True)
    thread.start()
    assert ready.wait(timeout_s), "the server did not start"
    try:
        yield state["url"]
    finally:
        state["server"].should_exit = True
        thread.join(60)
