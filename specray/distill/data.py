"""Distillation data: the target's own answers to the prompt set, generated in batches, and
the target's distribution (top-k) at every answer position, recorded as it generates.

Data lives in ``DIR/data/shard-NNNNN.pt``, one shard per generation batch, written atomically;
a shard on disk is never recomputed, so generation resumes where it stopped. A shard's prompts,
sampling mode and random stream depend only on the config and the shard's index, so the same
config gives the same data whether or not the run was interrupted.

Local text (when ``local_text`` is set) is a second source in the same format: text files read
in sorted order, tokenized with the target's tokenizer, cut into chunks, and the target's top-k
at every position of each chunk, teacher-forced (one forward per batch of chunks), in
``DIR/data/text-NNNNN.pt``. ``DIR/data/text-manifest.json`` records what was read (files, chunk
count, a digest of the token ids); a later session that reads other text is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specray.distill.config import MIN_TEXT_CHUNK, STDLIB, DistillConfig
from specray.distill.progress import Progress
from specray.distill.prompts import chat_and_code_prompts, passage_prompts, text_prompts
from specray.models.runner import ModelRunner, require_plain_head
from specray.prompts import prompt_token_ids

DATA_DIR = "data"
TEXT_MANIFEST = "text-manifest.json"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")  # files a local-text directory contributes
STDLIB_SUFFIXES = (".py",)  # the standard library's code and docstrings, not its data files
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed, not the library
HEAD_ROWS = 512  # positions per head matmul: [512, vocab] fp32 logits, 100 MB at 49k tokens


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
    encoded = {
        row: prompt_token_ids(tokenizer, prompt, use_chat_template=True)
        for row, prompt in enumerate(prompts)
    }
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


# ---- local text: the target teacher-forced over text on disk ----------------------------


def text_shard_path(folder: Path, index: int) -> Path:
    return folder / DATA_DIR / f"text-{index:05d}.pt"


def local_text_files(config: DistillConfig) -> list[Path]:
    """The files local text reads, in order: the entries as given; a directory's files with a
    text suffix (``.py`` only for ``"stdlib"``), recursively, sorted by relative path (hidden
    folders and files, installed packages skipped); a file named twice is read once."""
    files, seen = [], set()
    for entry, root in zip(config.local_text, config.local_text_roots(), strict=True):
        suffixes = STDLIB_SUFFIXES if entry == STDLIB else TEXT_SUFFIXES
        found = [root]
        if root.is_dir():
            found = []
            for directory, subdirs, names in os.walk(root):
                subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and d[0] != "."]
                found += [
                    Path(directory) / name
                    for name in names
                    if name.endswith(suffixes) and name[0] != "."
                ]
            found.sort(key=lambda path: path.relative_to(root).as_posix())
        for path in found:
            if path.resolve() not in seen:
                seen.add(path.resolve())
                files.append(path)
    return files


def plan_text_chunks(tokenizer, config: DistillConfig) -> tuple[list[list[int]], list[str]]:
    """Chunks of ``local_text_chunk`` token ids, file by file (a chunk's context is one
    document), at most ``local_text_chunks_per_file`` from a file (0: all), until
    ``local_text_tokens`` are taken; a piece shorter than MIN_TEXT_CHUNK (a file's tail, the
    budget's last piece) is dropped. Returns the chunks and the files used.

    Example: chunk 256, budget 600, files of 300 and 1000 tokens -> chunks of 256 and 44
    (file 1; its tail is >= 8 tokens, so kept), then 256 and 44 (file 2: the second chunk cut
    to the budget's last 44 tokens): 600 tokens in 4 chunks."""
    chunks, used, budget = [], [], config.local_text_tokens
    for path in local_text_files(config):
        if budget < MIN_TEXT_CHUNK:
            break
        text = path.read_bytes().decode("utf-8", errors="replace")  # the same bytes -> same ids
        ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
        before, size = len(chunks), config.local_text_chunk
        if config.local_text_chunks_per_file:
            ids = ids[: config.local_text_chunks_per_file * size]
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size][:budget]
            if len(chunk) < MIN_TEXT_CHUNK:
                break
            chunks.append(chunk)
            budget -= len(chunk)
        if len(chunks) > before:
            used.append(str(path))
    return chunks, used


@torch.inference_mode()
def teacher_force_batch(model, chunks: list[list[int]], top_k: int) -> list[Sequence]:
    """The target's top-k at every position of each chunk that has a next token: one forward of
    the right-padded batch (attention is causal, so padding after a row's tokens changes
    nothing before them), then the head over the real positions in slices of HEAD_ROWS."""
    width = max(len(chunk) for chunk in chunks)
    input_ids = torch.zeros(len(chunks), width, dtype=torch.int64)  # [batch, width]
    mask = torch.zeros(len(chunks), width, dtype=torch.int64)  # [batch, width]
    for row, chunk in enumerate(chunks):
        input_ids[row, : len(chunk)] = torch.tensor(chunk)
        mask[row, : len(chunk)] = 1
    decoder = model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [b, w, H]
    # Row r's positions 0 .. len - 2 predict its tokens 1 .. len - 1.
    rows = torch.cat([hidden[row, : len(chunk) - 1] for row, chunk in enumerate(chunks)])
    head = model.get_output_embeddings()
    ids, probs = [], []
    for start in range(0, len(rows), HEAD_ROWS):
        logits = head(rows[start : start + HEAD_ROWS]).float()  # [<= HEAD_ROWS, vocab]
        top = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids.append(top.indices.to(torch.int32))  # [<= HEAD_ROWS, top_k]
        probs.append(top.values.to(torch.float16))
    sizes = [len(chunk) - 1 for chunk in chunks]
    return [
        # Clones: a view would save the whole batch's storage with each sequence.
        Sequence(torch.tensor(chunk), 0, chunk_ids.clone(), chunk_probs.clone())
        for chunk, chunk_ids, chunk_probs in zip(
            chunks, torch.cat(ids).split(sizes), torch.cat(probs).split(sizes), strict=True
        )
    ]


def _check_manifest(folder: Path, manifest: dict) -> None:
    path = folder / DATA_DIR / TEXT_MANIFEST
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != manifest:
            raise ValueError(
                f"local_text reads other text than when {str(folder)!r} began ({saved['chunks']} "
                f"chunks, {saved['tokens']} tokens then; {manifest['chunks']} chunks, "
                f"{manifest['tokens']} tokens now): the files changed (use another --out)"
            )
        return
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(staging, path)


def teacher_force_local_text(model, tokenizer, folder: Path, config: DistillConfig) -> list[Path]:
    """Write (or finish writing) the local-text shards, one per ``gen_batch_size`` chunks;
    returns their paths in order ([] when local text is off)."""
    if not config.local_text:
        return []
    # The head is applied to the decoder's output directly: exact only where the model's
    # logits are lm_head(hidden) (no soft-capping or scaling), as in ModelRunner.
    require_plain_head(model, "local_text")
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and config.local_text_chunk > max_positions:
        raise ValueError(
            f"local_text_chunk must be <= the target's {max_positions} positions, got "
            f"{config.local_text_chunk}"
        )
    (folder / DATA_DIR).mkdir(parents=True, exist_ok=True)
    chunks, files = plan_text_chunks(tokenizer, config)
    if not chunks:
        raise ValueError(
            f"local_text {list(config.local_text)!r} holds no text of {MIN_TEXT_CHUNK} tokens "
            f"or more (a directory contributes its {' '.join(TEXT_SUFFIXES)} files)"
        )
    digest = hashlib.sha256(json.dumps(chunks).encode()).hexdigest()
    tokens = sum(len(chunk) for chunk in chunks)
    _check_manifest(
        folder, {"chunks": len(chunks), "tokens": tokens, "sha256": digest, "files": files}
    )
    size = config.gen_batch_size
    batches = [chunks[start : start + size] for start in range(0, len(chunks), size)]
    missing = [
        (i, batch) for i, batch in enumerate(batches) if not text_shard_path(folder, i).exists()
    ]
    done = len(chunks) - sum(len(batch) for _, batch in missing)
    progress = Progress("data (local text)", len(chunks), "chunks", start=done, every_s=0.0)
    written = 0
    for index, batch in missing:
        sequences = teacher_force_batch(model, batch, config.teacher_top_k)
        save_atomic([asdict(sequence) for sequence in sequences], text_shard_path(folder, index))
        written += sum(len(chunk) for chunk in batch)
        progress.update(len(batch), f"{written} text tokens this run")
    return [text_shard_path(folder, i) for i in range(len(batches))]
