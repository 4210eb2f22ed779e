"""One engine-core setting at two values in one run (docs/bench/history.md: "Async
scheduling", "Holding an idle round for arrivals"): the overhead bench's tiny target,
target-only, 32 tokens a request (ignore_eos), 3 requests per client; one distributed Engine
whose engine core has the ``CoordinatorConfig`` field switched at run time through Ray's
``__ray_call__``, beside the in-process Engine. At each concurrency, alternations of: the
in-process engine's waves, the distributed engine's waves (one ``generate`` per wave) and its
closed loop (a thread per client, one ``generate`` per request), at each value in turn (the
order swapped every other alternation). Per pass: tokens/s, the engine core's rounds, rounds
queued ahead, rows skipped, and the target's busy fraction.
Usage: PYTHONPATH=. .venv/bin/python scripts/coordinator-ab.py FIELD A B [alternations] [out]
(values as JSON: ``async_scheduling true false``, ``arrival_hold_s 0.005 0``)"""

import json
import sys
import tempfile
import threading
import time

import ray

from specray import Engine
from specray.bench.engine_core_probe import coordinator_stats, set_coordinator_field
from specray.cluster.distributed import connect
from specray.cluster.placement import PlacementConfig
from specray.cluster.serve_env import serve_env
from specray.models.tiny import save_tiny_model
from specray.sampling import SamplingParams

FIELD, VALUES = sys.argv[1], (json.loads(sys.argv[2]), json.loads(sys.argv[3]))
ALTERNATIONS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
OUT = sys.argv[5] if len(sys.argv) > 5 else None
TOKENS, PER_CLIENT = 32, 3
PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


def prompt(client: int, index: int) -> str:
    return f"Client {client} asks question {index}: tell me a short story."


def waves(engine, concurrency: int) -> int:
    tokens = 0
    for index in range(PER_CLIENT):
        outputs = engine.generate(
            [prompt(c, index) for c in range(concurrency)], PARAMS, use_chat_template=False
        )
        tokens += sum(len(o.token_ids) for o in outputs)
    return tokens


def closed_loop(engine, concurrency: int) -> int:
    counts = [0] * concurrency

    def client(number: int) -> None:
        for index in range(PER_CLIENT):
            (output,) = engine.generate([prompt(number, index)], PARAMS, use_chat_template=False)
            counts[number] += len(output.token_ids)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts)


def timed(run, *args) -> tuple[int, float]:
    started = time.perf_counter()
    tokens = run(*args)
    return tokens, time.perf_counter() - started


with tempfile.TemporaryDirectory() as folder:
    target = save_tiny_model(folder)
    connect("auto", PlacementConfig(), env=serve_env(local=True))
    local = Engine(target, draft=None)
    engine = Engine(target, draft=None, cluster="auto")
    leader = engine.backend.leader
    waves(local, 4), waves(engine, 4)  # warm both
    results = []
    for concurrency in (1, 16):
        for rep in range(ALTERNATIONS):
            tokens, wall = timed(waves, local, concurrency)
            results.append(
                {"concurrency": concurrency, "path": "engine", "tok_s": tokens / wall, "rep": rep}
            )
            for value in VALUES if rep % 2 == 0 else VALUES[::-1]:
                assert (
                    ray.get(leader.__ray_call__.remote(set_coordinator_field, FIELD, value))
                    == value
                )
                for path, run in (("ray", waves), ("ray-clients", closed_loop)):
                    before = ray.get(leader.__ray_call__.remote(coordinator_stats))
                    tokens, wall = timed(run, engine, concurrency)
                    after = ray.get(leader.__ray_call__.remote(coordinator_stats))
                    delta = {k: after[k] - before[k] for k in after if k != "started_s"}
                    row = {
                        "concurrency": concurrency,
                        "path": path,
                        FIELD: value,
                        "rep": rep,
                        "tok_s": tokens / wall,
                        "ms_per_token": 1e3 * wall * concurrency / tokens,
                        "rounds": delta["rounds"],
                        "rounds_ahead": delta["rounds_ahead"],
                        "rows_ended": delta["rows_ended"],
                        "joined_ahead": delta["joined_ahead"],
                        "busy": delta["target_compute_s"] / wall,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
    engine.shutdown()
    ray.shutdown()

summary = {}
for row in results:
    key = f"c{row['concurrency']} {row['path']}" + (
        "" if row["path"] == "engine" else f" {FIELD}={row[FIELD]}"
    )
    summary.setdefault(key, []).append(row["tok_s"])
for key, values in summary.items():
    mean = sum(values) / len(values)
    print(f"{key:24s} tok/s {' '.join(f'{v:8.1f}' for v in values)}  mean {mean:8.1f}")
if OUT:
    with open(OUT, "w") as f:
        json.dump(
            {"rows": results, "mean_tok_s": {k: sum(v) / len(v) for k, v in summary.items()}},
            f,
            indent=1,
        )
