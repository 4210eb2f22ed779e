"""``specray distill``: data, training and the draft directory, each phase resumable."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specray.distill.config import CONFIG_FILE, DistillConfig
from specray.distill.data import generate_data, load_sequences, teacher_force_local_text
from specray.distill.student import WEIGHTS_FILE, FeatureDraftModel, build_student, save_draft
from specray.distill.train import head_vocabulary, train
from specray.models.runner import require_plain_head

PHASES = ("data", "train", "all")
LOG_FILE = "distill.log"
SUMMARY_FILE = "distill_summary.json"


def resolve_config(folder: Path, requested: DistillConfig, explicit: set[str]) -> DistillConfig:
    """A fresh directory takes ``requested``; an existing run keeps its saved config, with any
    explicitly given training field applied, and refuses a change that would alter its data."""
    if not (folder / CONFIG_FILE).exists():
        return requested
    saved = DistillConfig.load(folder)
    data_fields = set(saved.data_key())
    changes = {name: getattr(requested, name) for name in explicit}
    clashing = sorted(
        name for name in changes if name in data_fields and changes[name] != getattr(saved, name)
    )
    if clashing:
        values = ", ".join(f"{name}={getattr(saved, name)!r}" for name in clashing)
        raise ValueError(
            f"out {str(folder)!r} holds a run with {values}; its data would change "
            "(use another --out to start a new run)"
        )
    return DistillConfig(**{**asdict(saved), **changes})


class _Log:
    """Progress lines to stderr and to ``DIR/distill.log`` (once: a background run's stderr
    already is that file)."""

    def __init__(self, folder: Path):
        self.path = folder / LOG_FILE
        self.path.touch()
        try:
            same = os.path.samestat(os.fstat(sys.stderr.fileno()), self.path.stat())
        except (OSError, ValueError, AttributeError):  # stderr replaced (e.g. captured)
            same = False
        self.to_file = not same

    def __call__(self, message: str) -> None:
        print(f"distill: {message}", file=sys.stderr, flush=True)
        if self.to_file:
            with self.path.open("a") as handle:
                handle.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")


def run_distill(
    folder: Path, config: DistillConfig, phase: str = "all", stop_at: int | None = None
) -> dict:
    """Run the phases up to ``phase``; ``stop_at`` ends this session's training at that step
    (checkpointed; the next run continues). Returns the run's summary (also in the folder)."""
    from specray.models.loading import load_model

    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    folder.mkdir(parents=True, exist_ok=True)
    config.save(folder)
    log = _Log(folder)
    if config.threads:
        torch.set_num_threads(config.threads)
    log(f"config {json.dumps(asdict(config))}")
    target = load_model(config.target)
    eos = target.model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    summary: dict = {"config": asdict(config)}
    summary_path = folder / SUMMARY_FILE
    if summary_path.exists():
        summary = {**json.loads(summary_path.read_text()), "config": asdict(config)}

    started = time.monotonic()
    shards = generate_data(target.model, target.tokenizer, folder, config)
    sequences = load_sequences(shards)
    text_shards = teacher_force_local_text(target.model, target.tokenizer, folder, config)
    text_sequences = load_sequences(text_shards)
    data_s = time.monotonic() - started
    answer_tokens = sum(len(sequence.top_ids) for sequence in sequences)
    text_tokens = sum(len(sequence.token_ids) for sequence in text_sequences)
    summary["data"] = {
        "sequences": len(sequences),
        "answer_tokens": answer_tokens,
        "shards": len(shards),
        "local_text_sequences": len(text_sequences),
        "local_text_tokens": text_tokens,
        "local_text_shards": len(text_shards),
        # Wall seconds over every session of this run (a session with all shards on disk
        # only reads them).
        "seconds": round(summary.get("data", {}).get("seconds", 0.0) + data_s, 1),
    }
    log(f"data: {len(sequences)} sequences, {answer_tokens} target answer tokens")
    if text_sequences:
        log(f"data: {len(text_sequences)} local-text chunks, {text_tokens} tokens")
    if phase == "data":
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])
    # The head covers what the target chooses in answers (what the draft serves), not text.
    vocab_ids = head_vocabulary(sequences, config.head_vocab, vocab_size, eos)
    torch.manual_seed(config.seed)
    student = build_student(target.model, config.num_layers, vocab_ids)
    features_from = None  # the frozen target, whose hidden states a feature student reads
    if config.feature_conditioned:
        # The features are what the target's head reads: serving takes them from the runner.
        require_plain_head(target.model, "feature_conditioned")
        student, features_from = FeatureDraftModel(student), target.model.eval()
    started = time.monotonic()
    result = train(student, sequences, folder, config, log, stop_at, text_sequences, features_from)
    train_s = time.monotonic() - started
    previous = summary.get("train", {}).get("seconds", 0.0)
    result["seconds"] = round(previous + train_s, 1)
    summary["train"] = result
    save_draft(
        student,
        folder,
        config.target,
        target.tokenizer,
        {
            "distill_config": asdict(config),
            "step": result["best_step"],
            "held_out_agreement": result["best_held_out_agreement"],
        },
    )
    summary["draft"] = {
        "path": str(folder),
        "weights_bytes": (folder / WEIGHTS_FILE).stat().st_size,
        "layer_sources": student.config.specray_layer_sources,
        "feature_conditioned": config.feature_conditioned,
    }
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"draft written to {folder} ({summary['draft']['weights_bytes']} bytes of weights)")
    return summary
