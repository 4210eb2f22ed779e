"""Distillation data: the target's own answers to the prompt set, generated in batches, and
the target's distribution (top-k) at every answer position, recorded as it generates.

Data lives in ``DIR/data/shard-NNNNN.pt``, one shard per generation batch, written atomically;
a shard on disk is never recomputed, so generation resumes where it stopped. A shard's prompts,
sampling mode and random stream depend only on the config and the shard's index, so the same
config gives the same data whether or not the run was interrupted.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specray.distill.config import DistillConfig
from specray.distill.progress import Progress
from specray.distill.prompts import chat_and_code_prompts, passage_prompts, text_prompts
from specray.engine import chat_token_ids
from specray.models.runner import ModelRunner

DATA_DIR = "data"


@dataclass
class Sequence:
    """One prompt and the target's answer, with the target's distribution over the answer."""

    token_ids: torch.Tensor  # [length] int64: prompt + answer
    start: int  # first position whose next token is an answer token (= prompt length - 1)
    top_ids: torch.Tensor  # [length - 1 - start, top_k] int32: the target's likeliest tokens
    top_probs: torch.Tensor  # [length - 1 - start, top_k] float16: their probabilities


def shard_path(folder: Path, index: int) -> Path:
    return folder / DATA_DIR / f"shard-{index:05d}.pt"


def save_atomic(obj, path: Path) -> None:
    staging = path.with_suffix(".tmp")
    torch.save(obj, staging)
    os.replace(staging, path)


def _batches(prompts: list[str], size: int) -> list[list[str]]:
    return [prompts[start : start + size] for start in range(0, len(prompts), size)]


def _shard_sampled(config: DistillConfig, index: int) -> bool:
    return random.Random(f"{config.seed}:mode:{index}").random() < config.sample_fraction


def _next_tokens(logits: torch.Tensor, sampled: bool, config: DistillConfig, generator):
    """logits ``[rows, vocab]`` -> next token per row: greedy, or temperature with top-p 0.95
    among the 64 likeliest tokens (sorting the whole vocabulary per step halves throughput;
    this only chooses contexts, the teacher's distribution is recorded exactly)."""
    if not sampled:
        return logits.argmax(dim=-1)
    top = logits.topk(64, dim=-1)  # sorted, descending
    probs = torch.softmax(top.values / config.sample_temperature, dim=-1)  # [rows, 64]
    outside = probs.cumsum(dim=-1) - probs > 0.95  # keeps the top token
    probs[outside] = 0.0
    choice = torch.multinomial(probs, 1, generator=generator)  # [rows, 1]
    return top.indices.gather(-1, choice).squeeze(-1)


@torch.inference_mode()
def generate_batch(runner, tokenizer, eos: set[int], prompts, config: DistillConfig, index: int):
    """The target answers one batch of prompts. The logits that choose each answer token are the
    target's distribution there, so the teacher's top-k comes with generation for free."""
    encoded = {row: chat_token_ids(tokenizer, prompt) for row, prompt in enumerate(prompts)}
    sampled = _shard_sampled(config, index)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
    answers: dict[int, list[int]] = {row: [] for row in encoded}
    tops: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {row: [] for row in encoded}
    feeds = dict(encoded)
    while feeds:
        logits = runner.forward(feeds, dict.fromkeys(feeds, 1))
        rows = list(feeds)
        stacked = torch.cat([logits[row] for row in rows])  # [rows, vocab]
        top = torch.softmax(stacked, dim=-1).topk(config.teacher_top_k, dim=-1)
        chosen = _next_tokens(stacked, sampled, config, generator).tolist()
        feeds = {}
        for position, row in enumerate(rows):
            tops[row].append((top.indices[position], top.values[position]))
            answers[row].append(chosen[position])
            if chosen[position] not in eos and len(answers[row]) < config.max_new_tokens:
                feeds[row] = [chosen[position]]
        runner.remove([row for row in rows if row not in feeds])
    return [
        Sequence(
            torch.tensor(encoded[row] + answers[row]),
            len(encoded[row]) - 1,
            torch.stack([ids for ids, _ in tops[row]]).to(torch.int32),
            torch.stack([probs for _, probs in tops[row]]).to(torch.float16),
        )
        for row in encoded
    ]


def _answers_text(tokenizer, shards: list[Path]) -> list[str]:
    texts = []
    for path in shards:
        for sequence in _load_shard(path):
            answer = sequence.token_ids[sequence.start + 1 :].tolist()
            texts.append(tokenizer.decode(answer, skip_special_tokens=True))
    return texts


def plan_prompts(config: DistillConfig) -> tuple[list[list[str]], int]:
    """The batches of the first stage (passages, then chat and code) and how many of them are
    passage batches (whose answers feed the text-work stage that follows)."""
    passages = passage_prompts(config.seed) if config.text_prompts else []
    chat = chat_and_code_prompts(config.seed)
    if config.num_prompts:
        chat = chat[: config.num_prompts]
    passage_batches = _batches(passages, config.gen_batch_size)
    return passage_batches + _batches(chat, config.gen_batch_size), len(passage_batches)


def generate_data(model, tokenizer, folder: Path, config: DistillConfig) -> list[Path]:
    """Generate (or finish generating) every shard; returns their paths in order."""
    (folder / DATA_DIR).mkdir(parents=True, exist_ok=True)
    first_stage, num_passage_batches = plan_prompts(config)
    text_batches: list[list[str]] = []
    if config.text_prompts:
        # Text-work prompts need the passages: they are the stage-one shards' answers.
        passage_shards = [shard_path(folder, i) for i in range(num_passage_batches)]
        stage_one = [(i, batch) for i, batch in enumerate(first_stage[:num_passage_batches])]
        _generate_shards(model, tokenizer, folder, config, stage_one, "passages")
        passages = _answers_text(tokenizer, passage_shards)
        text_batches = _batches(text_prompts(passages, config.seed), config.gen_batch_size)
    all_batches = first_stage + text_batches
    todo = [(i, batch) for i, batch in enumerate(all_batches)]
    _generate_shards(model, tokenizer, folder, config, todo, "answers")
    return [shard_path(folder, i) for i in range(len(all_batches))]


def _generate_shards(model, tokenizer, folder, config, batches, phase: str) -> None:
    missing = [(i, batch) for i, batch in batches if not shard_path(folder, i).exists()]
    runner = ModelRunner(model)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    total = sum(len(batch) for _, batch in batches)
    progress = Progress(
        f"data ({phase})",
        total,
        "prompts",
        start=total - sum(len(batch) for _, batch in missing),
        every_s=0.0,
    )
    tokens = 0
    for index, batch in missing:
        sequences = generate_batch(runner, tokenizer, eos, batch, config, index)
        # Plain dicts of tensors and ints: shards load with weights_only=True (no pickle code).
        save_atomic([asdict(sequence) for sequence in sequences], shard_path(folder, index))
        tokens += sum(len(s.top_ids) for s in sequences)
        progress.update(len(batch), f"{tokens} answer tokens this run")


def _load_shard(path: Path) -> list[Sequence]:
    return [Sequence(**item) for item in torch.load(path, weights_only=True)]


def load_sequences(shards: list[Path]) -> list[Sequence]:
    sequences = []
    for path in shards:
        sequences.extend(_load_shard(path))
    return sequences
