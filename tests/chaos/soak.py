"""The chaos harness's soak: steady load without faults, memory per process and throughput
sampled over time, and what the workers still hold afterwards (issue 22's "memory that stays
flat").

Processes are the cluster's (every member of the sessions ``specray cluster up --local``
started), named by their command line: a Ray actor's ``ray::ClassName``, a Ray daemon's
executable, Serve's replicas. Growth is measured from the sample at ``warmup_s`` (allocators,
caches and compiled kernels settle first) to the last.
"""

from __future__ import annotations

import time
from pathlib import Path

SAMPLE_EVERY_S = 15.0


def _rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None  # exited while we looked
    return None


def _name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace").strip()
    if first.startswith("ray::") or (" " in first and not first.startswith("/")):
        # ray::TargetWorker, ray::ServeReplica:specray:Ingress, ray-dashboard-NodeHead-0 (...)
        return first.split()[0]
    words = [a.decode(errors="replace") for a in argv if a]
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return Path(script or first).name


def process_rss_mb(state) -> dict[str, float]:
    """``name[pid]`` -> resident MB of every live process of the cluster."""
    from specray.ops.processes import session_members

    out = {}
    for pid in sorted(session_members(state.sessions())):
        kb = _rss_kb(pid)
        if kb is not None:
            out[f"{_name(pid)}[{pid}]"] = round(kb / 1024, 1)
    return out


def soak(load, state, seconds: float, interval_s: float = SAMPLE_EVERY_S) -> dict:
    """Sample every ``interval_s`` for ``seconds``: total and per-process RSS, tokens/s and
    errors of the requests completed in the interval."""
    samples = []
    start = time.monotonic()
    last, last_done = start, len(load.outcomes)
    while time.monotonic() - start < seconds:
        time.sleep(interval_s)
        now, done = time.monotonic(), len(load.outcomes)
        window = load.outcomes[last_done:done]
        processes = process_rss_mb(state)
        samples.append(
            {
                "t_s": round(now - start, 1),
                "rss_mb": round(sum(processes.values()), 1),
                "tokens_per_s": round(sum(len(o.token_ids) for o in window) / (now - last), 2),
                "requests": len(window),
                "errors": sum(o.error is not None for o in window),
                "processes": processes,
            }
        )
        print(
            f"[chaos] soak t={samples[-1]['t_s']}s rss={samples[-1]['rss_mb']} MB "
            f"tokens/s={samples[-1]['tokens_per_s']} errors={samples[-1]['errors']}",
            flush=True,
        )
        last, last_done = now, done
    return {"samples": samples}


def growth(report: dict, warmup_s: float = 120.0, baseline_s: float = 300.0) -> dict:
    """From the first sample at or after ``warmup_s`` to the last: total RSS growth, per
    process growth (processes alive at both), and throughput per ``baseline_s`` window (the
    samples ending in it, by their request-weighted rate) against the first window. A 15 s
    sample swings by a third on a shared machine; a 5-minute window does not."""
    samples = report["samples"]
    if not samples:
        return {}
    first = next((s for s in samples if s["t_s"] >= warmup_s), samples[0])
    last = samples[-1]
    per_process = {
        name: round(last["processes"][name] - mb, 1)
        for name, mb in first["processes"].items()
        if name in last["processes"]
    }
    windows = throughput_windows(samples, baseline_s)
    baseline = windows[0]
    return {
        "from_t_s": first["t_s"],
        "to_t_s": last["t_s"],
        "rss_growth_mb": round(last["rss_mb"] - first["rss_mb"], 1),
        "mb_per_hour": round(
            (last["rss_mb"] - first["rss_mb"]) * 3600 / max(last["t_s"] - first["t_s"], 1), 1
        ),
        "per_process_growth_mb": dict(sorted(per_process.items(), key=lambda kv: -kv[1])),
        "tokens_per_s_baseline": baseline,
        "tokens_per_s_last": last["tokens_per_s"],
        "tokens_per_s_windows": windows,
        # the window furthest from the first, as a signed share of it
        "tokens_per_s_worst_change": round(
            max((w / baseline - 1 for w in windows), key=abs) if baseline else 0.0, 3
        ),
        "tokens_per_s_trend": throughput_trend([s for s in samples if s["t_s"] >= first["t_s"]]),
        "errors": sum(s["errors"] for s in samples),
    }


def throughput_trend(samples: list[dict]) -> float:
    """The least-squares line through the samples' tokens/s over time: its change from the
    first sample's time to the last, as a share of the line's mean (negative: throughput
    fell). Noise of single samples averages out; a steady fall does not."""
    if len(samples) < 2:
        return 0.0
    times = [s["t_s"] for s in samples]
    rates = [s["tokens_per_s"] for s in samples]
    mean_t, mean_r = sum(times) / len(times), sum(rates) / len(rates)
    spread = sum((t - mean_t) ** 2 for t in times)
    if not spread or not mean_r:
        return 0.0
    slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(times, rates, strict=True)) / spread
    return round(slope * (times[-1] - times[0]) / mean_r, 3)


def throughput_windows(samples: list[dict], window_s: float) -> list[float]:
    """Tokens/s per ``window_s`` window of the run, each from its samples' tokens and
    seconds (a sample belongs to the window it ends in; a last window shorter than half a
    window joins the one before)."""
    totals: dict[int, list[float]] = {}  # window -> [tokens, seconds]
    previous = 0.0
    for sample in samples:
        seconds = sample["t_s"] - previous
        previous = sample["t_s"]
        index = max(int((sample["t_s"] - 1e-9) // window_s), 0)
        total = totals.setdefault(index, [0.0, 0.0])
        total[0] += sample["tokens_per_s"] * seconds
        total[1] += seconds
    ordered = [totals[index] for index in sorted(totals)]
    if len(ordered) > 1 and ordered[-1][1] < window_s / 2:
        tokens, seconds = ordered.pop()
        ordered[-1][0] += tokens
        ordered[-1][1] += seconds
    return [round(tokens / seconds, 2) for tokens, seconds in ordered if seconds > 0]
