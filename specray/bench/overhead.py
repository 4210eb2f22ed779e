"""What the serving layers cost: the same greedy requests through ``Engine.generate`` in this
process (``engine``), through the engine's distributed path (``ray``: the engine core beside the
target, no Serve; one batch per wave of requests, and ``ray-clients``: one call per request
from each client, the served paths' load), through a driver's session on the served
application's own engine core (``session``: that engine core without Serve in front), and
through the served application (Ray Serve, the engine core) by the gRPC client library
(``grpc``: ``generate``, the whole output; ``grpc-stream``: ``stream``, every round's tokens)
and the OpenAI-compatible HTTP API (``http``, not streamed; one kept-alive connection per
client, as SDKs keep theirs), at each concurrency, in one run: every path is alive throughout
and they take turns, ``repeats`` times, so that the machine's slow spells fall on all of them.

The served paths' clients are coroutines on one event loop (the client library's
``AsyncClient``, aiohttp), as asyncio load generators such as vLLM's serving benchmark drive a
server: a thread per client would add this process's own GIL to what is measured. The engine's
API and a driver's session are synchronous: their clients are threads.

With the default tiny random model the model's own time is negligible, so the differences are
the machinery: per request (admission, front end, Serve handle) and per token (the engine
core's round and its messages). Every request generates exactly ``max_tokens`` tokens
(``ignore_eos``), so per-token figures are comparable."""

from __future__ import annotations

import asyncio
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from specray.bench.clients import run_clients
from specray.prompts import prompt_token_ids
from specray.sampling import SamplingParams


@dataclass(frozen=True)
class OverheadConfig:
    target: str = "tiny"  # "tiny": a random model made here (measures the machinery)
    draft: str | None = None  # speculation is not what this measures; off by default
    max_tokens: int = 32
    concurrency: tuple[int, ...] = (1, 16)
    requests_per_client: int = 3
    repeats: int = 2  # turns of the served paths at each concurrency (summed)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must hold positive integers, got {self.concurrency}")
        if self.requests_per_client < 1:
            raise ValueError(f"requests_per_client must be >= 1, got {self.requests_per_client}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


@dataclass
class OverheadRow:
    path: str  # engine | ray | ray-clients | session | grpc | grpc-stream | http
    concurrency: int
    requests: int
    ms_per_request: float  # mean latency of one request
    ms_per_token: float  # that latency over its tokens
    tokens_per_s: float  # throughput over the whole closed-loop run
    overhead_ms_per_request: float = 0.0  # vs the engine at the same concurrency
    overhead_ms_per_token: float = 0.0
    # Control messages per round on the distributed path (engine core counters; None where
    # not measured): Ray calls reaching the target group, messages to and from each draft
    # worker's stream, delta batches to the front end.
    rounds: int | None = None
    ray_calls_per_round: float | None = None
    draft_messages_per_round: float | None = None
    delta_batches_per_round: float | None = None
    # Each turn's tokens/s over the waves' (``ray``) of the same turn: a slow spell of the
    # machine moves both sides of a turn's ratio, where it moves only one side of the sums'.
    turn_ratios: list[float] | None = None


def _prompt(client: int, index: int) -> str:
    return f"Request {index} from client {client}: tell me about the sea."


def _closed_loop(concurrency: int, per_client: int, send) -> tuple[list[float], float]:
    """``concurrency`` clients each sending ``per_client`` requests back to back."""
    latencies: list[float] = []

    def client(number: int) -> None:
        for index in range(per_client):
            started = time.perf_counter()
            send(_prompt(number, index))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    run_clients(concurrency, client)
    return latencies, time.perf_counter() - started


def _closed_loop_async(concurrency: int, per_client: int, open_clients) -> tuple[list, float]:
    """``concurrency`` clients as coroutines on one event loop, each sending ``per_client``
    requests back to back. ``open_clients(concurrency)`` (on the loop) returns one send
    coroutine function per client and a coroutine function that closes them; each client's
    connection is opened by a first request before the clock starts."""

    async def run() -> tuple[list[float], float]:
        sends, close = await open_clients(concurrency)
        try:
            await asyncio.gather(*(send(f"Client {n} connects.") for n, send in enumerate(sends)))
            latencies: list[float] = []

            async def client(number: int) -> None:
                for index in range(per_client):
                    started = time.perf_counter()
                    await sends[number](_prompt(number, index))
                    latencies.append(time.perf_counter() - started)

            started = time.perf_counter()
            await asyncio.gather(*(client(n) for n in range(concurrency)))
            return latencies, time.perf_counter() - started
        finally:
            await close()

    return asyncio.run(run())


def _grpc_clients(target: str, fields: dict, *, stream: bool):
    """The client library's ``AsyncClient``, one channel for all clients (as the synchronous
    ``Client`` shares one): ``generate``, or every chunk of ``stream``."""
    from specray.client.aio import AsyncClient

    async def open_clients(concurrency: int):
        client = AsyncClient(target)

        async def send(prompt: str) -> None:
            if stream:
                chunks = [chunk async for chunk in client.stream(prompt, **fields)]
                assert chunks[-1].completion.completion_tokens == fields["max_tokens"]
            else:
                completion = await client.generate(prompt, **fields)
                assert completion.completion_tokens == fields["max_tokens"]

        return [send] * concurrency, client.close

    return open_clients


def _http_clients(base_url: str, body: dict):
    """aiohttp, one kept-alive connection per client (as the OpenAI SDKs keep theirs): a new
    TCP connection per request would measure connection set-up, not the serving path."""
    import aiohttp

    url = base_url + "/v1/completions"

    async def open_clients(concurrency: int):
        sessions = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            for _ in range(concurrency)
        ]

        def sender(session):
            async def send(prompt: str) -> None:
                async with session.post(url, json={**body, "prompt": prompt}) as response:
                    reply = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"POST {url}: HTTP {response.status}: {reply}")
                assert reply["usage"]["completion_tokens"] == body["max_tokens"]

            return send

        async def close() -> None:
            for session in sessions:
                await session.close()

        return [sender(session) for session in sessions], close

    return open_clients


