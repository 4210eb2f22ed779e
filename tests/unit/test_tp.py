"""Tensor parallelism (``apply_tp``) against the unsharded model as the oracle.

Two spawned processes (gloo over a loopback file rendezvous) shard the same seeded tiny models,
run one ModelRunner schedule (ragged prefill, append, rollback, append, 10 greedy steps) and
save what they saw; the parent runs the same schedule unsharded and compares: logits to 1e-5,
greedy tokens identical, on both ranks.
"""

import copy

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specray.models.runner import ModelRunner
from specray.models.tp import apply_tp, init_process_group_cpu

WORLD_SIZE = 2
VOCAB = 64
GREEDY_STEPS = 10
ATOL = 1e-5
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# name -> (model class, config); the biased ones check colwise bias split, rowwise bias added once
MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig(**TINY)),
    "llama_biased": (LlamaForCausalLM, LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**TINY)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY)),  # q/k/v biases
}


def _build(name: str) -> nn.Module:
    """The same random weights in every process (biases, zero at init, randomized too)."""
    model_class, config = MODELS[name]
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.5)
    return model


def _schedule(model: nn.Module) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """Every logits tensor the runner returns, the greedy tokens of two sequences, and the
    number of KV heads in the runner's cache."""
    runner = ModelRunner(model)
    logits = []

    def step(feed: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        out = runner.forward(feed, {seq_id: len(tokens) for seq_id, tokens in feed.items()})
        logits.extend(out[seq_id] for seq_id in sorted(out))  # [len, vocab] each
        return out

    step({"a": [1, 5, 9, 13, 17, 21, 25], "b": [2, 4, 6, 8]})  # ragged prefill
    step({"a": [30, 31, 32], "b": [40]})
    runner.rollback("a", 2)
    runner.rollback("b", 1)
    out = step({"a": [50, 51], "b": [60, 61, 62]})
    greedy = {seq_id: [int(out[seq_id][-1].argmax())] for seq_id in out}
    for _ in range(GREEDY_STEPS - 1):
        out = step({seq_id: tokens[-1:] for seq_id, tokens in greedy.items()})
        for seq_id, tokens in greedy.items():
            tokens.append(int(out[seq_id][-1].argmax()))
    return logits, [greedy["a"], greedy["b"]], runner.cache.layers[0].keys.shape[1]


def _tp_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group_cpu(rank, world_size, init_method)
    try:
        results = {}
        for name in MODELS:
            results[name] = _schedule(apply_tp(_build(name), rank, world_size))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # spawns two processes that build every model and talk over gloo
@pytest.mark.timeout(120)  # a rank stuck in a collective fails here, not after 15 minutes
def test_tp2_matches_unsharded(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned children
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_tp_worker, args=(WORLD_SIZE, init_method, str(tmp_path)), nprocs=WORLD_SIZE)
    for name in MODELS:
        ref_logits, ref_tokens, ref_kv_heads = _schedule(_build(name))
        for rank in range(WORLD_SIZE):
            logits, tokens, kv_heads = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert kv_heads == ref_kv_heads // WORLD_SIZE  # each rank caches only its heads
            assert len(logits) == len(ref_logits)
            for got, want in zip(logits, ref_logits, strict=True):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            assert tokens == ref_tokens, (name, rank)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48),
            "num_key_value_heads=3",
        ),
        (
            dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=24),
            "num_attention_heads=3",
        ),
        (dict(intermediate_size=65), "intermediate_size=65"),
    ],
)
def test_indivisible_shapes_are_refused_before_any_change(overrides, message):
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"{message} is not divisible by tp_size=2"):
        apply_tp(model, rank=0, world_size=2)
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_unsupported_model_type_is_refused():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        apply_tp(model, rank=0, world_size=2)


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_is_refused(rank, world_size):
    with pytest.raises(ValueError, match=f"rank={rank}, world_size={world_size}"):
        apply_tp(_build("llama"), rank, world_size)


def test_world_size_one_is_a_no_op():
    model = _build("llama")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    assert apply_tp(model, rank=0, world_size=1) is model
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert not any(module._forward_hooks for module in model.modules())


def test_sharding_needs_a_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="initialized process group"):
        apply_tp(_build("llama"), rank=0, world_size=2)
