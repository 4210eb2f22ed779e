"""The one frozen, validated configuration of a distillation run; saved beside the weights so
a run is reproducible (same config and seed -> same data and same weights) and resumable.

Local text (``local_text``) is off by default. The draft serves a chat model, and the target's
own chat answers stay the data that matches serving; teacher-forced text adds contexts the
target did not write (pasted documents and code that answers quote or continue) at a cost of one
forward per chunk instead of one per token. The keyword ``"stdlib"`` names the Python standard
library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``: code and docstrings, always
on disk, no download); it differs between Python versions, so name files of your own for data
that must be the same on every machine. Files are read in sorted order until the budget is
spent: 200,000 tokens of the whole library would be its first 28 modules (__future__ to asyncio), so
``local_text_chunks_per_file`` (e.g. 1: each module's docstring and imports) spreads the budget.
A config saved before these fields existed loads with them off.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, dataclass, fields
from pathlib import Path

CONFIG_FILE = "distill_config.json"
STDLIB = "stdlib"  # a local_text entry naming the Python standard library (./stdlib: a folder)
MIN_TEXT_CHUNK = 8  # tokens: a shorter local-text chunk (a file's tail) has too little context


@dataclass(frozen=True)
class DistillConfig:
    target: str = "default"
    seed: int = 0
    # Student: decoder layers at the target's width (initialised from evenly spaced target
    # layers), the target's embeddings shared and frozen, a head over the ``head_vocab`` most
    # frequent target tokens (0 = the full vocabulary).
    num_layers: int = 2
    head_vocab: int = 8192
    # Feature-conditioned (EAGLE) student: each position also reads the target's final-norm
    # hidden state of the position before (served in process only). Trained on the frozen
    # target's features, computed per batch, and on its own outputs chained.
    feature_conditioned: bool = False
    chained_passes: int = 1  # extra passes per batch reading the previous pass's outputs
    # Data: the target's own answers to the prompt set, then its teacher-forced distributions.
    num_prompts: int = 0  # chat/code prompts answered (0 = all the templates make)
    text_prompts: bool = True  # also text work over passages the target wrote first
    max_new_tokens: int = 192
    sample_fraction: float = 0.5  # share of generation batches sampled (the rest greedy)
    sample_temperature: float = 0.8
    gen_batch_size: int = 32
    teacher_top_k: int = 32  # target probabilities kept per position
    # Local text: the target's teacher-forced distribution over text on disk (off when empty).
    local_text: tuple[str, ...] = ()  # files or directories (.txt .md .rst .py), or "stdlib"
    local_text_tokens: int = 200_000  # token budget, taken in sorted file order
    local_text_chunk: int = 256  # tokens per sequence (a chunk never spans two files)
    local_text_chunks_per_file: int = 0  # most chunks from one file (0 = no limit)
    # Training.
    train_steps: int = 600
    batch_sequences: int = 16
    max_seq_len: int = 320  # tokens per training sequence (prompt + answer, truncated)
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    soft_weight: float = 1.0  # cross-entropy against the target's top-k distribution
    hard_weight: float = 0.5  # cross-entropy against the target's most likely token
    local_text_fraction: float = 0.25  # share of each batch drawn from local text (when on)
    checkpoint_every: int = 50
    threads: int = 0  # torch threads (0 = torch's default)

    def __post_init__(self) -> None:
        self._check_local_text()
        positive = (
            "num_layers",
            "max_new_tokens",
            "gen_batch_size",
            "teacher_top_k",
            "train_steps",
            "batch_sequences",
            "max_seq_len",
            "checkpoint_every",
            "local_text_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        non_negative = (
            "seed",
            "num_prompts",
            "head_vocab",
            "warmup_steps",
            "threads",
            "local_text_chunks_per_file",
            "chained_passes",
        )
        for name in non_negative:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.feature_conditioned, bool):
            raise ValueError(
                f"feature_conditioned must be true or false, got {self.feature_conditioned!r}"
            )
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
        chunk = self.local_text_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < MIN_TEXT_CHUNK:
            raise ValueError(
                f"local_text_chunk must be an integer >= {MIN_TEXT_CHUNK}, got {chunk!r}"
            )
        if not 0.0 <= self.local_text_fraction <= 1.0:
            raise ValueError(
                f"local_text_fraction must be in [0, 1], got {self.local_text_fraction!r}"
            )
        if self.local_text and self.local_text_fraction == 0.0:
            raise ValueError(
                f"local_text_fraction must be > 0 when local_text is set, got "
                f"{self.local_text_fraction!r} (its data would never be trained on)"
            )

    def _check_local_text(self) -> None:
        entries = self.local_text
        if isinstance(entries, str):  # one path given bare
            entries = (entries,)
        if not isinstance(entries, (tuple, list)) or not all(
            isinstance(entry, str) and entry for entry in entries
        ):
            raise ValueError(f"local_text must be a list of paths, got {self.local_text!r}")
        object.__setattr__(self, "local_text", tuple(entries))  # JSON and the CLI give lists
        for entry, root in zip(self.local_text, self.local_text_roots(), strict=True):
            if not root.exists():
                raise ValueError(f"local_text path {entry!r} does not exist")

    def local_text_roots(self) -> list[Path]:
        """The local-text entries as paths (``"stdlib"`` -> the standard library's folder)."""
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return [stdlib if entry == STDLIB else Path(entry) for entry in self.local_text]

    def data_key(self) -> dict:
        """What the generated data depends on: a resumed run must not mix other data in.
        (``local_text_fraction`` only weighs the data in training: it may change.)"""
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
            "local_text",
            "local_text_tokens",
            "local_text_chunk",
            "local_text_chunks_per_file",
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
