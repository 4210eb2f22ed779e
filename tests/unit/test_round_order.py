"""A round's requests may come in any order; the forward leaves their logits in the cache's row
order, which refilling freed rows makes differ from the round's. The target's core takes them
in the rows' order, so the batched logits pass reads them in place rather than copying every
``[rows, vocab]`` into the round's order, and each request commits what it would in any order."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specray.core import RequestState, TargetCore
from specray.models.loading import load_model
from specray.models.runner import ModelRunner
from specray.models.tiny import save_tiny_model
from specray.sampling import SamplingParams


class _WideCats(TorchFunctionMode):
    """Counts ``torch.cat`` calls over vocabulary-wide rows."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.count = width, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.cat and args[0] and args[0][0].dim() == 2:
            self.count += args[0][0].shape[1] == self.width
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def _requests(vocab_size: int) -> list[RequestState]:
    """Six requests, greedy and sampled in turn (temperature 1, seeds 0..5)."""
    made = []
    for index in range(6):
        params = SamplingParams(
            max_tokens=12, temperature=0.0 if index % 2 else 1.0, ignore_eos=True, seed=index
        )
        prompt = [3 + index, 40 + 7 * index, 9, 100 + index]
        made.append(
            RequestState.create(f"r{index}", prompt, params, index, vocab_size, frozenset())
        )
    return made


def _run(model_dir: str, shuffle: bool) -> tuple[dict[str, list[int]], int]:
    """Rounds until every request ended; the first request leaves after 3 rounds (its row is
    refilled from the end). ``shuffle``: every later round takes the requests in a random
    order. Returns each request's tokens and the vocabulary-wide cats of the rounds after the
    leaving."""
    loaded = load_model(model_dir, param="target", device="cpu")
    core = TargetCore(ModelRunner(loaded.model))
    requests = _requests(core.vocab_size)
    core.verify_round(requests, {}, core.fusable(requests, {}))  # all admitted, in this order
    for _ in range(2):
        core.verify_round(requests, {})
    core.release([requests[0].request_id])
    live, rng, cats = requests[1:], random.Random(11), _WideCats(core.vocab_size)
    while live:
        taken = rng.sample(live, len(live)) if shuffle else live
        with cats:
            core.verify_round(taken, {})
        live = [r for r in live if not r.finish_reason]
    return {r.request_id: list(r.output_token_ids) for r in requests}, cats.count


def test_any_order_commits_the_same_tokens_and_reads_the_logits_in_place(model_dir):
    in_order, _ = _run(model_dir, shuffle=False)
    shuffled, wide_cats = _run(model_dir, shuffle=True)
    assert shuffled == in_order
    assert all(len(tokens) == 12 for tokens in in_order.values() if tokens != in_order["r0"])
    assert wide_cats == 0
