"""The chaos run: concurrent streaming clients (greedy and sampled) against a local multi-node
cluster while faults are injected on a schedule, then checks and a summary table.

    python -m tests.chaos.run --profile short|full [--json FILE] [--fuzz-report FILE]
    python -m tests.chaos.run --soak-s 1800 [--json FILE]   # fault-free: memory per process

The cluster is the real one ``specray cluster up --local`` starts (:mod:`specray.ops.local`):
a head, two draft nodes and a target node with a TP-2 target group, tiny random models. The
faults are real: SIGKILL of a draft worker, of a TP rank (the group restarts as one unit), of
the coordinator replica; a whole draft node stopped; blocks on the draft -> target link delayed
or dropped (``DraftWorker.inject_link_faults``). Checks, for every request: it completed
(the client library may retry before the first chunk; the ingress resumes a request whose
coordinator or target failed midway from the tokens it delivered); greedy outputs equal the
fault-free reference; sampled outputs (top-k 3, two tokens) pass a chi-square test against the
target's exact distribution, while a negative control (the second token drawn from the first
position's distribution) is rejected; afterwards no worker holds a request. ``full`` adds a
soak: steady load without faults, memory and throughput sampled over time; ``--soak-s`` runs
only a soak of that length (4 clients, no faults) and reports each process's growth
(:mod:`tests.chaos.soak`) and the requests the workers hold afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

APP = "specray"
PROMPTS = [
    "The history of the lighthouse",
    "A recipe for bread:",
    "In the year 2050, cities",
    "Dear diary, today I",
    "The rules of chess are",
    "Once upon a time in a small village",
]
STAT_PROMPT = "The weather today is"
STAT_TOP_K, STAT_TOKENS, ALPHA = 3, 2, 0.01
SEED_BASE = 100_000  # sampled request j of client i runs with seed 100000 * (i + 1) + j
GREEDY_TOKENS = 40


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the load starts
    kind: str  # kill_draft_worker | kill_target_rank | kill_coordinator | kill_draft_node |
    #            link_delay | link_drop
    hold_s: float = 0.0  # link faults: how long they stay on


PROFILES = {
    "short": dict(
        clients=3,
        faults=[
            Fault(8, "kill_draft_worker"),
            Fault(22, "link_drop", hold_s=8),
            Fault(32, "kill_coordinator"),
        ],
        tail_s=10,
        soak_s=0,
    ),
    "full": dict(
        clients=4,
        faults=[
            Fault(8, "kill_draft_worker"),
            Fault(30, "link_delay", hold_s=10),
            Fault(50, "link_drop", hold_s=10),
            Fault(70, "kill_coordinator"),
            Fault(110, "kill_target_rank"),
            Fault(170, "kill_draft_node"),
            Fault(230, "kill_coordinator"),
            Fault(270, "kill_draft_worker"),
        ],
        tail_s=30,
        soak_s=180,
    ),
}


@dataclass
class Outcome:
    kind: str  # greedy | sampled
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    retries: int = 0  # client-library retries (before the first chunk)
    started_s: float = 0.0
    ended_s: float = 0.0


def log(line: str) -> None:
    print(f"chaos: {line}", file=sys.stderr, flush=True)


# ---- the cluster ------------------------------------------------------------------------
def make_models(workdir: Path) -> tuple[str, str]:
    from tests.helpers.tiny_models import save_tiny_chat_pair

    return save_tiny_chat_pair(workdir / "models", max_positions=256, num_key_value_heads=2)


def start_cluster(workdir: Path, target: str, draft: str, grpc_port: int, http_port: int):
    from specray.ops import local
    from specray.serve.config import AppArgs
    from specray.serve.launch import deploy_config

    args = AppArgs(
        target=target,
        draft=draft,
        model_name="tiny",
        tp_size=2,
        num_draft_workers=2,
        num_speculative_tokens=4,
        draft_deadline_s=0.3,  # a dropped block costs this much, then the round goes alone
        grpc_port=grpc_port,
        ingress_on_head=True,
        max_running=32,
    )
    spec = local.LocalClusterSpec(
        draft_nodes=2, target_nodes=1, draft_cpus=2, target_cpus=2, draft_units=4, target_units=4
    )
    config = deploy_config(args, http_port=http_port)
    return local.up(spec, config, workdir / "state", say=lambda line: log(line))


def references(target: str) -> dict[str, list[int]]:
    """Greedy outputs of a fault-free, in-process, target-only run."""
    from specray import Engine, SamplingParams

    engine = Engine(target, None)
    try:
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS)
        outputs = engine.generate(PROMPTS, params, use_chat_template=False)
        return {p: list(o.token_ids) for p, o in zip(PROMPTS, outputs, strict=True)}
    finally:
        engine.shutdown()


def exact_distribution(model_dir: str, *, conditioned: bool = True) -> dict[tuple[int, ...], float]:
    """P(first two tokens) under top-k sampling at temperature 1, by enumeration with the
    model itself (k^2 sequences). ``conditioned=False`` is the negative control: a sampler
    that draws the second token from the first position's distribution again (a stale KV
    cache / position bug) — the test must reject it."""
    import torch

    from specray.models.loading import load_model, load_tokenizer
    from specray.prompts import prompt_token_ids

    loaded = load_model(model_dir, param="model")
    model = loaded.model.eval()
    tokenizer = load_tokenizer(Path(model_dir))
    prompt = prompt_token_ids(tokenizer, STAT_PROMPT, use_chat_template=False)

    def top_k(ids: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()  # [vocab]
        values, indices = torch.topk(logits, STAT_TOP_K)
        probs = torch.softmax(values, dim=0)
        return list(zip(indices.tolist(), probs.tolist(), strict=True))

    dist: dict[tuple[int, ...], float] = {}
    for first, p_first in top_k(prompt):
        for second, p_second in top_k([*prompt, first] if conditioned else prompt):
            dist[(first, second)] = p_first * p_second
    return dist


def chi_square(counts: dict[tuple, int], expected: dict[tuple, float]) -> float:
    """p-value of the observed counts under ``expected``; cells with an expected count under
    5 are pooled; an observed outcome the distribution cannot produce gives p = 0."""
    from scipy.stats import chisquare

    n = sum(counts.values())
    if any(expected.get(key, 0.0) == 0.0 for key in counts):
        return 0.0
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in expected.items():
        if prob * n >= 5:
            cells.append((counts.get(key, 0), prob * n))
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    if len(cells) < 2:
        return 1.0
    observed, wanted = zip(*cells, strict=True)
    scale = sum(observed) / sum(wanted)
    return float(chisquare(observed, [w * scale for w in wanted]).pvalue)


# ---- load ---------------------------------------------------------------------------------
class Load:
    """``clients`` threads, each alternating greedy and sampled streaming requests until
    stopped; every request's outcome is kept."""

    def __init__(self, address: str, clients: int, seed: int = 0):
        self.address, self.clients = address, clients
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def _client(self, index: int) -> None:
        from specray.client import Client, RetryPolicy, SpecrayClientError

        retry = RetryPolicy(max_retries=10, initial_backoff_s=0.2, max_backoff_s=3.0)
        turn = index
        with Client(self.address, retry=retry) as client:
            while not self.stop.is_set():
                turn += 1
                greedy = turn % 2 == 0
                prompt = PROMPTS[turn % len(PROMPTS)] if greedy else STAT_PROMPT
                outcome = Outcome("greedy" if greedy else "sampled", prompt)
                outcome.started_s = time.monotonic()
                before = client.generate_retries
                try:
                    if greedy:
                        done = client.generate(prompt, max_tokens=GREEDY_TOKENS, temperature=0)
                    else:
                        done = client.generate(
                            prompt,
                            max_tokens=STAT_TOKENS,
                            temperature=1.0,
                            top_k=STAT_TOP_K,
                            seed=SEED_BASE * (index + 1) + turn,  # distinct, stated seeds
                        )
                    outcome.token_ids = list(done.token_ids)
                except SpecrayClientError as error:
                    outcome.error = f"{error.code.name}: {error.message}"
                outcome.retries = client.generate_retries - before
                outcome.ended_s = time.monotonic()
                with self._lock:
                    self.outcomes.append(outcome)

    def completed_since(self, since_s: float) -> int:
        with self._lock:
            return sum(o.ended_s >= since_s and o.error is None for o in self.outcomes)


