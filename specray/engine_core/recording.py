"""What the coordinator records from its workers' replies: totals since the last reset (for
benchmarks and reports), Prometheus metrics, and the cost samples the block-length rules read.

Functions of the objects they update, which the coordinator passes in each time: it replaces
its stats on ``reset_stats`` (and a simulation its metrics), so nothing here keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.engine_core.costs import Costs
from specray.engine_core.metrics import CoordinatorMetrics
from specray.engine_core.policy import AcceptanceEstimator, DraftCost, VerifyCost
from specray.engine_core.request import Request
from specray.protocol import PrefillReport, ProposeReport, RoundReport, VerifyResult


@dataclass
class CoordinatorStats:
    """Totals since the last :meth:`Coordinator.reset_stats` (for benchmarks and reports)."""

    started_s: float = 0.0
    target_compute_s: float = 0.0
    target_wait_s: float = 0.0
    rounds: int = 0
    draft_bytes: int = 0
    committed_tokens: int = 0
    reused_tokens: int = 0
    ahead_tokens: int = 0  # drafted past a block before its verdict (kept or not)
    draft_failures: int = 0
    dropped_blocks: int = 0
    target_prefill_s: float = 0.0  # prompt processing of requests new to the target
    target_forward_s: float = 0.0  # verification forwards alone (busy minus rules, prefill)
    target_prefill_tokens: int = 0
    fused_prefill_tokens: int = 0  # of those, cached by a round's verification forward
    prefill_chunks: int = 0  # request-rounds that only prefilled part of a prompt (chunked)
    draft_prefill_s: float = 0.0  # the same on draft workers (a separate call)
    draft_prefill_tokens: int = 0
    rounds_ahead: int = 0  # rounds issued before the verdict of the round before (async)
    rows_ended: int = 0  # of their rows, requests that the round before had ended
    joined_ahead: int = 0  # requests submitted into a round scheduled ahead before it started
    # Requests' verdicts by the block length verified (index k; 0: no draft): the mix of k
    # that a bound over the rounds' costs averages over (bench/serving.py).
    verdicts_by_k: list[int] = field(default_factory=list)


def record_round(
    stats: CoordinatorStats,
    metrics: CoordinatorMetrics,
    costs: Costs,
    reply: RoundReport,
    *,
    verify_prior: VerifyCost,
    now: float,
) -> None:
    """A target round: its busy and waiting time, and a verification cost sample."""
    if all(result.ended for result in reply.results):
        return  # scheduled ahead for requests the round before ended: nothing ran
    compute_s, wait_s = reply.compute_s, reply.wait_s
    stats.rounds += 1
    stats.target_compute_s += compute_s
    stats.target_wait_s += wait_s
    metrics.labels(metrics.target_busy_seconds).inc(compute_s)
    metrics.labels(metrics.pipeline_bubble_seconds).inc(wait_s)
    metrics.labels(metrics.verify_latency).observe(compute_s)
    verified = [r for r in reply.results if not (r.prefilling or r.ended)]
    # Prefill of requests new to the target is busy time, but not the cost of a round.
    prefill_s = reply.prefill_s
    stats.target_forward_s += reply.forward_s
    if prefill_s > 0:
        stats.target_prefill_s += prefill_s
    stats.fused_prefill_tokens += reply.fused_prefill_tokens
    # (a round of prompt chunks only verifies nothing; one that prefilled in its forward
    # measured more than a verification)
    if verified and not reply.fused_prefill_tokens:
        widest = max(r.num_draft_tokens + 1 for r in verified)  # tokens fed: pending + drafts
        verify_s = compute_s - prefill_s
        costs.add_verify(len(verified), widest, verify_s, verify_prior)
    if reply.num_tokens:
        metrics.labels(metrics.iteration_tokens).observe(reply.num_tokens)
    if reply.shared_tokens:
        metrics.labels(metrics.shared_tokens).inc(reply.shared_tokens)
    metrics.labels(metrics.kv_cache_usage).set(reply.kv_cache_usage)
    elapsed = now - stats.started_s
    if elapsed > 0:
        busy = min(stats.target_compute_s / elapsed, 1.0)
        metrics.labels(metrics.target_busy_fraction).set(busy)


def record_proposal(
    stats: CoordinatorStats,
    metrics: CoordinatorMetrics,
    costs: Costs,
    reply: ProposeReport,
    *,
    draft_prior: DraftCost,
) -> None:
    """A draft worker's propose call: bytes sent, drafts reused, and a draft-step sample."""
    stats.draft_bytes += reply.bytes
    stats.reused_tokens += reply.reused_tokens
    stats.ahead_tokens += reply.ahead_tokens
    metrics.labels(metrics.wire_bytes).inc(reply.bytes)
    metrics.labels(metrics.draft_latency).observe(reply.draft_s)
    if reply.steps > 0 and reply.num_requests > 0:
        costs.add_draft(reply.num_requests, reply.draft_s / reply.steps, draft_prior)


