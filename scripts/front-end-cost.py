"""What a front end costs the served closed loop (docs/bench/history.md: "Where the served
paths' closed loop loses"): the overhead bench's tiny target, target-only, 32 tokens a request
(ignore_eos); one distributed Engine, and on its engine core, in turns:

- ``waves``: the engine given each wave of 16 requests as one batch (the overhead bench's
  reference);
- ``service``: the served app's request path without a server, ``CoordinatorService`` over an
  ``AsyncEngineCoreClient`` session in this process, 16 coroutine clients calling its
  ``generate``;
- ``grpc-server``: the same service behind ``start_grpc_server`` in a child process (no Ray,
  no Serve), 16 coroutine clients of the client library's ``AsyncClient`` in this process.

Per pass: tokens/s and the front end's CPU per request over the timed loop (this process for
``waves`` and ``service``, its clients and Ray's threads included; the child for
``grpc-server``, clients excluded).
Usage: PYTHONPATH=. .venv/bin/python scripts/front-end-cost.py [alternations] [out.json]"""

import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time

CLIENTS, PER_CLIENT = 16, 6
FIELDS = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def prompt(client: int, index: int) -> str:
    return f"Request {index} from client {client}: tell me about the sea."


async def open_service(address: str, target: str):
    from specray.engine_core.aio_client import AsyncEngineCoreClient
    from specray.models.loading import load_model_info
    from specray.serve.service import CoordinatorService

    info = load_model_info(target)
    session = AsyncEngineCoreClient(
        address,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        num_speculative_tokens=0,
    )
    await session.start(connect_timeout_s=10.0)
    service = CoordinatorService(
        session,
        tokenizer=info.tokenizer,
        model_name="bench",
        draft_name=None,
        max_model_len=info.max_positions,
    )
    return session, service


def serve_grpc(address: str, target: str, ports) -> None:
    """The child: the service behind the gRPC API until killed."""
    from specray.serve.grpc_api import start_grpc_server

    async def run() -> None:
        _, service = await open_service(address, target)
        _, port = await start_grpc_server(service, host="127.0.0.1", port=0)
        ports.put(port)
        await asyncio.Event().wait()

    asyncio.run(run())


async def closed_loop(send, pid: int) -> tuple[float, float]:
    """Seconds for CLIENTS coroutines sending PER_CLIENT requests each, back to back, and
    the CPU seconds process ``pid`` spent meanwhile (each client's first request, which opens
    its connection, comes before both)."""

    async def client(number: int) -> None:
        for index in range(PER_CLIENT):
            await send(prompt(number, index))

    await asyncio.gather(*(send(f"Client {n} connects.") for n in range(CLIENTS)))
    cpu, started = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(CLIENTS)))
    return time.perf_counter() - started, cpu_seconds(pid) - cpu


async def service_pass(address: str, target: str) -> tuple[float, float]:
    from specray.serve.protocol import GenerateRequest

    session, service = await open_service(address, target)
    try:

        async def send(text: str) -> None:
            request = GenerateRequest(prompt=text, params=FIELDS, stream=False)
            async for event in service.generate(request):
                if event["kind"] == "final":
                    assert event["completion_tokens"] == FIELDS["max_tokens"]

        return await closed_loop(send, os.getpid())
    finally:
        await session.close()


async def grpc_pass(port: int, pid: int) -> tuple[float, float]:
    from specray.client.aio import AsyncClient

    async with AsyncClient(f"127.0.0.1:{port}") as client:

        async def send(text: str) -> None:
            completion = await client.generate(text, **FIELDS)
            assert completion.completion_tokens == FIELDS["max_tokens"]

        return await closed_loop(send, pid)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    import ray

    from specray import Engine
    from specray.cluster.distributed import connect
    from specray.cluster.placement import PlacementConfig
    from specray.cluster.serve_env import serve_env
    from specray.models.tiny import save_tiny_model
    from specray.sampling import SamplingParams

    alternations = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    out = sys.argv[2] if len(sys.argv) > 2 else None
    params = SamplingParams(**FIELDS)
    requests = CLIENTS * PER_CLIENT
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        target = save_tiny_model(folder)
        connect("auto", PlacementConfig(), env=serve_env(local=True))
        engine = Engine(target, cluster="auto")
        address = engine.backend.session_address
        context = multiprocessing.get_context("spawn")
        ports = context.Queue()
        child = context.Process(target=serve_grpc, args=(address, target, ports), daemon=True)
        child.start()
        port = ports.get(timeout=120)

        def waves() -> None:
            for index in range(PER_CLIENT):
                prompts = [prompt(n, index) for n in range(CLIENTS)]
                engine.generate(prompts, params, use_chat_template=False)

        def timed_waves() -> tuple[float, float]:
            cpu, started = cpu_seconds(os.getpid()), time.perf_counter()
            waves()
            return time.perf_counter() - started, cpu_seconds(os.getpid()) - cpu

        passes = (
            ("waves", timed_waves),
            ("service", lambda: asyncio.run(service_pass(address, target))),
            ("grpc-server", lambda: asyncio.run(grpc_pass(port, child.pid))),
        )
        waves()
        try:
            for rep in range(alternations):
                for path, run in passes:
                    wall, cpu = run()
                    row = {
                        "path": path,
                        "rep": rep,
                        "tok_s": requests * FIELDS["max_tokens"] / wall,
                        "front_end_cpu_ms_per_request": 1e3 * cpu / requests,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            child.kill()
            engine.shutdown()
            ray.shutdown()
    means = {}
    for path, _ in passes:
        mine = [row for row in rows if row["path"] == path]
        means[path] = {
            key: sum(row[key] for row in mine) / len(mine)
            for key in ("tok_s", "front_end_cpu_ms_per_request")
        }
        print(f"{path:12s} " + "  ".join(f"{k} {v:8.2f}" for k, v in means[path].items()))
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows, "means": means}, f, indent=1)


if __name__ == "__main__":
    main()
