"""What a closed loop's request boundary costs through Python gRPC alone, with no engine
(docs/bench/history.md: "Where the served paths' closed loop loses"): a grpcio asyncio server
in a child process holds each unary-stream call until a ticker ends every call in flight at once,
every ``PERIOD_S`` (as a round ends a batch of requests started together); 16 coroutine clients in
this process, on one channel, call again as soon as their call ended.

Reported per setting: the "away" time of a request boundary, from the server ending a call to
the same client's next call reaching the server's handler (what a closed loop's engine waits,
with a slot free), and the server's CPU per request. ``work_ms``: CPU the handler spends per
request after its end (a front end's response building, detokenisation).
Usage: PYTHONPATH=. .venv/bin/python scripts/grpc-burst-floor.py [out.json]"""

import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time

CLIENTS, CALLS, PERIOD_S = 16, 20, 0.1
PAYLOAD = b"x" * 200


def serve(ports, work_s: float, log) -> None:
    """The child: ends every call in flight each PERIOD_S; puts (request, arrival s, end s)."""
    import grpc

    async def run() -> None:
        waiting: list[tuple[bytes, asyncio.Future]] = []
        times: dict[bytes, list[float]] = {}

        async def handler(request: bytes, context):
            times[request] = [time.perf_counter()]
            ended = asyncio.get_running_loop().create_future()
            waiting.append((request, ended))
            times[request].append(await ended)
            spin = time.perf_counter()
            while time.perf_counter() - spin < work_s:
                pass
            yield PAYLOAD

        async def ticker() -> None:
            while True:
                await asyncio.sleep(PERIOD_S)
                batch, waiting[:] = list(waiting), []
                now = time.perf_counter()
                for _, ended in batch:
                    ended.set_result(now)

        server = grpc.aio.server()
        method = grpc.unary_stream_rpc_method_handler(handler)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.S", {"Y": method}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ticking = asyncio.create_task(ticker())
        ports.put(port)
        while len(times) < CLIENTS * CALLS or any(len(t) < 2 for t in times.values()):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        ticking.cancel()
        log.put({key.decode(): value for key, value in times.items()})

    asyncio.run(run())


async def clients(port: int) -> float:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/t.S/Y")

        async def client(number: int) -> None:
            for index in range(CALLS):
                async for _ in call(f"{number}-{index}".encode()):
                    pass

        started = time.process_time()
        await asyncio.gather(*(client(n) for n in range(CLIENTS)))
        return time.process_time() - started


def measure(work_s: float) -> dict:
    context = multiprocessing.get_context("spawn")
    ports, log = context.Queue(), context.Queue()
    child = context.Process(target=serve, args=(ports, work_s, log), daemon=True)
    child.start()
    port = ports.get(timeout=60)
    with open(f"/proc/{child.pid}/stat") as stat:
        before = sum(int(v) for v in stat.read().rsplit(")", 1)[1].split()[11:13])
    client_cpu = asyncio.run(clients(port))
    with open(f"/proc/{child.pid}/stat") as stat:
        after = sum(int(v) for v in stat.read().rsplit(")", 1)[1].split()[11:13])
    times = log.get(timeout=60)
    child.join(timeout=10)
    away = sorted(
        times[f"{n}-{i + 1}"][0] - times[f"{n}-{i}"][1]
        for n in range(CLIENTS)
        for i in range(CALLS - 1)
    )
    requests = CLIENTS * CALLS
    return {
        "work_ms": 1e3 * work_s,
        "away_ms_median": 1e3 * statistics.median(away),
        "away_ms_p90": 1e3 * away[int(0.9 * len(away))],
        "server_cpu_ms_per_request": 1e3 * (after - before) / os.sysconf("SC_CLK_TCK") / requests,
        "client_cpu_ms_per_request": 1e3 * client_cpu / requests,
    }


def main() -> None:
    rows = []
    for work_s in (0.0, 0.0005, 0.001):
        row = measure(work_s)
        rows.append(row)
        print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump({"clients": CLIENTS, "period_s": PERIOD_S, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
