"""The series vLLM's dashboards read, on ``/metrics`` of a served run, with the values the
requests predict: prompt and generation token histograms, tokens per round, each request's
phases, KV-cache usage rising with the running requests (and back to 0 when they are done),
and a preemption counter that stays at 0 (specray never preempts).

A backend of its own (the tiny chat pair, no draft: every round feeds one token a request, so
the tokens the target ran are known exactly), reached through the HTTP app in process."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specray.serve.openai_api import build_http_app
from specray.serve.service import LocalBackend
from tests.helpers.tiny_models import save_tiny_chat_pair

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "one", "two three four five six", "a b", "seven eight"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("chat-pair"))


def _samples(text: str) -> dict[str, float]:
    """sample name -> value for the unlabelled-but-model series (``le`` kept in the name)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            out[sample.name + (f"[{le}]" if le else "")] = sample.value
    return out


def test_request_series_follow_the_requests(chat_pair):
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    async def run():
        backend = await LocalBackend.start(chat_pair[0], None, model_name=MODEL)
        registry = backend.engine.metrics.registry
        peaks = {}  # requests sent at once -> the highest KV usage seen meanwhile

        def usage() -> float:
            labels = {"model_name": MODEL}
            return registry.get_sample_value("specray:kv_cache_usage_perc", labels) or 0.0

        async def watched(client, prompts):
            async def watch():
                while True:
                    peaks[len(prompts)] = max(peaks.get(len(prompts), 0.0), usage())
                    await asyncio.sleep(0.002)

            watcher = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(
                    *(client.post("/v1/completions", json=body | {"prompt": p}) for p in prompts)
                )
            finally:
                watcher.cancel()

        try:
            transport = httpx.ASGITransport(app=build_http_app(backend))
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                replies = [*await watched(client, PROMPTS[:1]), *await watched(client, PROMPTS[1:])]
                text = (await client.get("/metrics")).text
        finally:
            await backend.stop(drain=False)
        return replies, peaks, text

    replies, peaks, text = asyncio.run(run())
    assert [reply.status_code for reply in replies] == [200] * len(PROMPTS)
    usages = [reply.json()["usage"] for reply in replies]
    prompt_tokens = [u["prompt_tokens"] for u in usages]
    generated = [u["completion_tokens"] for u in usages]
    assert generated == [MAX_TOKENS] * len(PROMPTS)
    samples = _samples(text)
    name = "specray:request_prompt_tokens"
    assert samples[f"{name}_count"] == len(PROMPTS) and samples[f"{name}_sum"] == sum(prompt_tokens)
    assert samples[f"{name}_bucket[5.0]"] == sum(1 for n in prompt_tokens if n <= 5)
    name = "specray:request_generation_tokens"
    assert samples[f"{name}_count"] == len(PROMPTS) and samples[f"{name}_sum"] == sum(generated)
    # Every prompt token and every generated token but the last was run once (no drafts).
    expected = sum(prompt_tokens) + sum(generated) - len(PROMPTS)
    assert samples["specray:iteration_tokens_total_sum"] == expected
    for phase in ("queue", "prefill", "decode"):
        assert samples[f"specray:request_{phase}_time_seconds_count"] == len(PROMPTS)
    assert samples["specray:request_decode_time_seconds_sum"] > 0
    # The cache: four requests at once hold more of it than one; all freed at the end.
    assert 0 < peaks[1] < peaks[len(PROMPTS) - 1] <= 1.0, peaks
    assert samples["specray:kv_cache_usage_perc"] == 0.0
    assert samples["specray:num_preemptions_total"] == 0.0


def test_the_choices_of_one_prompt_share_its_prefill(chat_pair):
    """n = 4 sampled choices of one prompt: the front end sends them to the engine core in one
    message, which admits them to one round, whose forward computes the prompt once; the other
    three copy its rows (``specray:shared_tokens_total``); the choices stay distinct draws."""
    prompt = "The quick brown fox jumps over the lazy dog and runs far away"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "n": 4,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
    }

    async def run():
        backend = await LocalBackend.start(chat_pair[0], None, model_name=MODEL)
        prompt_tokens = len(backend.tokenizer(prompt)["input_ids"])
        try:
            transport = httpx.ASGITransport(app=build_http_app(backend))
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                reply = await client.post("/v1/completions", json=body)
                text = (await client.get("/metrics")).text
        finally:
            await backend.stop(drain=False)
        return reply, prompt_tokens, text

    reply, prompt_tokens, text = asyncio.run(run())
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len({choice["text"] for choice in choices}) > 1  # sampled apart from one row
    shared = _samples(text)["specray:shared_tokens_total"]
    assert shared == 3 * prompt_tokens, (shared, prompt_tokens)
