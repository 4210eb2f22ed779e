"""``specray bench --serving``: does the served app's own speculation policy earn what the
best fixed k earns in process, on a workload that starts with a badly-drafted request?

One run, on the same machine, the same prompts and the same drafter:

- **served**: the application as ``specray serve`` runs it (Ray Serve, the engine core beside
  the target, the default drafter and policy, verify costs calibrated at start), reached by the
  gRPC client library. First one badly-drafted request (sampled at a high temperature: the
  draft rarely agrees with the target there), then each shipped chat prompt greedy with
  speculation left to the policy and with ``speculation: "off"``, alternating which goes first.
- **in process**: ``Engine.generate`` on the same prompts, greedy, target-only and at each
  fixed k in ``fixed_ks``, one prompt at a time as the served requests come.

Reported: tokens/s of each, the served speedup (policy over off), the in-process speedup (the
best fixed k over target-only) and their ratio, the figure issue 21 asks to be at least 0.9.
Each path's speedup is a ratio measured on that path alone, so the cost of the serving layers
(the same with speculation on and off) largely cancels out of it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from importlib import resources

BAD_TEMPERATURE = 2.0  # the badly-drafted request: sampled so hot the draft rarely agrees


@dataclass(frozen=True)
class ServedSpeedupConfig:
    target: str = "default"
    draft: str = "default"
    max_tokens: int = 48
    fixed_ks: tuple[int, ...] = (1, 2, 3, 4)
    num_prompts: int | None = None  # None: every shipped chat prompt (8)
    bad_max_tokens: int = 48

    def __post_init__(self) -> None:
        for name in ("max_tokens", "bad_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.fixed_ks or any(not isinstance(k, int) or k < 1 for k in self.fixed_ks):
            raise ValueError(f"fixed_ks must hold positive integers, got {self.fixed_ks!r}")


@dataclass
class PathResult:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, token_ids, seconds: float, drafted: int = 0, accepted: int = 0) -> None:
        self.tokens += len(token_ids)
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted
        self.outputs.append(list(token_ids))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def chat_prompts(limit: int | None = None) -> list[str]:
    data = json.loads(resources.files("specray.data").joinpath("bench_prompts.json").read_text())
    prompts = [entry["prompt"] for entry in data["prompts"] if entry["category"] == "chat"]
    return prompts[:limit] if limit else prompts


def _served(config: ServedSpeedupConfig, prompts: list[str]) -> dict:
    """The served app: the bad request, then each prompt with the policy and with it off."""
    import ray

    from specray.client import Client
    from specray.cluster.distributed import connect
    from specray.cluster.placement import PlacementConfig
    from specray.cluster.ports import free_ports
    from specray.cluster.serve_env import serve_env
    from specray.serve import launch
    from specray.serve.config import AppArgs

    grpc_port, http_port = free_ports(2)
    args = AppArgs(target=config.target, draft=config.draft, grpc_port=grpc_port)
    connect("auto", PlacementConfig(), env=serve_env(local=True))  # as `specray serve` does
    endpoints = launch.start(launch.deploy_config(args, http_port=http_port))
    results = {"policy": PathResult(), "off": PathResult()}
    try:
        with Client(endpoints.grpc) as client:

            def send(prompt: str, **options):
                started = time.perf_counter()
                completion = client.generate(
                    messages=[{"role": "user", "content": prompt}], **options
                )
                return completion, time.perf_counter() - started

            bad, _ = send(
                prompts[0], max_tokens=config.bad_max_tokens, temperature=BAD_TEMPERATURE, seed=0
            )
            greedy = {"max_tokens": config.max_tokens, "temperature": 0.0}
            for index, prompt in enumerate(prompts):
                order = ("policy", "off") if index % 2 == 0 else ("off", "policy")
                for mode in order:
                    extra = {"speculation": "off"} if mode == "off" else {}
                    completion, seconds = send(prompt, **greedy, **extra)
                    spec = completion.speculative_decoding
                    results[mode].add(
                        completion.token_ids,
                        seconds,
                        int(spec.get("num_draft_tokens", 0)),
                        int(spec.get("num_accepted_tokens", 0)),
                    )
        bad_spec = bad.speculative_decoding
        return {
            "bad_request": {
                "tokens": len(bad.token_ids),
                "drafted": int(bad_spec.get("num_draft_tokens", 0)),
                "accepted": int(bad_spec.get("num_accepted_tokens", 0)),
            },
            **results,
        }
    finally:
        launch.stop()
        ray.shutdown()


def _in_process(config: ServedSpeedupConfig, prompts: list[str]) -> dict[int, PathResult]:
    """Target-only (k = 0) and each fixed k, one prompt at a time, on one engine."""
    from specray import Engine
    from specray.sampling import SamplingParams

    engine = Engine(config.target, draft=config.draft, num_speculative_tokens=max(config.fixed_ks))
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens)
    results = {k: PathResult() for k in (0, *config.fixed_ks)}
    engine.generate([prompts[0]], params)  # warm-up
    for prompt in prompts:
        for k, result in results.items():
            engine.num_speculative_tokens = k
            started = time.perf_counter()
            (output,) = engine.generate([prompt], params)
            metrics = output.metrics
            result.add(
                output.token_ids,
                time.perf_counter() - started,
                metrics.num_draft_tokens,
                metrics.num_accepted_tokens,
            )
    return results


def run_served_speedup_bench(config: ServedSpeedupConfig = ServedSpeedupConfig()) -> dict:
    prompts = chat_prompts(config.num_prompts)
    in_process = _in_process(config, prompts)
    served = _served(config, prompts)
    base = in_process[0].tokens_per_s
    speedups = {k: result.tokens_per_s / base for k, result in in_process.items() if k}
    best_k = max(speedups, key=speedups.get)
    served_speedup = served["policy"].tokens_per_s / served["off"].tokens_per_s
    identical = sum(
        a == b for a, b in zip(served["policy"].outputs, served["off"].outputs, strict=True)
    )

    def row(result: PathResult) -> dict:
        return {
            "tokens": result.tokens,
            "seconds": round(result.seconds, 3),
            "tokens_per_s": round(result.tokens_per_s, 2),
            "drafted": result.drafted,
            "accepted": result.accepted,
        }

    return {
        "config": asdict(config),
        "prompts": len(prompts),
        "in_process": {str(k): row(result) for k, result in in_process.items()},
        "in_process_best_k": best_k,
        "in_process_speedup": round(speedups[best_k], 4),
        "served": {
            "bad_request": served["bad_request"],
            "policy": row(served["policy"]),
            "off": row(served["off"]),
        },
        "served_speedup": round(served_speedup, 4),
        "served_over_in_process": round(served_speedup / speedups[best_k], 4),
        "greedy_outputs_identical_on_off": f"{identical}/{len(prompts)}",
    }


def format_served_speedup(report: dict) -> str:
    lines = [
        f"{report['prompts']} chat prompts, greedy, {report['config']['max_tokens']} tokens",
        "in process (one prompt at a time):",
    ]
    for k, row in report["in_process"].items():
        label = "target-only" if k == "0" else f"k={k}"
        lines.append(
            f"  {label:<12} {row['tokens_per_s']:8.2f} tok/s  accepted {row['accepted']}"
            f"/{row['drafted']}"
        )
    served = report["served"]
    bad = served["bad_request"]
    lines += [
        f"served: bad request first ({bad['accepted']}/{bad['drafted']} drafted accepted)",
        f"  policy       {served['policy']['tokens_per_s']:8.2f} tok/s  accepted "
        f"{served['policy']['accepted']}/{served['policy']['drafted']}",
        f"  off          {served['off']['tokens_per_s']:8.2f} tok/s",
        f"speedup: served {report['served_speedup']:.3f}x, in process (k="
        f"{report['in_process_best_k']}) {report['in_process_speedup']:.3f}x, ratio "
        f"{report['served_over_in_process']:.3f} (goal >= 0.9)",
    ]
    return "\n".join(lines)