# ---- faults -----------------------------------------------------------------------------
def _actors(class_name: str) -> list:
    """Live actors of a class, on live nodes (an actor on a stopped node may still be listed
    ALIVE until the GCS notices)."""
    import ray
    from ray.util.state import list_actors

    live_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    # The connected cluster's own address: without one, the state API follows the cluster
    # `ray start` last recorded on this machine, which may be another (or a stopped) one.
    address = ray.get_runtime_context().gcs_address
    actors = list_actors(
        address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000
    )
    return [a for a in actors if a.class_name == class_name and a.node_id in live_nodes]


def _live_actors(class_name: str, timeout_s: float = 60.0) -> list:
    """``_actors``, waiting for one to be alive: a replacement for one an earlier fault killed
    may still be starting."""
    deadline = time.monotonic() + timeout_s
    while not (actors := _actors(class_name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not actors:
        raise RuntimeError(f"no live {class_name} to inject a fault into after {timeout_s} s")
    return actors


def _kill_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def inject(fault: Fault, state) -> tuple[str, tuple[str, int] | None]:
    """Apply ``fault``: a line saying what was hit, and the (actor class, pid) killed."""
    import ray

    from specray.ops.processes import stop_session
    from specray.serve.registry import get_registry

    if fault.kind == "kill_draft_worker":
        actor = random.choice(_live_actors("DraftWorker"))
        _kill_pid(actor.pid)
        return f"SIGKILL draft worker pid {actor.pid}", ("DraftWorker", actor.pid)
    if fault.kind == "kill_target_rank":
        leader_ids = {
            handle._actor_id.hex()
            for handle in ray.get(get_registry(APP).workers.remote())["targets"].values()
        }
        ranks = _actors("TargetWorker")
        followers = [a for a in ranks if a.actor_id not in leader_ids] or ranks
        actor = followers[0]
        _kill_pid(actor.pid)
        return f"SIGKILL TP rank pid {actor.pid} (of {len(ranks)} ranks)", (
            "TargetWorker",
            actor.pid,
        )
    if fault.kind == "kill_coordinator":
        name = f"ServeReplica:{APP}:Coordinator"
        actor = _actors(name)[0]
        _kill_pid(actor.pid)
        return f"SIGKILL coordinator replica pid {actor.pid}", (name, actor.pid)
    if fault.kind == "kill_draft_node":
        hosts = {a.node_id for a in _actors("DraftWorker")}
        from specray.ops.local import NODE_NAME_LABEL

        names = {
            n["NodeID"]: (n.get("Labels") or {}).get(NODE_NAME_LABEL)
            for n in ray.nodes()
            if n["Alive"]
        }
        victims = [names[h] for h in hosts if names.get(h, "").startswith("draft-")]
        name = sorted(victims)[-1]
        node = next(n for n in state.nodes if n.name == name)
        # Only the stopped node's draft workers: one on a surviving node stays alive, and
        # waiting for it to be replaced would never end.
        stopped_id = next(h for h in hosts if names.get(h) == name)
        victims_pids = [a.pid for a in _actors("DraftWorker") if a.node_id == stopped_id]
        stopped = stop_session(node.session, grace_s=1.0)
        killed = ("DraftWorker", victims_pids[0]) if victims_pids else None
        return f"stopped node {name} ({stopped.processes} processes)", killed
    if fault.kind in ("link_delay", "link_drop"):
        delay, drop = (0.5, 0.0) if fault.kind == "link_delay" else (0.0, 0.5)
        drafts = ray.get(get_registry(APP).workers.remote())["drafts"].values()
        for handle in drafts:
            with contextlib.suppress(Exception):  # a draft that died has no link to spoil
                ray.get(handle.inject_link_faults.remote(delay, drop, seed=1), timeout=10)
        return f"{fault.kind} on {len(drafts)} draft workers for {fault.hold_s:.0f} s", None
    raise ValueError(f"unknown fault kind {fault.kind!r}")


def clear_link_faults() -> None:
    import ray

    from specray.serve.registry import get_registry

    for handle in ray.get(get_registry(APP).workers.remote())["drafts"].values():
        with contextlib.suppress(Exception):
            ray.get(handle.inject_link_faults.remote(0.0, 0.0), timeout=10)


def full_strength(expected_drafts: int, killed: tuple[str, int] | None) -> bool:
    """Every deployment healthy at its size, the draft pool full, one target group, and the
    killed actor replaced (Ray no longer lists its pid as alive)."""
    from ray import serve

    if killed is not None:
        class_name, pid = killed
        alive = _actors(class_name)
        if any(a.pid == pid for a in alive) or not alive:
            return False

    app = serve.status().applications.get(APP)
    if app is None or str(getattr(app.status, "value", app.status)) != "RUNNING":
        return False
    for deployment in app.deployments.values():
        if str(getattr(deployment.status, "value", deployment.status)) != "HEALTHY":
            return False
    return len(_actors("DraftWorker")) >= expected_drafts and len(_actors("TargetWorker")) >= 2


def wait_recovered(
    load: Load, since_s: float, expected_drafts: int, killed, timeout_s: float
) -> float:
    """Seconds from ``since_s`` until full strength and a request completed after it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if full_strength(expected_drafts, killed) and load.completed_since(time.monotonic() - 5):
            return time.monotonic() - since_s
        time.sleep(0.5)
    return float("nan")


# ---- the run ------------------------------------------------------------------------------
def run(profile_name: str, fuzz_report: Path | None, soak_s: float = 0) -> dict:
    import ray

    from specray.ops import local
    from tests.chaos.soak import growth, soak
    from tests.e2e.test_cluster_local import free_port

    profile = PROFILES[profile_name]
    if soak_s:  # a soak alone: the full profile's load, no faults
        profile = dict(PROFILES["full"], faults=[], tail_s=0, soak_s=soak_s)
        profile_name = f"soak-{soak_s:g}s"
    workdir = Path(tempfile.mkdtemp(prefix="specray-chaos-"))
    grpc_port, http_port = free_port(), free_port()
    target, draft = make_models(workdir)
    log("fault-free references and the exact distribution")
    expected = references(target)
    exact = exact_distribution(target)
    wrong = exact_distribution(target, conditioned=False)  # the negative control
    log(f"exact distribution over {len(exact)} two-token outcomes, max {max(exact.values()):.3f}")
    state = start_cluster(workdir, target, draft, grpc_port, http_port)
    report: dict = {"profile": profile_name, "faults": [], "recovery_s": {}}
    try:
        load = Load(f"127.0.0.1:{grpc_port}", profile["clients"])
        start = time.monotonic()
        load.start()
        for fault in profile["faults"]:
            time.sleep(max(start + fault.at_s - time.monotonic(), 0))
            injected_s = time.monotonic()
            what, killed = inject(fault, state)
            log(f"t={injected_s - start:.0f}s {what}")
            if fault.hold_s:
                time.sleep(fault.hold_s)
                clear_link_faults()
            recovery = wait_recovered(load, injected_s, 2, killed, timeout_s=240)
            log(f"  back to full strength after {recovery:.1f} s")
            report["faults"].append({"kind": fault.kind, "what": what, "recovery_s": recovery})
        time.sleep(profile["tail_s"])
        if profile["soak_s"]:
            log(f"soak: {profile['soak_s']} s of steady load, no faults")
            report["soak"] = soak(load, state, profile["soak_s"])
            report["soak_growth"] = growth(report["soak"])
        load.join()
        report.update(check(load, expected, exact, wrong))
        report["held_after"] = held_requests()
        report["ingress_resumes"] = ingress_resumes(http_port)
        report["duration_s"] = round(time.monotonic() - start, 1)
    finally:
        ray.shutdown()
        local.down(workdir / "state", say=lambda line: log(line), drain=False)
    add_fuzz_counts(report, fuzz_report)
    return report


def add_fuzz_counts(report: dict, fuzz_report: Path | None) -> None:
    if fuzz_report is not None and fuzz_report.is_file():
        rows = [json.loads(line) for line in fuzz_report.read_text().splitlines() if line]
        report["fuzz_cases"] = sum(r["cases"] for r in rows)
        report["fuzz_5xx"] = sum(r["5xx"] for r in rows)


def check(load: Load, expected: dict, exact: dict, wrong: dict) -> dict:
    outcomes = load.outcomes
    greedy = [o for o in outcomes if o.kind == "greedy" and o.error is None]
    sampled = [o for o in outcomes if o.kind == "sampled" and o.error is None]
    mismatches = [o.prompt for o in greedy if o.token_ids != expected[o.prompt]]
    counts: dict[tuple, int] = {}
    for o in sampled:
        key = tuple(o.token_ids[:STAT_TOKENS])
        counts[key] = counts.get(key, 0) + 1
    return {
        "sent": len(outcomes),
        "completed": sum(o.error is None for o in outcomes),
        "client_retries": sum(o.retries for o in outcomes),
        "lost": [o.error for o in outcomes if o.error is not None],
        "greedy_checked": len(greedy),
        "greedy_mismatches": mismatches,
        "sampled_n": len(sampled),
        "stat_p": chi_square(counts, exact),
        "stat_negative_p": chi_square(counts, wrong),
    }


def held_requests() -> dict:
    """Requests any live worker still holds (must be none once the load stopped)."""
    import ray

    from specray.serve.registry import get_registry

    held = {}
    workers = ray.get(get_registry(APP).workers.remote())
    for kind in ("targets", "drafts"):
        for name, handle in workers[kind].items():
            try:
                held[f"{kind}:{name}"] = ray.get(handle.held_requests.remote(), timeout=10)
            except Exception:  # a dead worker (its registration not yet expired)
                continue
    return {k: v for k, v in held.items() if v}


def ingress_resumes(http_port: int) -> int:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read()
    for line in text.decode().splitlines():
        if line.startswith("specray:ingress_request_resumes_total"):
            return int(float(line.split()[-1]))
    return 0


def table(report: dict) -> str:
    recoveries = [f["recovery_s"] for f in report["faults"] if f["recovery_s"] == f["recovery_s"]]
    by_kind: dict[str, int] = {}
    for fault in report["faults"]:
        by_kind[fault["kind"]] = by_kind.get(fault["kind"], 0) + 1
    p50 = statistics.median(recoveries) if recoveries else float("nan")
    p95 = sorted(recoveries)[max(round(0.95 * len(recoveries)) - 1, 0)] if recoveries else 0
    rows = [
        ("requests sent", report["sent"]),
        ("completed", report["completed"]),
        ("retried (client, before first chunk)", report["client_retries"]),
        ("resumed (ingress, mid-stream)", report["ingress_resumes"]),
        ("lost", len(report["lost"])),
        (
            "greedy outputs checked / differing",
            f"{report['greedy_checked']} / {len(report['greedy_mismatches'])}",
        ),
        (
            "sampled outputs (chi-square p; negative control's p)",
            f"{report['sampled_n']} ({report['stat_p']:.3g}; {report['stat_negative_p']:.3g})",
        ),
        ("requests held by workers afterwards", len(report["held_after"])),
        *((f"faults: {kind}", count) for kind, count in sorted(by_kind.items())),
        ("recovery p50 / p95 (s)", f"{p50:.1f} / {p95:.1f}"),
        ("fuzz cases run", report.get("fuzz_cases", "-")),
        ("5xx seen (fuzzing)", report.get("fuzz_5xx", "-")),
    ]
    if report.get("soak", {}).get("samples"):
        samples = report["soak"]["samples"]
        rows.append(
            ("soak RSS MB first / last", f"{samples[0]['rss_mb']} / {samples[-1]['rss_mb']}")
        )
        rows.append(
            (
                "soak tokens/s first / last",
                f"{samples[0]['tokens_per_s']} / {samples[-1]['tokens_per_s']}",
            )
        )
        rows.append(("soak errors", sum(s["errors"] for s in samples)))
        grown = report.get("soak_growth", {})
        if grown:
            rows.append(
                (
                    f"soak RSS growth t={grown['from_t_s']}..{grown['to_t_s']} s",
                    f"{grown['rss_growth_mb']} MB ({grown['mb_per_hour']} MB/h)",
                )
            )
            rows += [
                (f"  {name}", f"{mb:+} MB")
                for name, mb in list(grown["per_process_growth_mb"].items())[:6]
            ]
            rows.append(
                (
                    "soak tokens/s per 5 minutes",
                    f"{grown['tokens_per_s_windows']} "
                    f"(worst {grown['tokens_per_s_worst_change']:+.1%} of the first; "
                    f"trend {grown['tokens_per_s_trend']:+.1%} over the run)",
                )
            )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"| {name:<{width}} | {value} |" for name, value in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--fuzz-report", type=Path, help="fuzzing counts (JSON lines) to add")
    parser.add_argument("--render", type=Path, help="print the table of an earlier --json report")
    parser.add_argument(
        "--soak-s", type=float, default=0, help="only a fault-free soak of this many seconds"
    )
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.render is not None:
        report = json.loads(args.render.read_text())
        add_fuzz_counts(report, args.fuzz_report)
    else:
        report = run(args.profile, args.fuzz_report, args.soak_s)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(table(report), flush=True)
    for fault in report["faults"]:
        print(f"  {fault['kind']}: {fault['what']}; recovered in {fault['recovery_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
