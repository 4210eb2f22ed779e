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

    # ragged prefill; "c" takes the first row and leaves, and a row moves into its place
    step({"c": [3, 7, 11], "a": [1, 5, 9, 13, 17, 21, 25], "b": [2, 4, 6, 8]})
    step({"a": [30, 31, 32], "b": [40], "c": [12]})
    runner.remove(["c"])
    assert runner.seq_ids == ["b", "a"]
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


# ---- loading a rank's shard from files (specray/models/tp_loading.py) ------------------------
SHARD_MODELS = {  # the biased ones split biases; the tied one has no saved head
    "llama_biased": (LlamaForCausalLM, LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)),
    "llama_tied": (LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=True)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY)),
}


def _saved(name: str, folder) -> nn.Module:
    model_class, config = SHARD_MODELS[name]
    torch.manual_seed(1)
    model = model_class(copy.deepcopy(config)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.5)
    if folder is not None:
        model.save_pretrained(folder)
    return model


def _shard_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    from specray.models.tp_loading import load_model_shard

    torch.set_num_threads(1)
    init_process_group_cpu(rank, world_size, init_method)
    try:
        results = {}
        for name in SHARD_MODELS:
            loaded = load_model_shard(
                f"{out_dir}/{name}", rank, world_size, device=torch.device("cpu")
            ).model
            reference = apply_tp(_saved(name, None), rank, world_size)
            results[name] = {
                "state": loaded.state_dict(),
                "reference": reference.state_dict(),
                "buffers": dict(loaded.named_buffers()),
                "reference_buffers": dict(reference.named_buffers()),
                "tied": loaded.lm_head.weight is loaded.get_input_embeddings().weight,
                "logits": _schedule(loaded)[0],
            }
        torch.save(results, f"{out_dir}/shard{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # spawns two processes that load every model over gloo
@pytest.mark.timeout(120)
def test_a_rank_loads_exactly_its_shard_from_the_files(tmp_path, monkeypatch):
    """Each rank's model read as a shard from safetensors equals the whole model loaded and
    then sharded (apply_tp), tensor for tensor, and runs the same logits as the unsharded
    model; a tied head stays tied."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in SHARD_MODELS:
        _saved(name, tmp_path / name)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_shard_worker, args=(WORLD_SIZE, init_method, str(tmp_path)), nprocs=WORLD_SIZE)
    for name in SHARD_MODELS:
        ref_logits = _schedule(_saved(name, None))[0]
        for rank in range(WORLD_SIZE):
            got = torch.load(tmp_path / f"shard{rank}.pt")[name]
            assert got["state"].keys() == got["reference"].keys()
            for key, value in got["reference"].items():
                assert torch.equal(got["state"][key], value), (name, rank, key)
            for key, value in got["reference_buffers"].items():
                assert torch.equal(got["buffers"][key], value), (name, rank, key)
            assert got["tied"] == (name == "llama_tied")
            for logits, want in zip(got["logits"], ref_logits, strict=True):
                torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


def test_a_shard_is_one_chunk_of_the_saved_tensor():
    from specray.models.tp_loading import shard_slice

    assert shard_slice((6, 4), (3, 4), 1) == (slice(3, 6), slice(0, 4))
    assert shard_slice((6, 4), (6, 4), 1) == (slice(0, 6), slice(0, 4))  # kept whole
    with pytest.raises(ValueError, match=r"not one chunk of a tensor of shape \(6, 4\)"):
        shard_slice((6, 4), (3, 2), 0)
    with pytest.raises(ValueError, match="not one chunk"):
        shard_slice((6, 4), (4, 4), 0)


@pytest.mark.slow  # three spawned processes
@pytest.mark.timeout(180)
def test_the_tp_memory_bench_reports_each_rank(monkeypatch):
    """`specray bench --tp-memory` at a small shape: every rank reports, and a TP = 2 rank
    holds less than the whole model (the peak-memory goal is measured at 1.1B: README)."""
    from specray.bench.tp_memory import TpMemoryConfig, format_report, run_tp_memory

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = TpMemoryConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    report = run_tp_memory(config)
    assert [rank["rank"] for rank in report["tp1"] + report["tp2"]] == [0, 0, 1]
    whole = report["tp1"][0]["parameters_mb"]
    for rank in report["tp2"]:
        assert 0.5 * whole < rank["parameters_mb"] < 0.6 * whole  # half the layers, whole ends
        assert rank["peak_rss_mb"] > 0
    assert report["tp2_over_tp1_peak_rss"] > 0
    assert "TP = 2 over TP = 1" in format_report(report)
