"""The verification data plane alone: one sampled round's rules on random data, in one thread.

A round's rules are what the target does between its forward and its commit: take the checked
blocks (as the inbox hands them over), draw the round's keyed uniforms, run the stochastic rule
(``verify_blocks``) to committed tokens. The target rows ``[batch, k + 1, vocab]`` are softmax
of random logits (temperature 1); the draft's q is a noisy copy, encoded row by row as a draft
worker encodes it, its tokens sampled from the decoded q (honest blocks, partial acceptance).
Figures, each the best of ``repeats``:

  - ``ms_per_round``: the rules above, from the target rows and the checked blocks (q as they
    carry it: sparse for ``top<M>``) to committed tokens, uniforms included;
  - ``ms_check_blocks``: ``check_block`` on the round's protobuf blocks (decode and validate q;
    done as each block arrives, beside the round rather than inside it);
  - ``ms_verify_batch``: the path before sparse rules (dense q padded to ``[batch, k, vocab]``,
    per-request draws, ``verify_batch``), which must commit the same tokens;
  - ``ms_reference``: one float32 softmax over ``[batch, vocab]``, the scale of one pass;
  - ``ms_pipeline``: the batched logits pass (``BatchLogitsPipeline``, how the target makes its
    rows) over the round's raw logits ``[batch, k + 1, vocab]`` at temperature 0.8 and top_k
    50; ``ms_pipeline_per_request``: ``LogitsPipeline.probs`` one request at a time, the same
    rows; ``ms_softmax_rows``: one float32 softmax over those ``[batch * (k + 1), vocab]``
    rows, the scale of the pipeline's goal.

``dense`` holds ``ms_per_round``, ``ms_check_blocks`` and ``ms_verify_batch`` for fp32 q.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specray.rpc.messages import block_to_pb, check_block
from specray.sampling import (
    DraftProbsEncoding,
    KeyedRandom,
    LogitsPipeline,
    SamplingParams,
    VerifyUniforms,
    decode_draft_probs,
    encode_draft_probs,
    stack_rows,
    verify_batch,
)
from specray.sampling.batch_pipeline import BatchLogitsPipeline
from specray.sampling.encoding import dense_draft_probs
from specray.sampling.rng import seed_tensor
from specray.sampling.rows import Workspace
from specray.sampling.verify_sparse import verify_blocks


@dataclass(frozen=True)
class VerifyBenchConfig:
    vocab: int = 128256  # Llama 3's vocabulary
    batch: int = 16  # requests per round
    k: int = 4  # draft tokens per request
    encoding: str = "top64"  # q on the wire (the dense figures use fp32)
    threads: int = 1  # torch intra-op threads
    repeats: int = 15  # best of (the machines are shared: a minimum needs several tries)
    seed: int = 0  # random data

    def __post_init__(self) -> None:
        for name in ("vocab", "batch", "k", "threads", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {self.vocab}")
        DraftProbsEncoding.parse(self.encoding)  # raises naming the value


def _best_ms(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return round(1e3 * best, 4)


def _blocks(config: VerifyBenchConfig, encoding: str, logits: torch.Tensor, generator):
    """The draft side: per request a protobuf block of k tokens sampled from its q."""
    parsed = DraftProbsEncoding.parse(encoding)
    noise = torch.randn(config.batch, config.k, config.vocab, generator=generator)
    messages = []
    for b in range(config.batch):
        draft_probs = torch.softmax(logits[b, : config.k] + noise[b], dim=-1)  # [k, vocab]
        rows = [encode_draft_probs(draft_probs[j : j + 1], parsed) for j in range(config.k)]
        decoded = torch.cat([decode_draft_probs(row) for row in rows])  # [k, vocab]
        token_ids = torch.multinomial(decoded, 1, generator=generator)[:, 0].tolist()
        messages.append(block_to_pb(f"r{b}", 1, 0, token_ids, stack_rows(rows)))
    return messages


class _Round:
    """One round's inputs and the three ways to verify it."""

    def __init__(self, config: VerifyBenchConfig, target_rows, messages):
        self.config = config
        self.target_rows = target_rows  # request b: [k + 1, vocab] float32
        self.messages = messages
        self.checked = [check_block(message, config.vocab) for message in messages]
        self.randoms = [KeyedRandom(1000 + b) for b in range(config.batch)]
        self.num_draft = torch.full((config.batch,), config.k, dtype=torch.int64)  # [batch]
        self.workspace = Workspace()  # kept from round to round, as the target keeps it
        self.draft_ids = torch.tensor([block.token_ids for block in self.checked])  # [batch, k]

    def uniforms(self) -> VerifyUniforms:
        seeds = seed_tensor([random.seed for random in self.randoms])
        first = torch.zeros(self.config.batch, dtype=torch.int64)  # output positions 0 .. k
        return VerifyUniforms.draw_round(seeds, first, self.num_draft, self.config.k)

    def rules(self):
        draft_probs = [block.draft_probs for block in self.checked]
        return verify_blocks(
            self.draft_ids,
            self.num_draft,
            draft_probs,
            self.target_rows,
            self.uniforms(),
            validate=False,
            workspace=self.workspace,
        )

    def check_blocks(self):
        return [check_block(message, self.config.vocab) for message in self.messages]

    def verify_batch(self):
        """The path before sparse rules (TargetCore._verify_sampled as it was)."""
        batch, k, vocab = self.config.batch, self.config.k, self.config.vocab
        padded_target = torch.zeros(batch, k + 1, vocab)
        padded_draft = torch.zeros(batch, k, vocab)
        accept = torch.zeros(batch, k, dtype=torch.float64)
        residual = torch.zeros(batch, k, dtype=torch.float64)
        bonus = torch.zeros(batch, dtype=torch.float64)
        for b, block in enumerate(self.checked):
            padded_target[b] = self.target_rows[b]
            padded_draft[b] = dense_draft_probs(block.draft_probs)
            uniforms = VerifyUniforms.draw(self.randoms[b], k, 0)
            accept[b], residual[b], bonus[b] = (
                uniforms.accept[0],
                uniforms.residual[0],
                uniforms.bonus[0],
            )
        uniforms = VerifyUniforms(accept, residual, bonus)
        return verify_batch(self.draft_ids, self.num_draft, padded_draft, padded_target, uniforms)


