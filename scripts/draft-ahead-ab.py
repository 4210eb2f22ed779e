"""Draft-ahead at concurrency 1 (docs/bench/history.md): one served app (default target and
drafter, one thread per worker), the first 4 chat prompts, greedy, 48 tokens, a fixed k, with
the engine core's draft_ahead_min_hit switched between 0.5 (the default) and 0.0 (always draft
ahead while the block is verified) through Ray's ``__ray_call__``, three alternations; per pass
the engine core's counters. Usage: PYTHONPATH=. .venv/bin/python scripts/draft-ahead-ab.py [k]."""

import json
import sys
import time

import ray

from specray.bench.engine_core_probe import coordinator_stats, set_coordinator_field
from specray.bench.served_speedup import chat_prompts
from specray.client import Client
from specray.cluster.distributed import connect
from specray.cluster.placement import PlacementConfig
from specray.cluster.ports import free_ports
from specray.cluster.serve_env import serve_env
from specray.serve import launch
from specray.serve.config import AppArgs
from specray.serve.launch import APP_NAME
from specray.serve.registry import get_registry

K = int(sys.argv[1]) if len(sys.argv) > 1 else 2
prompts = chat_prompts()[:4]
grpc_port, http_port = free_ports(2)
args = AppArgs(target="default", draft="default", grpc_port=grpc_port, num_threads=1)
connect("auto", PlacementConfig(), env=serve_env(local=True))
endpoints = launch.start(launch.deploy_config(args, http_port=http_port))
client = Client(endpoints.grpc)
leader = next(iter(ray.get(get_registry(APP_NAME).endpoints.remote()).values()))["leader"]


greedy = {"max_tokens": 48, "temperature": 0.0}
opts = {"speculation": "on", "num_speculative_tokens": K} if K > 0 else {}
client.generate(messages=[{"role": "user", "content": prompts[-1]}], **greedy, **opts)
results = {0.5: [], 0.0: []}
for rep in range(3):
    for hit in (0.5, 0.0) if rep % 2 == 0 else (0.0, 0.5):
        assert (
            ray.get(leader.__ray_call__.remote(set_coordinator_field, "draft_ahead_min_hit", hit))
            == hit
        )
        a = ray.get(leader.__ray_call__.remote(coordinator_stats))
        t0 = time.perf_counter()
        n = 0
        for p in prompts:
            c = client.generate(messages=[{"role": "user", "content": p}], **greedy, **opts)
            n += len(c.token_ids)
        wall = time.perf_counter() - t0
        b = ray.get(leader.__ray_call__.remote(coordinator_stats))
        d = {
            k: b[k] - a[k]
            for k in (
                "rounds",
                "committed_tokens",
                "target_compute_s",
                "target_wait_s",
                "target_forward_s",
                "reused_tokens",
                "ahead_tokens",
            )
        }
        results[hit].append(1e3 * wall / n)
        per_round = {k: 1e3 * d[k] / d["rounds"] for k in ("target_forward_s", "target_wait_s")}
        print(
            f"min_hit {hit}: {1e3 * wall / n:.1f} ms/token, rounds {d['rounds']}, "
            f"forward/round {per_round['target_forward_s']:.1f} ms, "
            f"wait/round {per_round['target_wait_s']:.1f} ms, "
            f"kept {d['reused_tokens']}, drafted ahead {d['ahead_tokens']}",
            flush=True,
        )
print(json.dumps({str(k): v for k, v in results.items()}))
