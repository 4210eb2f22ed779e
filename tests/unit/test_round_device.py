"""One verification round of the target core, watched from the inside.

- Host synchronisations: a round of B = 64 requests with k = 8 drafts each (greedy and sampled
  with sparse top-M q mixed) reads the device at most twice: the sampled rule's one flag and
  the one copy of the round's results. Counted: ``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()`` and tensor truth / int / float / index conversions, on any tensor (on this
  CPU-only machine every tensor counts, so host-side validation would count too).
- Devices: every tensor factory called during the round names its device (``device=``), so
  nothing lands on the CPU by default when the model lives on a GPU. Host staging says
  ``device="cpu"`` on purpose. (The runner, the batched pipeline and the rules also run whole
  on the meta device in their own tests.)

Both watchers are checked against a deliberate violation first (the negative controls).
"""

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

from specray.core import RequestState, TargetCore
from specray.models.runner import ModelRunner
from specray.sampling import SamplingParams
from specray.sampling.encoding import SparseDraftProbs

SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "eye",
    "linspace",
}
VOCAB, BATCH, K, TOP_M = 300, 64, 8, 16


class Watch(TorchFunctionMode):
    """Counts host synchronisations and records factory calls without ``device=``."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.undevised: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.syncs.append(name)
        if (
            name in FACTORIES
            and getattr(func, "__module__", "") == "torch"
            and "device" not in kwargs
        ):
            self.undevised.append(name)
        return func(*args, **kwargs)


def _runner() -> ModelRunner:
    """A one-layer grouped-query Llama of VOCAB tokens, seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    return ModelRunner(LlamaForCausalLM(config).eval(), tune=False)


def _round(**logprobs):
    """A core with BATCH prefilled requests (half greedy, half sampled at temperature 1 with
    top-p and a penalty) and their blocks of K tokens, sparse q for the sampled ones;
    ``logprobs``: SamplingParams' log-probability fields for every request."""
    core = TargetCore(_runner())
    rng = random.Random(0)
    requests, blocks = [], {}
    for i in range(BATCH):
        greedy = i % 2 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            top_p=1.0 if greedy else 0.9,
            presence_penalty=0.0 if greedy else 0.5,
            max_tokens=64,
            **logprobs,
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
        requests.append(RequestState.create(f"r{i}", prompt, params, i, VOCAB, frozenset()))
        tokens = [rng.randrange(VOCAB) for _ in range(K)]
        if greedy:
            blocks[f"r{i}"] = (tokens, torch.zeros(K, VOCAB))  # greedy reads the tokens only
            continue
        ids = torch.stack(  # row j: the drafted token first, then M - 1 others, all distinct
            [
                torch.tensor([t, *rng.sample([v for v in range(VOCAB) if v != t], TOP_M - 1)])
                for t in tokens
            ]
        )
        values = torch.softmax(torch.randn(K, TOP_M), dim=-1)
        blocks[f"r{i}"] = (tokens, SparseDraftProbs(ids, values, VOCAB))
    core.prefill(requests)
    return core, requests, blocks


def test_the_watchers_see_a_sync_and_an_undevised_factory():
    with Watch() as watch:
        torch.zeros(2).tolist()
        torch.arange(3, device="cpu")
    assert watch.syncs == ["tolist"]
    assert watch.undevised == ["zeros"]


def test_a_round_reads_the_device_at_most_twice_and_names_every_device():
    core, requests, blocks = _round()
    with Watch() as watch:
        committed = core.verify_round(requests, blocks)
    assert len(committed) == BATCH and all(1 <= len(tokens) <= K + 1 for tokens in committed)
    assert len(watch.syncs) <= 2, watch.syncs
    assert watch.undevised == []


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_cost_a_round_one_more_read(mode):
    """Requests asking for logprobs (and their prompt's): one more copy to the host per round,
    whatever the batch; the prefill reads each chunk's prompt logprobs once."""
    core, requests, blocks = _round(logprobs=5, prompt_logprobs=2, logprobs_mode=mode)
    with Watch() as watch:
        core.verify_round(requests, blocks)
    assert len(watch.syncs) <= 3, watch.syncs
    assert watch.undevised == []
    assert all(len(r.logprobs) == len(r.output_token_ids) for r in requests)
    assert all(len(r.prompt_logprobs) == len(r.prompt_token_ids) - 1 for r in requests)


def test_a_packed_forward_reads_nothing_back_and_names_every_device():
    """Rows fed 1, 1, 30 and 4 tokens (a prompt beside decoding and a verification) run packed
    (models/packing.py): staged on the host, copied once, nothing read back."""
    runner = _runner()
    runner.forward({"a": [1, 2, 3], "b": [4, 5], "d": [6, 7, 8, 9]}, {})
    feeds = {"a": [10], "b": [11], "c": list(range(30)), "d": [12, 13, 14, 15]}
    with Watch() as watch:
        logits = runner.forward(feeds, {seq_id: len(feed) for seq_id, feed in feeds.items()})
    assert {seq_id: rows.shape[0] for seq_id, rows in logits.items()} == {
        "a": 1,
        "b": 1,
        "c": 30,
        "d": 4,
    }
    assert watch.syncs == [] and watch.undevised == []
