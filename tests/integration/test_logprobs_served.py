"""Log-probabilities through the engine core: a real target worker and draft worker in this
process (LocalBackend: gRPC on loopback, the typed round protocol, a front-end session), with
chunked prefill, against the in-process engine on the same model (tiny chat pair)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specray import Engine
from specray.engine_core.coordinator import CoordinatorConfig
from specray.sampling import SamplingParams
from specray.serve.service import LocalBackend
from tests.helpers.logprob_gaps import largest_gap
from tests.helpers.tiny_models import save_tiny_chat_pair

PROMPT = list(range(300, 323))  # 23 tokens: six chunks of 4 under the prefill budget
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("logprobs-pair"))


async def _served(target, draft, params_list, batch_invariant=False):
    """Each request's deltas and output, through a backend whose prefill budget is 4 tokens."""
    config = CoordinatorConfig(
        num_speculative_tokens=4, adaptive_k=False, max_prefill_tokens_per_round=4
    )
    backend = await LocalBackend.start(
        target, draft, config=config, batch_invariant=batch_invariant
    )
    try:
        runs = []
        for params in params_list:
            stream = await backend.coordinator.submit(PROMPT, params)
            runs.append(([delta async for delta in stream], stream.output))
        assert backend.engine.stats.prefill_chunks >= 5 * len(params_list)  # in chunks
        return runs
    finally:
        await backend.stop(drain=False)


def test_served_logprobs_match_the_in_process_engine(chat_pair):
    target, draft = chat_pair
    asked = SamplingParams(temperature=0, max_tokens=20, logprobs=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=20)
    (deltas, output), (plain_deltas, plain_output) = asyncio.run(
        _served(target, draft, [asked, plain])
    )
    # streamed: each delta carries its tokens' logprobs; the prompt's come once, first
    streamed = [entry for delta in deltas for entry in (delta.logprobs or [])]
    assert streamed == output.logprobs
    assert next(d for d in deltas if d.token_ids).prompt_logprobs is not None
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1
    assert output.metrics.num_accepted_tokens > 0  # speculation committed drafted tokens
    # a request that did not ask carries none
    assert plain_output.logprobs is None and plain_output.prompt_logprobs is None
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in plain_deltas)
    assert plain_output.token_ids == output.token_ids

    engine = Engine(target)  # target-only, whole-prompt prefill
    try:
        (reference,) = engine.generate([PROMPT], asked)
    finally:
        engine.shutdown()
    assert reference.token_ids == output.token_ids
    for got, want in zip(output.logprobs, reference.logprobs, strict=True):
        assert (got.token_id, got.rank, got.top_ids) == (want.token_id, want.rank, want.top_ids)
        assert got.logprob == pytest.approx(want.logprob, abs=TOLERANCE)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(PROMPT)
    for position, (got, want) in enumerate(
        zip(output.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True), start=1
    ):
        assert got.token_id == PROMPT[position]
        assert got.logprob == pytest.approx(want.logprob, abs=TOLERANCE)
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=TOLERANCE)


def test_batch_invariant_served_logprobs_equal_the_in_process_ones(chat_pair):
    """Batch-invariant targets (``batch_invariant`` through the target worker): speculating,
    prompts prefilled in chunks of 4 beside decoding, the served log-probabilities are those
    of the in-process engine decoding one token at a time, bitwise (with the worker's thread
    count: kernels split work, and so round, by threads). Negative control: the default
    targets' differ by rounding."""
    target, draft = chat_pair
    asked = SamplingParams(temperature=0, max_tokens=20, logprobs=3, prompt_logprobs=2)
    worst = {}
    for batch_invariant in (True, False):
        ((_, output),) = asyncio.run(_served(target, draft, [asked], batch_invariant))
        assert output.metrics.num_accepted_tokens > 0
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the target worker's (AppArgs.num_threads)
        engine = Engine(target, batch_invariant=batch_invariant)
        try:
            (reference,) = engine.generate([PROMPT], asked)
        finally:
            engine.shutdown()
            torch.set_num_threads(threads)
        assert reference.token_ids == output.token_ids
        pairs = [
            *zip(output.logprobs, reference.logprobs, strict=True),
            *zip(output.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True),
        ]
        worst[batch_invariant] = largest_gap(pairs)
    assert worst[True] == 0.0
    assert 0.0 < worst[False] <= TOLERANCE