def record_draft_prefill(
    stats: CoordinatorStats, report: PrefillReport, requests: list[Request]
) -> None:
    """A draft worker's prefill call that took on ``requests``."""
    stats.draft_prefill_s += report.draft_s
    stats.draft_prefill_tokens += sum(len(r.state.prompt_token_ids) - 1 for r in requests)


def record_draft_failure(stats: CoordinatorStats, metrics: CoordinatorMetrics) -> None:
    """A draft worker failed a call and is being replaced."""
    stats.draft_failures += 1
    metrics.labels(metrics.draft_worker_restarts).inc()


def record_end(metrics: CoordinatorMetrics, request: Request, now: float) -> None:
    """A request that finished with an output: its latency, the time of each phase (queue,
    prefill up to the first token, decode) and its token counts."""
    metrics.labels(metrics.e2e_request_latency).observe(now - request.arrival_s)
    admitted = request.admitted_s if request.admitted_s is not None else request.arrival_s
    first = request.first_token_s if request.first_token_s is not None else now
    metrics.labels(metrics.request_queue_time).observe(admitted - request.arrival_s)
    metrics.labels(metrics.request_prefill_time).observe(first - admitted)
    metrics.labels(metrics.request_decode_time).observe(now - first)
    state = request.state
    metrics.labels(metrics.request_prompt_tokens).observe(len(state.prompt_token_ids))
    metrics.labels(metrics.request_generation_tokens).observe(len(state.output_token_ids))


def record_emission(
    metrics: CoordinatorMetrics, request: Request, new: list[int], now: float
) -> None:
    """Tokens a round committed for ``request`` at ``now``: time to first token, and the gap
    since its last chunk (spread over the chunk's tokens: the pace a client sees)."""
    metrics.labels(metrics.generation_tokens).inc(len(new))
    if request.first_token_s is None:
        request.first_token_s = now
        metrics.labels(metrics.time_to_first_token).observe(now - request.arrival_s)
    elif new:
        request.chunk_gaps_s.append(now - request.last_emit_s)
        gap = (now - request.last_emit_s) / len(new)  # the chunk's pace, per token
        inter_token = metrics.labels(metrics.inter_token_latency)
        for _ in new:
            inter_token.observe(gap)
    request.last_emit_s = now


def record_verdict(
    stats: CoordinatorStats,
    metrics: CoordinatorMetrics,
    request: Request,
    result: VerifyResult,
    group_acceptance: AcceptanceEstimator,
) -> None:
    """A request's verdict: its acceptance (its own estimate and the group's), a dropped
    block's reason."""
    num_draft, num_accepted = result.num_draft_tokens, result.num_accepted
    request.state.metrics.record(num_draft, num_accepted)
    by_k = stats.verdicts_by_k
    if num_draft >= len(by_k):
        by_k.extend([0] * (num_draft + 1 - len(by_k)))
    by_k[num_draft] += 1
    metrics.record_round(num_draft, num_accepted)
    if num_draft:
        request.estimator.update(num_draft, num_accepted)
        group_acceptance.update(num_draft, num_accepted)
    if result.dropped is not None:
        stats.dropped_blocks += 1
        reason = result.dropped.reason.value
        metrics.labels(metrics.dropped_blocks, reason=reason).inc()
