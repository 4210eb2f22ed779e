"""Run the real coordinator against simulated workers on virtual time, for each sweep point.

Each point runs twice on fresh loops, workers and coordinators: as configured, and target-only
(``num_speculative_tokens = 0``, no draft workers) for the same workload, so every row carries
its own baseline and speedup. Runs are deterministic: the acceptance draws come from one
``random.Random(workload.seed)`` per run and virtual time orders every event.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from specray.engine_core.coordinator import Coordinator
from specray.errors import OverloadedError
from specray.outputs import RequestOutput, ServedSummary, percentile
from specray.sampling import SamplingParams
from specray.sim.clock import run_virtual
from specray.sim.model import SWEEP_FIELDS, SimConfig, coordinator_config
from specray.sim.workers import SimDraftBackend, SimInbox, SimTargetBackend

SIM_VOCAB_SIZE = 64
RETRY_AFTER_S = 0.01  # a client refused at admission (queue full) retries after this


class _NullMetric:
    """A Prometheus child that records nothing."""

    def inc(self, amount: float = 1.0) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


class _NullMetrics:
    """Stands in for the coordinator's CoordinatorMetrics: the simulator reports from the
    outputs and CoordinatorStats, and Prometheus bookkeeping (a labels() lookup per token)
    would be most of a large simulation's run time."""

    _child = _NullMetric()

    def __getattr__(self, name: str):
        return None  # the metric objects: only ever passed back to labels()

    def labels(self, metric, **extra) -> _NullMetric:
        return self._child

    def record_round(self, num_draft_tokens: int, num_accepted: int) -> None:
        pass

    def render(self) -> bytes:
        return b""


async def _run_point(config: SimConfig, *, speculative: bool) -> dict[str, Any]:
    workload, latency = config.workload, config.latency
    inbox = SimInbox()
    target = SimTargetBackend(latency, config.acceptance, inbox, random.Random(workload.seed))
    drafts = SimDraftBackend(config.num_draft_workers, latency, inbox) if speculative else None
    # Like a deployment that calibrated its workers (DistributedBackend.calibrate), the
    # coordinator starts from the true costs unless the config gives other priors.
    overrides = {
        "max_queue": workload.concurrency,
        "verify_prior": latency.verify,
        "draft_prior": latency.draft_step,
        **config.coordinator,
    }
    if not speculative:
        overrides["num_speculative_tokens"] = 0
    coordinator = Coordinator(
        target,
        drafts,
        coordinator_config(overrides),
        vocab_size=SIM_VOCAB_SIZE,
        eos_token_ids=frozenset(),
    )
    coordinator.metrics = _NullMetrics()
    await coordinator.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    outputs: list[RequestOutput] = []
    rejected = 0
    indices = iter(range(workload.total_requests))

    async def client() -> None:
        nonlocal rejected
        for index in indices:  # shared: each client takes the next request when it is free
            prompt = [(index + j) % SIM_VOCAB_SIZE for j in range(workload.prompt_tokens)]
            params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, seed=index)
            target.assign_trace(f"req-{index}", index)
            while True:
                try:
                    stream = await coordinator.submit(prompt, params, request_id=f"req-{index}")
                    break
                except OverloadedError:
                    rejected += 1
                    await asyncio.sleep(RETRY_AFTER_S)
            outputs.append(await stream.result())

    await asyncio.gather(
        *(client() for _ in range(min(workload.concurrency, workload.total_requests)))
    )
    wall_s = loop.time() - started
    stats = coordinator.stats
    await coordinator.stop()
    held = len(await target.held_requests())
    if drafts is not None:
        for worker in range(drafts.num_workers):
            held += len(await drafts.held_requests(worker))
    return _summarise(outputs, wall_s, stats, rejected, held + len(inbox))


def _summarise(outputs, wall_s, stats, rejected: int, leaked: int) -> dict[str, Any]:
    summary = ServedSummary.of(outputs)
    merged, tokens, gaps, tpots = (
        summary.metrics, summary.tokens, summary.chunk_gaps_s, summary.tpot_s
    )  # fmt: skip
    per_second = 1.0 / wall_s if wall_s > 0 else math.nan
    return {
        "num_requests": len(outputs),
        "committed_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens * per_second,
        "requests_per_s": len(outputs) * per_second,
        "ttft_p50_s": percentile([o.time_to_first_token_s for o in outputs], 0.5),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p95_s": percentile(gaps, 0.95),
        "tpot_mean_s": sum(tpots) / len(tpots) if tpots else math.nan,
        "latency_p50_s": percentile([o.latency_s for o in outputs], 0.5),
        "target_busy_fraction": stats.target_compute_s * per_second,
        "target_wait_fraction": stats.target_wait_s * per_second,
        "rounds": stats.rounds,
        "rounds_ahead": stats.rounds_ahead,
        "joined_ahead": stats.joined_ahead,
        "mean_k": (
            merged.num_draft_tokens / merged.num_target_steps if merged.num_target_steps else 0.0
        ),
        "acceptance_rate": merged.acceptance_rate,
        "mean_acceptance_length": merged.mean_acceptance_length,
        "reused_tokens": stats.reused_tokens,
        "verdicts_by_k": list(stats.verdicts_by_k),
        "dropped_blocks": stats.dropped_blocks,
        "draft_bytes": stats.draft_bytes,
        "rejected": rejected,
        "leaked_requests": leaked,
        "all_max_tokens": all(o.finish_reason == "length" for o in outputs),
    }


