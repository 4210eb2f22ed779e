"""Resuming a request from its delivered tokens (what the ingress does when a coordinator or
target group fails midway), on the real generation service with in-process workers: the
resumed stream carries exactly the rest — tokens and text — and its final output the whole."""

from __future__ import annotations

import asyncio

import pytest

from specray.engine_core.coordinator import CoordinatorConfig
from specray.errors import InvalidRequestError
from specray.serve.groups import _whole_logprobs
from specray.serve.protocol import GenerateRequest
from specray.serve.service import LocalBackend
from tests.helpers.tiny_models import save_tiny_chat_pair

PROMPT = "A resumed request continues"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("resume-pair"))


async def _events(backend, request: GenerateRequest) -> list[dict]:
    return [event async for event in backend.generate(request)]


def test_a_resumed_stream_carries_exactly_the_rest(pair):
    target, draft = pair

    async def main():
        config = CoordinatorConfig(num_speculative_tokens=3, adaptive_k=False)
        backend = await LocalBackend.start(target, draft, model_name="tiny", config=config)
        try:
            params = {"temperature": 0, "max_tokens": 24}
            whole = await _events(backend, GenerateRequest(prompt=PROMPT, params=params))
            final = whole[-1]
            tokens = list(final["token_ids"])
            assert len(tokens) == 24
            for cut in (1, 7, 23):
                resumed = await _events(
                    backend,
                    GenerateRequest(
                        prompt=PROMPT, params=params, resume_token_ids=tuple(tokens[:cut])
                    ),
                )
                assert resumed[0]["kind"] == "resumed"
                offset = resumed[0]["text_offset"]
                deltas = [e for e in resumed if e["kind"] == "delta"]
                assert [t for e in deltas for t in e["token_ids"]] == tokens[cut:]
                # Delivered text (up to the offset) + the new pieces = the whole text.
                assert final["text"][:offset] + "".join(e["text"] for e in deltas) == final["text"]
                assert resumed[-1]["token_ids"] == final["token_ids"]
                assert resumed[-1]["text"] == final["text"]
                assert resumed[-1]["completion_tokens"] == 24
            # Resumed after its last token (the final event was lost): only the end is left.
            ended = await _events(
                backend, GenerateRequest(prompt=PROMPT, params=params, resume_token_ids=tokens)
            )
            assert [e["kind"] for e in ended] == ["resumed", "final"]
            assert ended[-1]["token_ids"] == final["token_ids"]
            assert ended[-1]["finish_reason"] == final["finish_reason"] == "length"
            with pytest.raises(InvalidRequestError, match="exceed max_tokens=24"):
                await _events(
                    backend,
                    GenerateRequest(prompt=PROMPT, params=params, resume_token_ids=[*tokens, 1]),
                )
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                await _events(
                    backend,
                    GenerateRequest(prompt=PROMPT, params=params, resume_token_ids=(10**9,)),
                )
        finally:
            await backend.stop(drain=False)

    asyncio.run(main())


def test_a_resumed_stream_carries_the_rest_of_the_logprobs(pair):
    """With logprobs asked, a resumed stream's deltas carry its own tokens' (the whole
    request's tail) and so does its final; the engine core scores no prompt for a resumed
    request (the first attempt's first delta had it). The ingress puts the request's back
    together (groups._whole_logprobs)."""
    target, draft = pair

    async def main():
        config = CoordinatorConfig(num_speculative_tokens=3, adaptive_k=False)
        backend = await LocalBackend.start(target, draft, model_name="tiny", config=config)
        try:
            params = {"temperature": 0, "max_tokens": 24, "logprobs": 2, "prompt_logprobs": 1}
            whole = await _events(backend, GenerateRequest(prompt=PROMPT, params=params))
            tokens, final = list(whole[-1]["token_ids"]), whole[-1]
            assert [e["token_id"] for e in final["logprobs"]] == tokens
            assert final["prompt_logprobs"] == whole[0]["prompt_logprobs"]  # first delta's
            cut = 7
            resumed = await _events(
                backend,
                GenerateRequest(prompt=PROMPT, params=params, resume_token_ids=tuple(tokens[:cut])),
            )
            deltas = [e for e in resumed if e["kind"] == "delta"]
            rest = [entry for e in deltas for entry in e["logprobs"]]
            assert [entry["token_id"] for entry in rest] == tokens[cut:]
            assert [entry["logprob"] for entry in rest] == pytest.approx(
                [entry["logprob"] for entry in final["logprobs"][cut:]], abs=1e-4
            )
            assert resumed[-1]["logprobs"] == rest and resumed[-1]["prompt_logprobs"] is None
            joined = _whole_logprobs(
                resumed[-1], final["logprobs"][:cut] + rest, final["prompt_logprobs"]
            )
            assert [entry["token_id"] for entry in joined["logprobs"]] == tokens
            assert joined["prompt_logprobs"] == final["prompt_logprobs"]
        finally:
            await backend.stop(drain=False)

    asyncio.run(main())


def test_resume_token_ids_are_checked_and_travel_as_plain_data():
    request = GenerateRequest(prompt="x", resume_token_ids=[1, 2])
    assert GenerateRequest.from_dict(request.to_dict()) == request
    with pytest.raises(InvalidRequestError, match="resume token ids"):
        GenerateRequest(prompt="x", resume_token_ids=[-1])
    with pytest.raises(InvalidRequestError, match="resume token ids"):
        GenerateRequest(prompt="x", resume_token_ids="12")
