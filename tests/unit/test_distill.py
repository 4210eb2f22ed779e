"""``specray distill`` on a tiny random target: end to end in seconds, resumable to the same
weights, loadable by the engine with greedy identity, and refusing a mismatched vocabulary."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from specray.cli import main
from specray.distill.config import DistillConfig
from specray.distill.data import load_sequences, shard_path
from specray.distill.pipeline import SUMMARY_FILE, resolve_config, run_distill
from specray.distill.student import WEIGHTS_FILE, layer_sources, vocabulary_fingerprint
from specray.drafters import VocabularyMismatchError
from specray.engine import Engine
from specray.models.int8 import Int8Linear
from specray.sampling import SamplingParams
from tests.helpers.tiny_models import save_tiny_chat_pair, tiny_llama

PROMPTS = ["Tell me about rivers.", "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    target, _ = save_tiny_chat_pair(tmp_path_factory.mktemp("models"))
    return target


def small_config(target: str, **changes) -> DistillConfig:
    fields = dict(
        target=target,
        num_prompts=16,
        max_new_tokens=8,
        gen_batch_size=48,
        train_steps=6,
        batch_sequences=4,
        head_vocab=512,
        checkpoint_every=2,
        num_layers=1,
        threads=1,
    )
    return DistillConfig(**{**fields, **changes})


@pytest.fixture(scope="module")
def uninterrupted(tiny_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("run-a")
    summary = run_distill(folder, small_config(tiny_target))
    return folder, summary


@pytest.mark.slow  # a whole distillation run (or more)
def test_end_to_end_makes_a_loadable_draft(tiny_target, uninterrupted):
    folder, summary = uninterrupted
    assert summary["data"]["answer_tokens"] > 100
    assert summary["train"]["steps"] == 6
    assert [entry["step"] for entry in summary["train"]["history"]] == [0, 2, 4, 6]
    weights = load_file(str(folder / WEIGHTS_FILE))
    assert not any("embed_tokens" in name for name in weights)  # referenced, not copied
    assert weights["lm_head.vocab_ids"].numel() == 512
    assert json.loads((folder / SUMMARY_FILE).read_text())["draft"]["weights_bytes"] > 0
    params = SamplingParams(temperature=0, max_tokens=12, seed=0)
    reference = Engine(tiny_target, draft=None).generate(PROMPTS, params)
    engine = Engine(tiny_target, draft=str(folder), num_speculative_tokens=3)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    # The engine's draft reads the target's own embedding tensor.
    draft_embed = engine.drafter.runner.model.get_input_embeddings().weight
    assert draft_embed.data_ptr() == engine.target.model.get_input_embeddings().weight.data_ptr()


@pytest.mark.slow  # a whole distillation run (or more)
def test_resumed_run_ends_with_the_same_weights(tiny_target, uninterrupted, tmp_path):
    folder_a, _ = uninterrupted
    config = small_config(tiny_target)
    run_distill(tmp_path, config, stop_at=3)  # a session that ends mid-way
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["step"] == 3
    shard_bytes = shard_path(tmp_path, 1).read_bytes()
    shard_path(tmp_path, 1).unlink()  # and a data shard lost
    run_distill(tmp_path, config)
    assert shard_path(tmp_path, 1).read_bytes() == shard_bytes  # regenerated identically
    first = load_file(str(folder_a / WEIGHTS_FILE))
    resumed = load_file(str(tmp_path / WEIGHTS_FILE))
    assert first.keys() == resumed.keys()
    for name in first:
        assert torch.equal(first[name], resumed[name]), name


@pytest.mark.slow  # a whole distillation run (or more)
def test_same_data_and_seed_give_same_sequences(tiny_target, uninterrupted, tmp_path):
    folder_a, _ = uninterrupted
    run_distill(tmp_path, small_config(tiny_target), phase="data")
    a = load_sequences(sorted((folder_a / "data").glob("shard-*.pt")))
    b = load_sequences(sorted((tmp_path / "data").glob("shard-*.pt")))
    assert len(a) == len(b)
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))


@pytest.mark.slow  # a whole distillation run (or more)
def test_resume_refuses_a_change_of_data(tiny_target, uninterrupted):
    folder, _ = uninterrupted
    changed = replace(small_config(tiny_target), seed=5)
    with pytest.raises(ValueError, match="seed=0"):
        resolve_config(folder, changed, {"seed"})
    longer = resolve_config(folder, replace(changed, seed=0, train_steps=9), {"train_steps"})
    assert longer.train_steps == 9  # training fields may change between sessions


@pytest.mark.slow  # a whole distillation run (or more)
def test_draft_refuses_another_vocabulary(uninterrupted, tmp_path):
    folder, _ = uninterrupted
    other = tiny_llama(7, seed=0)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(VocabularyMismatchError, match="7"):
        Engine(str(tmp_path / "other"), draft=str(folder))


def test_vocabulary_fingerprint_tells_tokenizers_apart():
    class Vocab:
        def __init__(self, mapping):
            self.mapping = mapping

        def get_vocab(self):
            return dict(self.mapping)

    same = vocabulary_fingerprint(Vocab({"a": 0, "b": 1}))
    assert same == vocabulary_fingerprint(Vocab({"b": 1, "a": 0}))
    assert same != vocabulary_fingerprint(Vocab({"a": 1, "b": 0}))


def test_layer_sources_are_spread_over_the_target():
    assert layer_sources(30, 2) == [0, 29]
    assert layer_sources(30, 4) == [0, 10, 19, 29]
    assert layer_sources(30, 1) == [29]
    with pytest.raises(ValueError, match="num_layers"):
        layer_sources(2, 3)


@pytest.mark.parametrize(
    "field, value",
    [("num_layers", 0), ("head_vocab", -1), ("sample_fraction", 1.5), ("train_steps", True)],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DistillConfig(**{field: value})


def test_cli_runs_and_reports_bad_input(tiny_target, tmp_path, capsys):
    out = tmp_path / "cli"
    common = ["distill", "--target", tiny_target, "--out", str(out), "--num-prompts", "60"]
    small = ["--max-new-tokens", "4", "--train-steps", "2", "--head-vocab", "256"]
    small += ["--num-layers", "1", "--checkpoint-every", "1", "--text-prompts", "false"]
    small += ["--batch-sequences", "4", "--gen-batch-size", "64"]
    assert main([*common, *small]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["train"]["steps"] == 2 and (out / WEIGHTS_FILE).exists()
    assert main(["distill", "--out", str(tmp_path / "bad"), "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens must be a positive integer, got 0" in capsys.readouterr().err


def test_self_int8_draft_keeps_greedy_identity(tiny_target):
    params = SamplingParams(temperature=0, max_tokens=12, seed=0)
    reference = Engine(tiny_target, draft=None).generate(PROMPTS, params)
    engine = Engine(tiny_target, draft="self:int8", num_speculative_tokens=3)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    layer = engine.drafter.runner.model.get_decoder().layers[0].mlp.up_proj
    assert "quantized" in type(layer).__module__  # torch.ao.nn.quantized.dynamic
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_ngram_chain_keeps_greedy_identity(tiny_target):
    params = SamplingParams(temperature=0, max_tokens=12, seed=0)
    reference = Engine(tiny_target, draft=None).generate(PROMPTS, params)
    engine = Engine(tiny_target, draft="ngram+self:fp32", num_speculative_tokens=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [
        r.token_ids for r in reference
    ]
    with pytest.raises(ValueError, match="ngram\\+X"):
        Engine(tiny_target, draft="ngram+ngram")


def test_self_auto_takes_a_half_precision_and_keeps_greedy_identity(tiny_target):
    params = SamplingParams(temperature=0, max_tokens=12, seed=0)
    reference = Engine(tiny_target, draft=None).generate(PROMPTS, params)
    engine = Engine(tiny_target, draft="self:auto", num_speculative_tokens=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [
        r.token_ids for r in reference
    ]
    assert engine.drafter.runner.model.dtype in (torch.float16, torch.bfloat16)


def test_unknown_self_draft_is_named(tiny_target):
    with pytest.raises(ValueError, match="self:int4"):
        Engine(tiny_target, draft="self:int4")


def test_draft_worker_loads_a_distilled_draft_without_the_target_weights(
    tiny_target, uninterrupted
):
    from specray.actors.draft_worker import DraftWorker

    folder, _ = uninterrupted
    worker = DraftWorker(tiny_target, str(folder))
    model = worker.drafter.runner.model
    embeddings = model.get_input_embeddings().weight
    target = Engine(tiny_target, draft=None).target.model
    assert torch.equal(embeddings, target.get_input_embeddings().weight)  # read from its file
    assert worker.vocab_size == target.config.vocab_size


@pytest.mark.slow  # a background process that imports torch and trains, polled for up to 120 s
def test_background_run_writes_its_log_and_draft(tiny_target, tmp_path, capsys):
    import time

    out = tmp_path / "bg"
    argv = ["distill", "--target", tiny_target, "--out", str(out), "--num-prompts", "60"]
    argv += ["--max-new-tokens", "4", "--train-steps", "2", "--head-vocab", "256"]
    argv += ["--num-layers", "1", "--text-prompts", "false", "--batch-sequences", "4"]
    assert main([*argv, "--background"]) == 0
    assert "in the background (pid" in capsys.readouterr().out
    log_file, deadline = out / "distill.log", time.monotonic() + 120
    # The draft's files appear before its last log line: wait for that line, not the files.
    while time.monotonic() < deadline:
        if log_file.exists() and "draft written to" in log_file.read_text():
            break
        time.sleep(0.5)
    log = log_file.read_text()
    assert (out / "specray_draft.json").exists(), log[-2000:]
    assert "distill train:" in log and "draft written to" in log


SHIPPED_LIMIT_BYTES = 25_000_000  # the shipped draft's budget inside the package


@pytest.mark.slow  # loads the default model four times
def test_shipped_draft_is_small_loads_and_keeps_greedy_identity(tmp_path):
    from specray.drafters import shipped_draft_dir

    folder = shipped_draft_dir()
    size = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    assert size <= SHIPPED_LIMIT_BYTES, size
    marker = json.loads((folder / "specray_draft.json").read_text())
    assert marker["target"] == "default" and marker["head_vocab"] == 8192
    params = SamplingParams(temperature=0, max_tokens=16, seed=0)
    reference = Engine("default", draft=None).generate(PROMPTS, params)
    engine = Engine("default", draft="distilled", num_speculative_tokens=2)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
    # In fp16 its own weights convert; the target's shared embeddings stay fp32, not copied.
    half = Engine("default", draft="distilled:fp16", num_speculative_tokens=2)
    outputs = half.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    draft_model = half.drafter.runner.model
    assert draft_model.get_decoder().layers[0].mlp.up_proj.weight.dtype == torch.float16
    target_embed = half.target.model.get_input_embeddings().weight
    assert target_embed.dtype == torch.float32
    assert draft_model.get_input_embeddings().weight.data_ptr() == target_embed.data_ptr()
    # In int8 (weight-only, bf16 rows) through the lean forward: the same greedy tokens.
    quantized = Engine("default", draft="distilled:int8", num_speculative_tokens=2)
    outputs = quantized.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
    runner = quantized.drafter.runner
    assert runner._lean is not None
    assert type(runner.model.get_decoder().layers[0].mlp.up_proj) is Int8Linear
    assert runner.model.get_input_embeddings().weight.dtype == torch.float32  # the target's
    with pytest.raises(ValueError, match="distilled:int4"):
        Engine("default", draft="distilled:int4")
    other = tiny_llama(7, seed=0)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(VocabularyMismatchError, match="49152"):
        Engine(str(tmp_path / "other"), draft="distilled")
