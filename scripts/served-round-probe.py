"""Where a served round's time goes (issue 21): the served app at speculation off and a fixed
k = 2 (greedy, the first N shipped chat prompts), its /metrics scraped around each pass, beside
the in-process Engine at off and k = 2. Usage: PYTHONPATH=. .venv/bin/python
scripts/served-round-probe.py [N]; docs/bench/served-speedup-2026-12-03.md."""

import json
import re
import sys
import time

import httpx
import torch

from specray.bench.served_speedup import chat_prompts
from specray.client import Client
from specray.cluster.distributed import connect
from specray.cluster.placement import PlacementConfig
from specray.cluster.ports import free_ports
from specray.cluster.serve_env import serve_env
from specray.serve import launch
from specray.serve.config import AppArgs

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
prompts = chat_prompts()[:N]
grpc_port, http_port = free_ports(2)
args = AppArgs(target="default", draft="default", grpc_port=grpc_port, num_threads=1)
connect("auto", PlacementConfig(), env=serve_env(local=True))
endpoints = launch.start(launch.deploy_config(args, http_port=http_port))
client = Client(endpoints.grpc)
NAMES = [
    "verify_latency_seconds",
    "draft_latency_seconds",
    "network_latency_seconds",
    "e2e_request_latency_seconds",
    "inter_token_latency_seconds",
]


def scrape():
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"specray:(\w+?)(_sum|_count|_total)?(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, suffix, labels, value = m.groups()
        if labels and "le=" in labels:
            continue
        key = name + (suffix or "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


greedy = {"max_tokens": 48, "temperature": 0.0}
client.generate(messages=[{"role": "user", "content": prompts[-1]}], **greedy, speculation="off")
report = {}
for label, opts in [
    ("off", {"speculation": "off"}),
    ("k2", {"speculation": "on", "num_speculative_tokens": 2}),
    ("off2", {"speculation": "off"}),
    ("k2b", {"speculation": "on", "num_speculative_tokens": 2}),
]:
    before = scrape()
    t0 = time.perf_counter()
    tokens = 0
    for p in prompts:
        c = client.generate(messages=[{"role": "user", "content": p}], **greedy, **opts)
        tokens += len(c.token_ids)
    wall = time.perf_counter() - t0
    after = scrape()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    row = {
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "ms_per_token": round(1e3 * wall / tokens, 2),
    }
    for n in NAMES:
        c = d.get(n + "_count", 0)
        s = d.get(n + "_sum", 0)
        row[n] = {"count": c, "mean_ms": round(1e3 * s / c, 2) if c else None, "sum_s": round(s, 3)}
    for n in [
        "target_busy_seconds_total",
        "pipeline_bubble_seconds_total",
        "spec_decode_num_drafts_total",
        "iteration_tokens_total_count",
    ]:
        row[n] = round(d.get(n, 0), 3)
    report[label] = row
    print(label, json.dumps(row), flush=True)
client.close()
launch.stop()
import ray  # noqa: E402 (after the served app is down)

ray.shutdown()
from specray import Engine  # noqa: E402
from specray.sampling import SamplingParams  # noqa: E402

torch.set_num_threads(1)
eng = Engine("default", draft="default", num_speculative_tokens=2)
params = SamplingParams(temperature=0.0, max_tokens=48)
eng.generate([prompts[0]], params)
for label, k in [("in_off", 0), ("in_k2", 2), ("in_off2", 0), ("in_k2b", 2)]:
    eng.num_speculative_tokens = k
    t0 = time.perf_counter()
    tokens = 0
    drafts = 0
    for p in prompts:
        (o,) = eng.generate([p], params)
        tokens += len(o.token_ids)
        drafts += o.metrics.num_drafts
    wall = time.perf_counter() - t0
    print(
        label,
        json.dumps(
            {
                "wall_s": round(wall, 3),
                "tokens": tokens,
                "drafts": drafts,
                "ms_per_token": round(1e3 * wall / tokens, 2),
            }
        ),
        flush=True,
    )