def _row(path: str, concurrency: int, latencies: list[float], wall_s: float, tokens: int):
    mean = statistics.fmean(latencies)
    return OverheadRow(
        path=path,
        concurrency=concurrency,
        requests=len(latencies),
        ms_per_request=1000 * mean,
        ms_per_token=1000 * mean / tokens,
        tokens_per_s=len(latencies) * tokens / wall_s,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _waves(engine, config: OverheadConfig, concurrency: int, params) -> tuple[list[float], float]:
    """The engine takes a batch per call: ``requests_per_client`` waves of ``concurrency``
    requests; each request's latency is its wave's."""
    latencies = []
    started = time.perf_counter()
    for index in range(config.requests_per_client):
        prompts = [_prompt(n, index) for n in range(concurrency)]
        wave = time.perf_counter()
        outputs = engine.generate(prompts, params, use_chat_template=False)
        assert all(len(o.token_ids) == config.max_tokens for o in outputs)
        latencies += [time.perf_counter() - wave] * concurrency
    return latencies, time.perf_counter() - started


@dataclass
class _Counts:
    """Control messages summed over the distributed engine's turns."""

    rounds: int = 0
    ray_calls: int = 0
    draft_messages: int = 0
    delta_batches: int = 0

    def add(self, before: dict, after: dict) -> None:
        """Between two engine-core snapshots (the second snapshot's own Ray call is not the
        rounds' doing)."""
        self.rounds += after["stats"]["rounds"] - before["stats"]["rounds"]
        calls = sum(after["ray_calls"].values()) - sum(before["ray_calls"].values())
        self.ray_calls += calls - 1
        pool = ("messages_sent", "messages_received")
        self.draft_messages += sum(after["pool"][key] - before["pool"][key] for key in pool)
        self.delta_batches += after["sessions"] - before["sessions"]

    def fill(self, row: OverheadRow) -> None:
        rounds = max(self.rounds, 1)
        row.rounds = self.rounds
        row.ray_calls_per_round = self.ray_calls / rounds
        row.draft_messages_per_round = self.draft_messages / rounds
        row.delta_batches_per_round = self.delta_batches / rounds


def _rows(config: OverheadConfig, target: str) -> list[OverheadRow]:
    """The in-process engine, the distributed engine (``ray``, its own engine core) and the
    served application (its engine core: a driver's ``session`` on it, and the served paths),
    alive together and taking turns at each concurrency, ``repeats`` times (the served paths'
    order rotated each turn): a slow spell of the machine then falls on every path rather
    than on one."""
    import ray

    from specray import Engine
    from specray.client import Client
    from specray.cluster.distributed import connect
    from specray.cluster.placement import PlacementConfig
    from specray.cluster.serve_env import serve_env
    from specray.serve import launch
    from specray.serve.config import AppArgs

    args = AppArgs(
        target=target,
        draft=config.draft,
        model_name="bench",
        grpc_port=_free_port(),
        max_running=max(config.concurrency),
        max_queue=max(config.concurrency),
    )
    connect("auto", PlacementConfig(), env=serve_env(local=True))  # as `specray serve`
    tokens = config.max_tokens
    fields = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    params = SamplingParams(**fields)
    local = Engine(target, draft=config.draft)
    engine = Engine(target, draft=config.draft, cluster="auto")
    endpoints = launch.start(launch.deploy_config(args, http_port=_free_port()))
    session = _served_group_session(target)
    rows = []
    try:
        with Client(endpoints.grpc) as client:

            def session_send(prompt: str) -> None:
                ids = prompt_token_ids(session.tokenizer, prompt, use_chat_template=False)
                output = session.submit(ids, params, stream=False).result()
                assert len(output.token_ids) == tokens

            def ray_clients_send(prompt: str) -> None:
                (output,) = engine.generate([prompt], params, use_chat_template=False)
                assert len(output.token_ids) == tokens

            def threads(send):
                return lambda concurrency, per_client: _closed_loop(concurrency, per_client, send)

            def coroutines(open_clients):
                return lambda concurrency, per_client: _closed_loop_async(
                    concurrency, per_client, open_clients
                )

            body = {"model": "bench", **fields}
            paths = (
                ("ray-clients", threads(ray_clients_send)),
                ("session", threads(session_send)),
                ("grpc", coroutines(_grpc_clients(endpoints.grpc, fields, stream=False))),
                ("grpc-stream", coroutines(_grpc_clients(endpoints.grpc, fields, stream=True))),
                ("http", coroutines(_http_clients(endpoints.http, body))),
            )
            for warm in (local, engine):
                warm.generate([_prompt(0, 0)], params, use_chat_template=False)
            client.generate(_prompt(0, 0), **fields)  # the served app (and its gRPC API) is up
            for _, run in paths:
                run(1, 1)
            for concurrency in config.concurrency:
                runs: dict[str, list[tuple[list[float], float]]] = {"engine": [], "ray": []}
                runs |= {path: [] for path, _ in paths}
                counts = _Counts()
                # One pass of each at this concurrency first, not counted: a batch size's first
                # rounds (its buffers, its kernels' first calls) would fall on the first turn.
                for warm in (local, engine):
                    _waves(warm, replace(config, requests_per_client=1), concurrency, params)
                for _, run in paths:
                    run(concurrency, 1)
                for turn in range(config.repeats):
                    runs["engine"].append(_waves(local, config, concurrency, params))
                    before = engine.engine_stats()
                    runs["ray"].append(_waves(engine, config, concurrency, params))
                    counts.add(before, engine.engine_stats())
                    # The served paths in an order rotated each turn: none always runs after
                    # the same one.
                    for path, run in paths[turn % len(paths) :] + paths[: turn % len(paths)]:
                        runs[path].append(run(concurrency, config.requests_per_client))
                for path, measured in runs.items():
                    latencies = [latency for run, _ in measured for latency in run]
                    wall = sum(wall for _, wall in measured)
                    rows.append(_row(path, concurrency, latencies, wall, tokens))
                    rows[-1].turn_ratios = turn_ratios(measured, runs["ray"])
                    if path == "ray":
                        counts.fill(rows[-1])
    finally:
        session.close()
        engine.shutdown()
        launch.stop()
        ray.shutdown()
    return rows


def turn_ratios(
    measured: list[tuple[list[float], float]], waves: list[tuple[list[float], float]]
) -> list[float]:
    """Per turn, ``(latencies, wall_s)`` of a path against the waves' of the same turn:
    requests per second over the waves' (every request has the same number of tokens)."""
    return [
        (len(run) / wall) / (len(base) / base_wall)
        for (run, wall), (base, base_wall) in zip(measured, waves, strict=True)
    ]


def _served_group_session(target: str):
    """A driver's session (what ``Engine(cluster=...)`` speaks) on the served application's own
    engine core: beside the served paths, the same engine core without Serve in front."""
    import ray

    from specray.engine_core.client import EngineCoreClient
    from specray.models.loading import load_model_info
    from specray.serve.launch import APP_NAME
    from specray.serve.registry import get_registry

    endpoints = ray.get(get_registry(APP_NAME).endpoints.remote())
    address = next(iter(endpoints.values()))["address"]
    return EngineCoreClient(address, tokenizer=load_model_info(target).tokenizer)


def run_overhead_bench(config: OverheadConfig = OverheadConfig()) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        target = config.target
        if target == "tiny":
            from specray.models.tiny import save_tiny_model

            target = save_tiny_model(folder)
        rows = _rows(config, target)
    engine = {row.concurrency: row for row in rows if row.path == "engine"}
    for row in rows:
        base = engine[row.concurrency]
        row.overhead_ms_per_request = row.ms_per_request - base.ms_per_request
        row.overhead_ms_per_token = row.ms_per_token - base.ms_per_token
    return {"config": asdict(config), "rows": [asdict(row) for row in rows]}


def _turns_text(ratios: list[float] | None) -> str:
    if not ratios:
        return ""
    return f"  {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def format_overhead(report: dict) -> str:
    lines = [
        "path         conc  requests  ms/request  ms/token  tokens/s  +ms/request  +ms/token"
        "  x ray  x ray-clients  x ray by turn: median (range)",
    ]
    rows = {(row["path"], row["concurrency"]): row for row in report["rows"]}
    for row in report["rows"]:
        ratios = [
            row["tokens_per_s"] / base["tokens_per_s"]
            for base in (rows.get((path, row["concurrency"])) for path in ("ray", "ray-clients"))
            if base is not None
        ]
        lines.append(
            f"{row['path']:<12} {row['concurrency']:>4}  {row['requests']:>8}  "
            f"{row['ms_per_request']:>10.1f}  {row['ms_per_token']:>8.2f}  "
            f"{row['tokens_per_s']:>8.1f}  {row['overhead_ms_per_request']:>11.1f}  "
            f"{row['overhead_ms_per_token']:>9.2f}"
            + "".join(f"  {ratio:>5.2f}x" for ratio in ratios)
            + _turns_text(row.get("turn_ratios"))
        )
    config = report["config"]
    lines.append(
        f"(target {config['target']}, draft {config['draft']}, {config['max_tokens']} tokens per "
        "request; + = over Engine.generate in process at the same concurrency; x ray = tokens/s "
        "over the distributed engine's batched waves, x ray-clients = over the same engine "
        "under the served paths' load: one generate call per request from each client)"
    )
    return "\n".join(lines)
