"""What generation returns: vLLM-shaped outputs with per-request speculative metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from specray.sampling.logprobs import TokenLogprob


@dataclass
class SpecDecodeMetrics:
    """Per-request counters, named as vLLM's speculative-decoding metrics."""

    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens proposed and verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [k] accepted at position j
    num_target_steps: int = 0  # target forwards (verifications and target-only steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification round that had drafts: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_target_steps += 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            missing = num_draft_tokens - len(self.accepted_per_position)
            self.accepted_per_position.extend([0] * missing)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecDecodeMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_target_steps += other.num_target_steps
        size = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (size - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (size - len(other.accepted_per_position))
        self.accepted_per_position = [a + b for a, b in zip(mine, theirs, strict=True)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_acceptance_length"] = self.mean_acceptance_length
        return out


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, a stop token included when one ended the request
    text: str  # decoded generated text (special tokens skipped); "" without a tokenizer
    finish_reason: str  # "stop" (end-of-sequence or stop token) | "length" (max_tokens)
    seed: int  # the seed the request ran with (chosen by the engine when none was given)
    metrics: SpecDecodeMetrics
    # Served requests (the coordinator) also carry their latency.
    time_to_first_token_s: float | None = None
    latency_s: float | None = None  # arrival to the last token
    chunk_gaps_s: list[float] = field(default_factory=list)  # between streamed chunks
    # params.logprobs: one per token of token_ids; params.prompt_logprobs: one per prompt token,
    # None for the first (vLLM's shapes); None when not asked.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "metrics": self.metrics.to_dict(),
        } | (
            {"time_to_first_token_s": self.time_to_first_token_s, "latency_s": self.latency_s}
            if self.latency_s is not None
            else {}
        )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class ServedSummary:
    """Totals over finished served outputs (benchmarks and simulations report these)."""

    metrics: SpecDecodeMetrics  # merged over the outputs
    tokens: int
    chunk_gaps_s: list[float]  # every gap between streamed chunks
    tpot_s: list[float]  # per request: (latency - time to first token) / (tokens - 1)

    @staticmethod
    def of(outputs: Sequence[RequestOutput]) -> ServedSummary:
        metrics = SpecDecodeMetrics()
        for output in outputs:
            metrics.merge(output.metrics)
        return ServedSummary(
            metrics=metrics,
            tokens=sum(len(output.token_ids) for output in outputs),
            chunk_gaps_s=[gap for output in outputs for gap in output.chunk_gaps_s],
            tpot_s=[
                (o.latency_s - o.time_to_first_token_s) / (len(o.token_ids) - 1)
                for o in outputs
                if len(o.token_ids) > 1
            ],
        )
