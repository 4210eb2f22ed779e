"""Shared prefill on and off, alternating in one process (docs/bench/shared-prefill-2026-12-04.md).

The bundled target (no draft) behind the OpenAI HTTP app in process; each pass sends
``CALLS`` chat completions at once, each with ``n`` sampled choices of its own prompt
(about 110 tokens), ``max_tokens`` 8. Off: ``Histories.plan`` shares nothing (every row
computes its prompt). Prints one JSON line per pass and a summary.

    PYTHONPATH=. .venv/bin/python scripts/shared-prefill-ab.py [turns] [n]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specray.engine_core.coordinator import CoordinatorConfig
from specray.models import shared_rows
from specray.serve.openai_api import build_http_app
from specray.serve.service import LocalBackend

CALLS = 4
MAX_TOKENS = 8
TOPIC = (
    "Read the following notes and answer in one sentence. The river rises in the hills, "
    "runs through three towns and a forest, and reaches the sea after two hundred "
    "kilometres; its valley grows apples, pears and a little wine, and the towns trade "
    "them at a market held every Saturday since the middle ages. Question {}: what is "
    "the valley known for?"
)


def _sample(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


async def _pass(client: httpx.AsyncClient, n: int, turn: int) -> tuple[float, int, int]:
    bodies = [
        {
            "model": "m",
            "messages": [{"role": "user", "content": TOPIC.format(f"{turn}.{call}")}],
            "n": n,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        for call in range(CALLS)
    ]
    started = time.perf_counter()
    replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    wall_s = time.perf_counter() - started
    usages = [reply.json()["usage"] for reply in replies]
    return wall_s, sum(u["prompt_tokens"] for u in usages) * n, CALLS * n * MAX_TOKENS


async def main(turns: int, n: int) -> None:
    plan = shared_rows.Histories.plan
    config = CoordinatorConfig(max_running=CALLS * n, max_queue=CALLS * n)
    backend = await LocalBackend.start("default", None, model_name="m", config=config)
    transport = httpx.ASGITransport(app=build_http_app(backend))
    rows = []
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=900) as c:
            await _pass(c, 2, -1)  # warm-up
            for turn in range(turns):
                order = ("on", "off") if turn % 2 == 0 else ("off", "on")
                for setting in order:
                    shared_rows.Histories.plan = plan if setting == "on" else lambda *a, **k: {}
                    before = _sample((await c.get("/metrics")).text, "specray:shared_tokens_total")
                    wall_s, prompt_tokens, generated = await _pass(c, n, turn)
                    after = _sample((await c.get("/metrics")).text, "specray:shared_tokens_total")
                    row = {
                        "turn": turn,
                        "sharing": setting,
                        "wall_s": round(wall_s, 3),
                        "prompt_tokens": prompt_tokens,
                        "shared_tokens": int(after - before),
                        "generated": generated,
                        "tokens_per_s": round(generated / wall_s, 2),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        shared_rows.Histories.plan = plan
        await backend.stop(drain=False)
    for setting in ("on", "off"):
        walls = [row["wall_s"] for row in rows if row["sharing"] == setting]
        print(f"{setting}: wall s per pass {walls}, mean {sum(walls) / len(walls):.2f}")
    on = [row["wall_s"] for row in rows if row["sharing"] == "on"]
    off = [row["wall_s"] for row in rows if row["sharing"] == "off"]
    print(
        f"off / on wall time, per turn: {[round(b / a, 2) for a, b in zip(on, off, strict=True)]}"
    )


if __name__ == "__main__":
    asyncio.run(
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 3,
            int(sys.argv[2]) if len(sys.argv) > 2 else 8,
        )
    )
