"""``specray distill`` with local text on a tiny random target: the recorded distributions are
the target's teacher-forced ones, the shards regenerate identically, training mixes both
sources reproducibly, and bad values or a changed source are refused by name."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specray.cli import main
from specray.distill.config import DistillConfig
from specray.distill.data import (
    load_sequences,
    local_text_files,
    plan_text_chunks,
    teacher_force_local_text,
    text_shard_path,
)
from specray.distill.pipeline import resolve_config, run_distill
from specray.distill.prompts import TOPICS
from specray.distill.student import WEIGHTS_FILE
from specray.distill.train import draw_batch
from specray.engine import Engine
from specray.models.loading import load_model
from specray.sampling import SamplingParams
from tests.unit import test_distill
from tests.unit.test_distill import PROMPTS, small_config

tiny_target = test_distill.tiny_target  # the same tiny random target fixture

TEXT_TOKENS = 700  # budget: about 22 chunks of 32 tokens, 3 shards of 8
CHUNK = 32


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """Three text files (prose, notes, code) and two that a directory does not contribute."""
    folder = tmp_path_factory.mktemp("text")
    (folder / "b").mkdir()
    (folder / "a.md").write_text(
        "\n".join(f"{topic.capitalize()} is something people often ask about." for topic in TOPICS)
    )
    (folder / "b" / "notes.txt").write_text(
        " ".join(f"Note {n}: check {TOPICS[n % len(TOPICS)]} twice." for n in range(60))
    )
    (folder / "code.py").write_text(
        "\n\n".join(f"def add_{n}(a, b):\n    return a + b + {n}" for n in range(40))
    )
    (folder / "data.bin").write_bytes(bytes(range(256)))  # not a text suffix
    (folder / ".hidden.txt").write_text("hidden " * 100)
    return folder


def text_config(target: str, text_dir, **changes) -> DistillConfig:
    fields = dict(
        local_text=(str(text_dir),),
        local_text_tokens=TEXT_TOKENS,
        local_text_chunk=CHUNK,
        local_text_fraction=0.5,
        gen_batch_size=8,
    )
    return small_config(target, **{**fields, **changes})


@pytest.fixture(scope="module")
def text_run(tiny_target, text_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("text-run")
    summary = run_distill(folder, text_config(tiny_target, text_dir))
    return folder, summary


def test_files_are_read_in_sorted_order_and_chunked_within_the_budget(tiny_target, text_dir):
    config = text_config(tiny_target, text_dir)
    files = [path.relative_to(text_dir).as_posix() for path in local_text_files(config)]
    assert files == ["a.md", "b/notes.txt", "code.py"]
    tokenizer = load_model(tiny_target).tokenizer
    chunks, used = plan_text_chunks(tokenizer, config)
    assert sum(len(chunk) for chunk in chunks) == TEXT_TOKENS  # the files hold more
    assert all(8 <= len(chunk) <= CHUNK for chunk in chunks)
    first = tokenizer.encode((text_dir / "a.md").read_text(), add_special_tokens=False)
    assert chunks[0] == first[:CHUNK] and chunks[1] == first[CHUNK : 2 * CHUNK]
    assert used[0] == str(text_dir / "a.md")
    # One chunk per file: each file's head, the budget spread over every file.
    capped = text_config(tiny_target, text_dir, local_text_chunks_per_file=1)
    heads, used = plan_text_chunks(tokenizer, capped)
    assert len(heads) == len(used) == 3 and heads[0] == first[:CHUNK]


@pytest.mark.slow  # a whole distillation run (or more)
def test_recorded_distributions_are_the_targets_teacher_forced_ones(tiny_target, text_run):
    folder, summary = text_run
    sequences = load_sequences(
        [text_shard_path(folder, i) for i in range(summary["data"]["local_text_shards"])]
    )
    assert len(sequences) > 8 and summary["data"]["local_text_shards"] >= 2
    model = AutoModelForCausalLM.from_pretrained(tiny_target, local_files_only=True).eval()
    for sequence in sequences:
        assert sequence.start == 0
        assert sequence.top_ids.shape == (len(sequence.token_ids) - 1, 32)
        with torch.inference_mode():  # one chunk alone, no padding: the reference forward
            logits = model(sequence.token_ids[None]).logits[0, :-1]  # [length - 1, vocab]
        probs = torch.softmax(logits.float(), dim=-1)
        recorded = sequence.top_probs.float()  # [length - 1, 32], float16 on disk
        torch.testing.assert_close(
            probs.gather(1, sequence.top_ids.long()), recorded, atol=1e-3, rtol=1e-2
        )
        torch.testing.assert_close(probs.max(dim=-1).values, recorded[:, 0], atol=1e-3, rtol=1e-2)


@pytest.mark.slow  # a whole distillation run (or more)
def test_end_to_end_with_local_text_reports_it_and_loads(tiny_target, text_dir, text_run):
    folder, summary = text_run
    tokenizer = load_model(tiny_target).tokenizer
    chunks, _ = plan_text_chunks(tokenizer, text_config(tiny_target, text_dir))
    assert summary["data"]["local_text_tokens"] == TEXT_TOKENS
    assert summary["data"]["local_text_sequences"] == len(chunks)
    assert summary["train"]["local_text_sequences"] == len(chunks)
    assert summary["data"]["answer_tokens"] > 100  # the answers are still there
    manifest = json.loads((folder / "data" / "text-manifest.json").read_text())
    assert manifest["tokens"] == TEXT_TOKENS and manifest["chunks"] == len(chunks)
    params = SamplingParams(temperature=0, max_tokens=12, seed=0)
    reference = Engine(tiny_target, draft=None).generate(PROMPTS, params)
    outputs = Engine(tiny_target, draft=str(folder), num_speculative_tokens=3).generate(
        PROMPTS, params
    )
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]


def test_batches_mix_the_sources_and_depend_only_on_seed_and_step(tiny_target, text_dir):
    config = text_config(tiny_target, text_dir, batch_sequences=4, local_text_fraction=0.5)
    answers, texts = draw_batch(config, 7, 100, 20)
    assert len(answers) == 2 and len(texts) == 2 and max(texts) < 20
    assert draw_batch(config, 7, 100, 20) == (answers, texts)
    # Without local text the draw is the one made before local text existed.
    plain = small_config(tiny_target, batch_sequences=4)
    for step in range(5):
        before = random.Random(f"{plain.seed}:batch:{step}").sample(range(100), 4)
        assert draw_batch(plain, step, 100, 0) == (before, [])


@pytest.mark.slow  # a whole distillation run (or more)
def test_lost_text_shard_and_interrupted_training_resume_identically(
    tiny_target,
    text_dir,
    text_run,
    tmp_path,
):
    folder_a, _ = text_run
    config = text_config(tiny_target, text_dir)
    run_distill(tmp_path, config, stop_at=3)
    lost = text_shard_path(tmp_path, 1)
    shard_bytes = lost.read_bytes()
    before = load_sequences([lost])
    lost.unlink()
    run_distill(tmp_path, config)
    assert lost.read_bytes() == shard_bytes  # regenerated byte for byte
    after = load_sequences([lost])
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.token_ids, new.token_ids)
        assert torch.equal(old.top_ids, new.top_ids)
        assert torch.equal(old.top_probs, new.top_probs)
    first = load_file(str(folder_a / WEIGHTS_FILE))
    resumed = load_file(str(tmp_path / WEIGHTS_FILE))
    assert first.keys() == resumed.keys()
    for name in first:
        assert torch.equal(first[name], resumed[name]), name


@pytest.mark.slow  # a whole distillation run (or more)
def test_resume_refuses_a_change_of_local_text(tiny_target, text_dir, text_run):
    folder, _ = text_run
    config = text_config(tiny_target, text_dir)
    with pytest.raises(ValueError, match=f"local_text_tokens={TEXT_TOKENS}"):
        resolve_config(folder, replace(config, local_text_tokens=500), {"local_text_tokens"})
    with pytest.raises(ValueError, match="local_text_chunk=32"):
        resolve_config(folder, replace(config, local_text_chunk=64), {"local_text_chunk"})
    with pytest.raises(ValueError, match="local_text="):
        resolve_config(folder, replace(config, local_text=("stdlib",)), {"local_text"})
    mixed = resolve_config(
        folder, replace(config, local_text_fraction=0.25), {"local_text_fraction"}
    )
    assert mixed.local_text_fraction == 0.25  # how much of a batch is text: a training field


def test_changed_files_are_refused(tiny_target, text_dir, tmp_path):
    copy = shutil.copytree(text_dir, tmp_path / "text")
    config = text_config(tiny_target, copy, local_text_tokens=64)
    target = load_model(tiny_target)
    out = tmp_path / "out"
    assert len(teacher_force_local_text(target.model, target.tokenizer, out, config)) == 1
    (copy / "a.md").write_text("Other words entirely, which the first chunks did not hold. " * 9)
    with pytest.raises(ValueError, match="local_text reads other text"):
        teacher_force_local_text(target.model, target.tokenizer, out, config)


def test_old_configs_load_with_local_text_off(tmp_path):
    from specray.drafters import shipped_draft_dir

    shutil.copy(shipped_draft_dir() / "distill_config.json", tmp_path)
    config = DistillConfig.load(tmp_path)
    assert config.local_text == () and config.num_prompts == 2000
    assert DistillConfig(local_text=["stdlib"]).local_text == ("stdlib",)  # JSON gives lists


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--local-text-tokens", "-1"], "local_text_tokens must be a positive integer, got -1"),
        (["--local-text-chunk", "4"], "local_text_chunk must be an integer >= 8, got 4"),
        (["--local-text-fraction", "1.5"], "local_text_fraction must be in [0, 1], got 1.5"),
        (["--local-text", "/no/such/text"], "local_text path '/no/such/text' does not exist"),
    ],
)
def test_cli_names_a_bad_local_text_value(flags, message, tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path / "bad"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_flags_reach_the_data_phase(tiny_target, text_dir, tmp_path, capsys):
    argv = ["distill", "--target", tiny_target, "--out", str(tmp_path / "cli"), "--phase", "data"]
    argv += ["--num-prompts", "8", "--max-new-tokens", "4", "--text-prompts", "false"]
    argv += ["--local-text", str(text_dir / "code.py"), str(text_dir / "a.md")]
    argv += ["--local-text-tokens", "104", "--local-text-chunk", "16"]  # 6.5 chunks
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["data"]["local_text_tokens"] == 104
    assert summary["config"]["local_text"] == [str(text_dir / "code.py"), str(text_dir / "a.md")]


def test_background_command_keeps_the_local_text_paths(text_dir):
    import argparse

    from specray.distill.cli import _foreground_argv, add_distill_parser

    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers(dest="command"))
    paths = [str(text_dir / "a.md"), "stdlib"]
    args = parser.parse_args(["distill", "--out", "o", "--local-text", *paths, "--background"])
    argv = _foreground_argv(args, {"local_text"})
    assert parser.parse_args(argv).local_text == paths and "--background" not in argv
