"""Training the student against the target's distribution, resumable and reproducible.

Loss at every answer position: cross-entropy against the target's top-k probabilities (a KL up
to a constant; top-k tokens outside the head are dropped) plus cross-entropy against the
target's likeliest token. Step ``s`` always trains on the same sequences (drawn from
``(seed, s)``), and a checkpoint holds the weights, the optimizer and the step, so a run resumed
from a checkpoint ends with the same weights as an uninterrupted one.

With local text, ``round(local_text_fraction * batch_sequences)`` of each batch's sequences are
local-text chunks (every position is a target position there), the rest answers; held-out
agreement, which picks the kept checkpoint, is measured on answers only (what the draft serves).

A feature-conditioned student (``feature_conditioned``) is trained on features computed on the
fly: one teacher-forced forward of the frozen target over the batch gives h at every position;
pass 0 reads the target's features (position i reads h_{i-1}, zeros at 0: what a round's first
draft token reads), and each of ``chained_passes`` more passes reads the previous pass's own
outputs, detached (what later draft tokens read). The loss is the mean over passes; agreement
is pass 0's.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import torch

from specray.distill.config import DistillConfig
from specray.distill.data import Sequence, save_atomic
from specray.distill.progress import Progress
from specray.distill.student import trainable_state

CHECKPOINT_FILE = "checkpoint.pt"
VALIDATION_EVERY_NTH = 50  # every 50th sequence is held out of training (agreement is measured)


def head_vocabulary(sequences: list[Sequence], size: int, vocab_size: int, eos: set[int]):
    """The ``size`` tokens the target most often puts first or chooses (eos always in)."""
    if size == 0 or size >= vocab_size:
        return None
    counts: Counter[int] = Counter()
    for sequence in sequences:
        counts.update(sequence.top_ids[:, 0].tolist())
        counts.update(sequence.token_ids[sequence.start + 1 :].tolist())
    chosen = [token for token in sorted(eos) if token < vocab_size]
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    for token in range(vocab_size):  # pad with low ids when the data has fewer tokens
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    return torch.tensor(sorted(chosen))


def split(sequences: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    train = [s for index, s in enumerate(sequences) if index % VALIDATION_EVERY_NTH != 1]
    held = [s for index, s in enumerate(sequences) if index % VALIDATION_EVERY_NTH == 1]
    return train, held


def _batch(sequences: list[Sequence], max_len: int, position_of: torch.Tensor):
    """Right-padded inputs and per-position targets for a list of sequences.

    Returns input_ids [b, T], mask [b, T], where [n, 2] (row, column of each answer position),
    top_ids [n, k] (indices into the head, -1 outside), top_probs [n, k], first [n] (head index
    of the target's likeliest token, -1 outside)."""
    width = min(max(len(s.token_ids) for s in sequences), max_len)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros(len(sequences), width, dtype=torch.int64)
    where, ids, probs = [], [], []
    for row, sequence in enumerate(sequences):
        tokens = sequence.token_ids[:width]
        input_ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
        stop = min(len(sequence.top_ids), width - 1 - sequence.start)  # positions that fit
        if stop <= 0:
            continue
        columns = torch.arange(sequence.start, sequence.start + stop)
        where.append(torch.stack([torch.full_like(columns, row), columns], dim=1))
        ids.append(sequence.top_ids[:stop].long())
        probs.append(sequence.top_probs[:stop].float())
    top_ids = position_of[torch.cat(ids)]  # [n, k] head index or -1
    return input_ids, mask, torch.cat(where), top_ids, torch.cat(probs)


def _shifted(features: torch.Tensor) -> torch.Tensor:
    """``[b, T, H]`` -> ``[b, T, H]`` whose row t is row t - 1 (zeros at t = 0)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def student_hidden(student, input_ids, mask, config: DistillConfig, target=None):
    """The student's final-norm hidden states ``[b, T, H]``, one per pass: one pass for a plain
    student; for a feature-conditioned one (``target`` given), pass 0 on the target's features
    and ``config.chained_passes`` passes on the previous pass's outputs."""
    if target is None:
        decoder = student.get_decoder()
        return [decoder(input_ids=input_ids, attention_mask=mask).last_hidden_state]
    with torch.no_grad():  # the target is frozen: its features are inputs, not parameters
        features = target.get_decoder()(input_ids=input_ids, attention_mask=mask)
        features = features.last_hidden_state.float()  # [b, T, H]: h_t
    passes = []
    for _ in range(1 + config.chained_passes):
        hidden = student(input_ids, _shifted(features), attention_mask=mask)  # [b, T, H]
        passes.append(hidden)
        features = hidden.detach()  # the next pass reads g_{t-1}, as chained drafting does
    return passes


def losses(student, batch, config: DistillConfig, target=None):
    """(loss, agreement): agreement = share of positions where the student's top token is the
    target's (greedy acceptance on target contexts; pass 0 for a feature-conditioned one)."""
    input_ids, mask, where, top_ids, top_probs = batch
    head = student.get_output_embeddings()
    inside = top_ids >= 0
    first = top_ids[:, 0]
    total, agreement = 0.0, None
    passes = student_hidden(student, input_ids, mask, config, target)
    for hidden in passes:
        rows = hidden[where[:, 0], where[:, 1]]  # [n, H]
        log_q = torch.log_softmax(head.reduced(rows), dim=-1)  # [n, head_vocab]
        gathered = log_q.gather(1, top_ids.clamp(min=0))  # [n, k]
        soft = -(top_probs * gathered * inside).sum(dim=1).mean()
        hard_terms = -log_q.gather(1, first.clamp(min=0)[:, None]).squeeze(1)
        hard = (hard_terms * (first >= 0)).sum() / (first >= 0).sum().clamp(min=1)
        total = total + config.soft_weight * soft + config.hard_weight * hard
        if agreement is None:
            agreement = (log_q.argmax(dim=1) == first).float().mean()
    return total / len(passes), float(agreement)


def draw_batch(config: DistillConfig, step: int, num_answers: int, num_text: int):
    """Step ``step``'s batch as (answer indices, local-text indices), drawn from (seed, step)
    only. Without local text the draw is the one made before local text existed."""
    rng = random.Random(f"{config.seed}:batch:{step}")
    text_size = min(round(config.local_text_fraction * config.batch_sequences), num_text)
    size = min(config.batch_sequences - text_size, num_answers)
    answers = rng.sample(range(num_answers), size)
    return answers, rng.sample(range(num_text), text_size) if num_text else []


def _learning_rate(config: DistillConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(config.train_steps - config.warmup_steps, 1)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(
    student, sequences: list[Sequence], config: DistillConfig, position_of, target=None
) -> float:
    """Greedy agreement with the target over held-out sequences."""
    agree, total = 0.0, 0
    for start in range(0, len(sequences), config.batch_sequences):
        chunk = sequences[start : start + config.batch_sequences]
        batch = _batch(chunk, config.max_seq_len, position_of)
        _, agreement = losses(student, batch, config, target)
        agree += agreement * len(batch[2])
        total += len(batch[2])
    return agree / max(total, 1)


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def train(
    student,
    sequences: list[Sequence],
    folder: Path,
    config: DistillConfig,
    log,
    stop_at: int | None = None,
    text_sequences: list[Sequence] | None = None,
    target=None,
) -> dict:
    """Train to ``config.train_steps`` (resuming from ``folder``'s checkpoint), or only to step
    ``stop_at`` (a time-boxed session: it checkpoints there); returns a summary.
    ``text_sequences`` (local text) are mixed into every batch, never held out. ``target`` (the
    frozen target model) is needed by a feature-conditioned student: its features."""
    train_set, held_out = split(sequences)
    text_sequences = text_sequences or []
    if not train_set or not held_out:
        raise ValueError(
            f"distillation needs at least {VALIDATION_EVERY_NTH} sequences of data, got "
            f"{len(sequences)} (raise num_prompts)"
        )
    vocab_ids = student.get_output_embeddings().vocab_ids
    position_of = torch.full((student.get_output_embeddings().out_features,), -1)
    position_of[vocab_ids] = torch.arange(len(vocab_ids))
    parameters = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=0.0)
    checkpoint_path = folder / CHECKPOINT_FILE
    step, history = 0, []
    best = None  # (held-out agreement, step, weights): the draft keeps the best checkpoint
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        missing, unexpected = student.load_state_dict(checkpoint["student"], strict=False)
        missing = [name for name in missing if "embed_tokens" not in name]
        if missing or unexpected:
            raise ValueError(
                f"{checkpoint_path} holds another student (num_layers, head_vocab or "
                "feature_conditioned changed): use another --out to start a new run"
            )
        optimizer.load_state_dict(checkpoint["optimizer"])
        step, history, best = checkpoint["step"], checkpoint["history"], checkpoint["best"]
        log(f"resumed from {checkpoint_path} at step {step}")
    if step == 0:
        agreement = evaluate(student.eval(), held_out, config, position_of, target)
        history.append({"step": 0, "held_out_agreement": round(agreement, 4)})
        best = (agreement, 0, _copy(trainable_state(student)))
        log(f"step 0: held-out agreement {agreement:.4f}")
    progress = Progress("train", config.train_steps, "steps", start=step, every_s=30.0)
    student.train()
    running = []
    last = config.train_steps if stop_at is None else min(stop_at, config.train_steps)
    while step < last:
        answers, texts = draw_batch(config, step, len(train_set), len(text_sequences))
        chunk = [train_set[i] for i in answers] + [text_sequences[i] for i in texts]
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, step)
        batch = _batch(chunk, config.max_seq_len, position_of)
        loss, agreement = losses(student, batch, config, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        running.append((loss.item(), agreement))
        progress.update(1, f"loss {loss.item():.3f}, batch agreement {agreement:.3f}")
        if step % config.checkpoint_every == 0 or step == last:
            held = evaluate(student.eval(), held_out, config, position_of, target)
            student.train()
            mean_loss = sum(value for value, _ in running) / len(running)
            history.append(
                {
                    "step": step,
                    "train_loss": round(mean_loss, 4),
                    "held_out_agreement": round(held, 4),
                }
            )
            running = []
            log(f"step {step}: train loss {mean_loss:.4f}, held-out agreement {held:.4f}")
            if held > best[0]:
                best = (held, step, _copy(trainable_state(student)))
            save_atomic(
                {
                    "student": trainable_state(student),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "history": history,
                    "best": best,
                },
                checkpoint_path,
            )
    student.load_state_dict(best[2], strict=False)  # the best held-out checkpoint
    student.eval()
    log(f"keeping step {best[1]} (held-out agreement {best[0]:.4f})")
    return {
        "best_step": best[1],
        "best_held_out_agreement": round(best[0], 4),
        "steps": step,
        "train_sequences": len(train_set),
        "local_text_sequences": len(text_sequences),
        "held_out_sequences": len(held_out),
        "history": history,
    }
