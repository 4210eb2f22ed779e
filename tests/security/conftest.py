"""Fixtures of the security tests: certificates, one event-loop thread, a real LocalBackend
(coordinator with in-process target and draft workers on the tiny chat pair) when a test
needs one. No Ray cluster."""

from __future__ import annotations

import pytest

from tests.security.support import LoopThread, Servers, certificates


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, str]:
    return certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def loop_thread():
    # One loop for the session: gRPC's asyncio poller may deliver a late event to a loop, so
    # no loop is closed under it before the end.
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def servers(loop_thread):
    servers = Servers(loop_thread)
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def local_backend(loop_thread, tmp_path_factory):
    """A real backend: the coordinator, its target worker (with the internal draft -> target
    gRPC server) and a draft worker, all in this process."""
    from specray.engine_core.coordinator import CoordinatorConfig
    from specray.serve.service import LocalBackend
    from tests.helpers.tiny_models import save_tiny_chat_pair

    target, draft = save_tiny_chat_pair(tmp_path_factory.mktemp("chat"))
    config = CoordinatorConfig(num_speculative_tokens=3, adaptive_k=False, num_micro_batches=1)
    backend = loop_thread.run(
        LocalBackend.start(target, draft, model_name="tiny", config=config), timeout_s=300
    )
    yield backend
    loop_thread.run(backend.stop(drain=False))
