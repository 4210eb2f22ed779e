"""The greedy contract on GPUs (specray/sampling/greedy_contract.py), exercised here on the CPU:
speculative greedy output against target-only greedy output, with the target-only run's own
logits as the reference for near-ties.

On the CPU the two are identical; the negative controls part them at a step with a wide
top-2 gap (the contract must refuse) and at a constructed near-tie (it must allow).
"""

import pytest
import torch

from specray import Engine, SamplingParams
from specray.models.runner import ModelRunner
from specray.sampling.greedy_contract import compare_greedy, near_tie_tolerance
from tests.helpers.tiny_models import perturbed_copy, tiny_llama

VOCAB = 97
PROMPTS = [[5, 17, 3], [44, 2, 9, 61, 7], [1]]


def _reference_logits(model, prompt, tokens) -> torch.Tensor:
    """The target-only logits that chose each token: ``[len(tokens), vocab]``."""
    runner = ModelRunner(model, tune=False)
    feed = [*prompt, *tokens[:-1]]
    return runner.forward({"s": feed}, {"s": len(tokens)})["s"]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(VOCAB, seed=11, num_hidden_layers=2, hidden_size=32)
    return target, perturbed_copy(target, seed=12, noise=0.2)


def test_speculative_greedy_holds_the_contract_here(pair):
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    speculative = Engine(target=target, draft=draft, num_speculative_tokens=4, device="cpu")
    reference = Engine(target=target, draft=None, device="cpu")
    for prompt in PROMPTS:
        (spec,) = speculative.generate([prompt], params)
        (ref,) = reference.generate([prompt], params)
        logits = _reference_logits(target, prompt, ref.token_ids)
        assert ref.token_ids == logits.argmax(-1).tolist()  # the reference is its own argmax
        comparison = compare_greedy(spec.token_ids, ref.token_ids, logits, torch.float32)
        assert comparison.holds and comparison.parted_at is None  # identical on the CPU


def test_a_parting_at_a_wide_gap_breaks_the_contract_and_at_a_near_tie_does_not(pair):
    target, _ = pair
    prompt = PROMPTS[0]
    reference = Engine(target=target, draft=None, device="cpu")
    (ref,) = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    logits = _reference_logits(target, prompt, ref.token_ids)
    top2 = logits.topk(2, dim=-1).values  # [steps, 2]
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    wide = max(range(len(gaps)), key=gaps.__getitem__)
    runner_up = logits[wide].topk(2).indices[1].item()
    parted = [*ref.token_ids[:wide], runner_up]
    verdict = compare_greedy(parted, ref.token_ids, logits, torch.bfloat16)
    assert verdict.parted_at == wide and not verdict.holds
    # The same parting where the reference's top two logits are made a near-tie: allowed.
    tied = logits.clone()
    tied[wide, runner_up] = top2[wide, 0] - 0.5 * near_tie_tolerance(
        top2[wide, 0].item(), torch.bfloat16
    )
    verdict = compare_greedy(parted, ref.token_ids, tied, torch.bfloat16)
    assert verdict.parted_at == wide and verdict.holds


def test_the_tolerance_is_relative_and_per_dtype():
    assert near_tie_tolerance(5.0, torch.bfloat16) == 5.0 * 2**-6
    assert near_tie_tolerance(0.25, torch.float32) == 2**-16  # at least 1 x the relative step
    with pytest.raises(ValueError, match="dtype must be one of"):
        near_tie_tolerance(1.0, torch.int8)