def _encoding_figures(config: VerifyBenchConfig, round_: _Round) -> dict:
    fast, reference = round_.rules(), round_.verify_batch()
    if not torch.equal(fast.token_ids, reference.token_ids):
        raise AssertionError("verify_blocks and verify_batch committed different tokens")
    accepted = fast.num_accepted.double().mean().item()
    return {
        "ms_per_round": _best_ms(round_.rules, config.repeats),
        "ms_check_blocks": _best_ms(round_.check_blocks, config.repeats),
        "ms_verify_batch": _best_ms(round_.verify_batch, min(config.repeats, 2)),
        "mean_accepted": round(accepted, 3),
    }


def run_verify_bench(config: VerifyBenchConfig) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(config)
    finally:
        torch.set_num_threads(threads)


def _run(config: VerifyBenchConfig) -> dict:
    generator = torch.Generator().manual_seed(config.seed)
    batch, k, vocab = config.batch, config.k, config.vocab
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=generator)  # [batch, k+1, vocab]
    # Temperature 1, as the pipeline hands rows over: consecutive rows of one tensor.
    target_rows = list(torch.softmax(logits, dim=-1).view(batch * (k + 1), vocab).split(k + 1))
    rounds = {
        encoding: _Round(config, target_rows, _blocks(config, encoding, logits, generator))
        for encoding in (config.encoding, "fp32")
    }
    figures = {name: _encoding_figures(config, round_) for name, round_ in rounds.items()}
    last_rows = logits[:, -1].contiguous()  # [batch, vocab]
    # The softmax references write into buffers, as the rules and the pipeline do (a fresh
    # output's page faults would cost more than the softmax on a CPU).
    last_out, flat_out = torch.empty_like(last_rows), torch.empty(batch * (k + 1), vocab)
    pipeline = LogitsPipeline(SamplingParams(temperature=0.8, top_k=50), vocab)
    drafted = rounds[config.encoding].draft_ids.tolist()  # row j's history: the drafts before
    flat = logits.reshape(batch * (k + 1), vocab)  # [batch * (k+1), vocab]: a forward's rows
    per_request = list(flat.split(k + 1))  # consecutive views, as the runner returns them
    batched = BatchLogitsPipeline()

    def batched_rows():
        return batched([pipeline] * batch, per_request, [()] * batch, drafted)

    def pipeline_rows():
        return [pipeline.probs(logits[b], (), drafted[b]) for b in range(batch)]

    return {
        **figures[config.encoding],
        "ms_reference": _best_ms(
            lambda: torch.softmax(last_rows, dim=-1, out=last_out), config.repeats
        ),
        "ms_pipeline": _best_ms(batched_rows, config.repeats),
        "ms_pipeline_per_request": _best_ms(pipeline_rows, config.repeats),
        "ms_softmax_rows": _best_ms(
            lambda: torch.softmax(flat, dim=-1, out=flat_out), config.repeats
        ),
        "dense": figures["fp32"],
        "config": asdict(config),
    }


def format_verify(report: dict) -> str:
    config = report["config"]
    lines = [
        f"verification rules: vocab {config['vocab']}, batch {config['batch']}, "
        f"k {config['k']}, {config['threads']} thread(s), best of {config['repeats']}",
        f"  reference (float32 softmax over [batch, vocab]): {report['ms_reference']:.3f} ms",
        f"  logits pipeline, batched: {report['ms_pipeline']:.3f} ms (per request "
        f"{report['ms_pipeline_per_request']:.3f} ms; a softmax over the same rows "
        f"{report['ms_softmax_rows']:.3f} ms)",
    ]
    for name, figures in ((config["encoding"], report), ("fp32", report["dense"])):
        lines.append(
            f"  {name:>6}: rules {figures['ms_per_round']:.3f} ms per round (check_block "
            f"{figures['ms_check_blocks']:.3f} ms on arrival), before: verify_batch "
            f"{figures['ms_verify_batch']:.3f} ms; mean accepted {figures['mean_accepted']}"
        )
    return "\n".join(lines)
