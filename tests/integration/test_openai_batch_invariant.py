"""Batch-invariant serving through the official ``openai`` client: with ``batch_invariant`` the
log-probabilities a request gets are the same bits with speculation (k = 4 every round) and
without (``speculation: "off"``), for completions with ``echo`` and chat alike. Negative
control: a default backend on the same models, where they differ by float rounding.

The tiny chat pair (random-weight target, its perturbed copy as the draft) over LocalBackend:
a real target worker and draft worker exchanging blocks over gRPC on loopback.
"""

from __future__ import annotations

import contextlib

import openai
import pytest

from specray.engine_core.coordinator import CoordinatorConfig
from specray.serve.service import LocalBackend
from tests.helpers.http_backend import serve_backend
from tests.helpers.tiny_models import save_tiny_chat_pair

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """``{batch_invariant: openai client}``: one server each."""
    target, draft = save_tiny_chat_pair(tmp_path_factory.mktemp("chat-pair"))
    config = CoordinatorConfig(num_speculative_tokens=4, adaptive_k=False)
    with contextlib.ExitStack() as stack:
        clients = {}
        for batch_invariant in (True, False):

            def start(batch_invariant=batch_invariant):
                return LocalBackend.start(
                    target, draft, model_name=MODEL, config=config, batch_invariant=batch_invariant
                )

            url = stack.enter_context(serve_backend(start))
            clients[batch_invariant] = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        yield clients


def _completion(client, prompt: str, speculation: str):
    """Greedy, echoing the prompt, with the 5 most likely at each position."""
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=5,
        echo=True,
        extra_body={"speculation": speculation, "ignore_eos": True},
    )
    choice = completion.choices[0]
    return choice.text, _completion_values(choice), completion.model_extra["speculative_decoding"]


def _chat(client, prompt: str, speculation: str):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"speculation": speculation, "ignore_eos": True},
    )
    choice = completion.choices[0]
    block = completion.model_extra["speculative_decoding"]
    return choice.message.content, _chat_values(choice), block


def _completion_values(choice) -> list[float]:
    """Every log-probability of the choice: each token's, then its top entries'."""
    logprobs = choice.logprobs
    values = [value for value in logprobs.token_logprobs if value is not None]
    return values + [v for top in logprobs.top_logprobs if top for v in top.values()]


def _chat_values(choice) -> list[float]:
    entries = choice.logprobs.content
    return [entry.logprob for entry in entries] + [
        top.logprob for entry in entries for top in entry.top_logprobs
    ]


def _largest_gap(client) -> tuple[float, int]:
    """max |difference| of any log-probability, speculation on against off, over completions
    and chat on every prompt; and the drafted tokens accepted with speculation on."""
    worst, accepted = 0.0, 0
    for prompt in PROMPTS:
        for ask in (_completion, _chat):
            text, values, block = ask(client, prompt, "on")
            off_text, off_values, off_block = ask(client, prompt, "off")
            assert off_block["num_drafts"] == 0
            accepted += block["num_accepted_tokens"]
            assert text == off_text
            worst = max(worst, *(abs(a - b) for a, b in zip(values, off_values, strict=True)))
    return worst, accepted


def test_served_logprobs_are_equal_with_and_without_speculation(clients):
    worst, accepted = _largest_gap(clients[True])
    assert accepted > 0  # speculation committed drafted tokens
    assert worst == 0.0
    control, _ = _largest_gap(clients[False])
    assert 0.0 < control < 1e-4
