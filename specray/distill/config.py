"""The one frozen, validated configuration of a distillation run; saved beside the weights so
a run is reproducible (same config and seed -> same data and same weights) and resumable."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

CONFIG_FILE = "distill_config.json"


@dataclass(frozen=True)
class DistillConfig:
    target: str = "default"
    seed: int = 0
    # Student: decoder layers at the target's width (initialised from evenly spaced target
    # layers), the target's embeddings shared and frozen, a head over the ``head_vocab`` most
    # frequent target tokens (0 = the full vocabulary).
    num_layers: int = 2
    head_vocab: int = 8192
    # Data: the target's own answers to the prompt set, then its teacher-forced distributions.
    num_prompts: int = 0  # chat/code prompts answered (0 = all the templates make)
    text_prompts: bool = True  # also text work over passages the target wrote first
    max_new_tokens: int = 192
    sample_fraction: float = 0.5  # share of generation batches sampled (the rest greedy)
    sample_temperature: float = 0.8
    gen_batch_size: int = 32
    teacher_top_k: int = 32  # target probabilities kept per position
    # Training.
    train_steps: int = 600
    batch_sequences: int = 16
    max_seq_len: int = 320  # tokens per training sequence (prompt + answer, truncated)
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    soft_weight: float = 1.0  # cross-entropy against the target's top-k distribution
    hard_weight: float = 0.5  # cross-entropy against the target's most likely token
    checkpoint_every: int = 50
    threads: int = 0  # torch threads (0 = torch's default)

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "max_new_tokens",
            "gen_batch_size",
            "teacher_top_k",
            "train_steps",
            "batch_sequences",
            "max_seq_len",
            "checkpoint_every",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("seed", "num_prompts", "head_vocab", "warmup_steps", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not 0.0 <= self.sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in [0, 1], got {self.sample_fraction!r}")
        if not 0.0 < self.sample_temperature <= 2.0:
            raise ValueError(
                f"sample_temperature must be in (0, 2], got {self.sample_temperature!r}"
            )
        for name in ("learning_rate", "soft_weight", "hard_weight"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.soft_weight + self.hard_weight <= 0:
            raise ValueError("soft_weight + hard_weight must be > 0")

    def data_key(self) -> dict:
        """What the generated data depends on: a resumed run must not mix other data in."""
        names = (
            "target",
            "seed",
            "num_prompts",
            "text_prompts",
            "max_new_tokens",
            "sample_fraction",
            "sample_temperature",
            "gen_batch_size",
            "teacher_top_k",
        )
        return {name: getattr(self, name) for name in names}

    def save(self, folder: Path) -> None:
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(folder: Path) -> DistillConfig:
        data = json.loads((folder / CONFIG_FILE).read_text())
        known = {field.name for field in fields(DistillConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{folder / CONFIG_FILE}: unknown fields {unknown}")
        return DistillConfig(**data)