def _baseline_key(config: SimConfig) -> str:
    """Target-only runs do not depend on drafts or acceptance: share them across points."""
    coordinator = {
        key: value
        for key, value in config.coordinator.items()
        if key not in {"num_speculative_tokens", "draft_ahead"}
    }
    return repr((config.workload, config.latency, sorted(coordinator.items(), key=str)))


def _run_job(config: SimConfig, speculative: bool) -> dict[str, Any]:
    return run_virtual(_run_point(config, speculative=speculative))


class _Now:
    """A finished result, with the interface of a future."""

    def __init__(self, value: dict[str, Any]):
        self._value = value

    def result(self) -> dict[str, Any]:
        return self._value


def simulate(
    config: SimConfig,
    *,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    processes: int = 1,
) -> list[dict[str, Any]]:
    """One row per sweep point: the point's values, then the metrics (see the module doc);
    ``tokens_per_s / target_only_tokens_per_s`` is ``speedup``.

    ``on_row`` sees each row, in sweep order, as soon as it is done. ``processes > 1`` simulates the
    runs in that many worker processes (same rows: every run is deterministic)."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    points = [(point, config.at(point)) for point in config.points()]
    keys = [_baseline_key(point_config) for _, point_config in points]
    pool = None
    if processes > 1 and len(points) > 1:
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=processes)

    def start(job: SimConfig, speculative: bool):
        if pool is None:
            return _Now(_run_job(job, speculative))
        return pool.submit(_run_job, job, speculative)

    try:
        runs, baselines = [], {}
        for (_, point_config), key in zip(points, keys, strict=True):
            runs.append(start(point_config, True) if pool else None)
            if pool and key not in baselines:
                baselines[key] = start(point_config, False)
        rows = []
        for index, ((point, point_config), key) in enumerate(zip(points, keys, strict=True)):
            result = (runs[index] or start(point_config, True)).result()
            if key not in baselines:
                baselines[key] = start(point_config, False)
            base = baselines[key].result()["tokens_per_s"]
            row = {
                **point,
                **result,
                "target_only_tokens_per_s": base,
                "speedup": result["tokens_per_s"] / base if base else math.nan,
            }
            rows.append(row)
            if on_row is not None:
                on_row(row)
        return rows
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


# (column, header, scale, format) for the table; seconds are shown in milliseconds.
_TABLE_METRICS = (
    ("tokens_per_s", "tok/s", 1.0, "{:.1f}"),
    ("target_only_tokens_per_s", "base tok/s", 1.0, "{:.1f}"),
    ("speedup", "speedup", 1.0, "{:.2f}"),
    ("requests_per_s", "req/s", 1.0, "{:.2f}"),
    ("ttft_p50_s", "ttft p50 ms", 1e3, "{:.1f}"),
    ("itl_p50_s", "itl p50 ms", 1e3, "{:.1f}"),
    ("itl_p95_s", "itl p95 ms", 1e3, "{:.1f}"),
    ("tpot_mean_s", "tpot ms", 1e3, "{:.2f}"),
    ("target_busy_fraction", "busy", 1.0, "{:.2f}"),
    ("mean_k", "mean k", 1.0, "{:.2f}"),
    ("acceptance_rate", "accept", 1.0, "{:.2f}"),
    ("mean_acceptance_length", "acc len", 1.0, "{:.2f}"),
)


def _cell(value: Any, scale: float = 1.0, fmt: str | None = None) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return (fmt or "{:g}").format(value * scale)
    return str(value)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table: the sweep columns present, then throughput, latency and acceptance."""
    if not rows:
        return "(no rows)"
    sweep = [key for key in rows[0] if key in SWEEP_FIELDS]
    headers = [*sweep, *(header for _, header, _, _ in _TABLE_METRICS)]
    body = [
        [_cell(row.get(key)) for key in sweep]
        + [_cell(row.get(key, math.nan), scale, fmt) for key, _, scale, fmt in _TABLE_METRICS]
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [headers, *body]) for i in range(len(headers))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
             for cells in [headers, *body]]  # fmt: skip
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
