"""``specray bench --serving``: does the served app's own speculation policy earn what the
best fixed k earns in process, on a workload that starts with a badly-drafted request?

One run, on the same machine, the same prompts, the same drafter and the same torch threads
per process (``num_threads``: the served workers' setting, given to the in-process engine too,
so that both paths verify and draft with the same kernels):

- **served**: the application as ``specray serve`` runs it (Ray Serve, the engine core beside
  the target, the default drafter and policy, verify costs calibrated at start), reached by the
  gRPC client library. First one badly-drafted request (sampled at a high temperature: the
  draft rarely agrees with the target there), then each shipped chat prompt greedy with
  speculation left to the policy, with ``speculation: "off"`` and with ``speculation: "on"``
  at each fixed k (the path's own cost of speculating, apart from the policy's choices).
- **in process**: ``Engine.generate`` in this process on the same prompts, greedy, target-only
  and at each fixed k in ``fixed_ks``, one prompt at a time as the served requests come.

The two paths take turns prompt by prompt (the order reversed every other prompt), so a slow
spell of a shared machine falls on both; the whole workload runs ``repeats`` times, summed.
Reported: tokens/s of each, the served speedup (policy over off), the in-process speedup (the
best fixed k over target-only) and their ratio, the figure issue 21 asks to be at least 0.9.
Each speedup is a ratio measured on its own path, so the serving layers' cost (the same with
speculation on and off) largely cancels out. Beside them, the served best fixed k over the
in-process one (what the served path costs speculation) and the policy over the served best
fixed k (what the policy's choices cost).
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
    num_threads: int = 1  # torch threads per process on both paths (AppArgs.num_threads)
    repeats: int = 2  # turns of the whole workload (bad request, then every prompt), summed
    draft_placement: str | None = (
        None  # the served app's (AppArgs.draft_placement); None: its default
    )

    def __post_init__(self) -> None:
        for name in ("max_tokens", "bad_max_tokens", "num_threads", "repeats"):
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


class _Served:
    """The served app, reached by the gRPC client library."""

    def __init__(self, config: ServedSpeedupConfig):
        from specray.client import Client
        from specray.cluster.distributed import connect
        from specray.cluster.placement import PlacementConfig
        from specray.cluster.ports import free_ports
        from specray.cluster.serve_env import serve_env
        from specray.serve import launch
        from specray.serve.config import AppArgs

        grpc_port, http_port = free_ports(2)
        args = AppArgs(
            target=config.target,
            draft=config.draft,
            grpc_port=grpc_port,
            num_threads=config.num_threads,
            **({"draft_placement": config.draft_placement} if config.draft_placement else {}),
        )
        self.draft_placement = args.resolved_draft_placement  # for the report
        connect("auto", PlacementConfig(), env=serve_env(local=True))  # as `specray serve` does
        endpoints = launch.start(launch.deploy_config(args, http_port=http_port))
        self.client = Client(endpoints.grpc)

    def send(self, result: PathResult | None, prompt: str, **options):
        started = time.perf_counter()
        completion = self.client.generate(messages=[{"role": "user", "content": prompt}], **options)
        spec = completion.speculative_decoding
        if result is not None:
            result.add(
                completion.token_ids,
                time.perf_counter() - started,
                int(spec.get("num_draft_tokens", 0)),
                int(spec.get("num_accepted_tokens", 0)),
            )
        return completion

    def close(self) -> None:
        import ray

        from specray.serve import launch

        self.client.close()
        launch.stop()
        ray.shutdown()


class _InProcess:
    """``Engine.generate`` in this process, one prompt at a time, at a k set per call."""

    def __init__(self, config: ServedSpeedupConfig):
        import torch

        from specray import Engine
        from specray.sampling import SamplingParams

        torch.set_num_threads(config.num_threads)
        self.engine = Engine(
            config.target, draft=config.draft, num_speculative_tokens=max(config.fixed_ks)
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens)

    def send(self, result: PathResult | None, prompt: str, k: int) -> None:
        self.engine.num_speculative_tokens = k
        started = time.perf_counter()
        (output,) = self.engine.generate([prompt], self.params)
        if result is not None:
            metrics = output.metrics
            result.add(
                output.token_ids,
                time.perf_counter() - started,
                metrics.num_draft_tokens,
                metrics.num_accepted_tokens,
            )


def _measure(config: ServedSpeedupConfig, prompts: list[str]) -> dict:
    """Both paths, taking turns prompt by prompt: the bad request first on the served app,
    then for each prompt every in-process k and the served policy and off."""
    served = _Served(config)
    try:
        in_process = _InProcess(config)
        results = {
            **{("in_process", k): PathResult() for k in (0, *config.fixed_ks)},
            ("served", "policy"): PathResult(),
            ("served", "off"): PathResult(),
            **{("served", k): PathResult() for k in config.fixed_ks},
        }
        greedy = {"max_tokens": config.max_tokens, "temperature": 0.0}
        in_process.send(None, prompts[0], max(config.fixed_ks))  # warm-up
        served.send(None, prompts[-1], **greedy, speculation="off")  # warm-up, target only
        turns = [(turn, index, prompt) for turn in range(config.repeats) for index, prompt in
                 enumerate(prompts)]  # fmt: skip
        for turn, index, prompt in turns:
            if index == 0:  # each turn starts with the badly-drafted request
                bad = served.send(
                    None,
                    prompts[0],
                    max_tokens=config.bad_max_tokens,
                    temperature=BAD_TEMPERATURE,
                    seed=turn,
                )
            order = list(results) if (turn + index) % 2 == 0 else list(reversed(results))
            for path, setting in order:
                result = results[path, setting]
                if path == "in_process":
                    in_process.send(result, prompt, setting)
                elif setting == "off":
                    served.send(result, prompt, **greedy, speculation="off")
                elif setting == "policy":
                    served.send(result, prompt, **greedy)
                else:  # a fixed k every round
                    fixed = {"speculation": "on", "num_speculative_tokens": setting}
                    served.send(result, prompt, **greedy, **fixed)
    finally:
        served.close()
    bad_spec = bad.speculative_decoding
    return {
        "draft_placement": served.draft_placement,
        "bad_request": {
            "tokens": len(bad.token_ids),
            "drafted": int(bad_spec.get("num_draft_tokens", 0)),
            "accepted": int(bad_spec.get("num_accepted_tokens", 0)),
        },
        "in_process": {k: results["in_process", k] for k in (0, *config.fixed_ks)},
        "policy": results["served", "policy"],
        "off": results["served", "off"],
        "fixed": {k: results["served", k] for k in config.fixed_ks},
    }


def run_served_speedup_bench(config: ServedSpeedupConfig = ServedSpeedupConfig()) -> dict:
    prompts = chat_prompts(config.num_prompts)
    measured = _measure(config, prompts)
    in_process = measured["in_process"]
    base = in_process[0].tokens_per_s
    speedups = {k: result.tokens_per_s / base for k, result in in_process.items() if k}
    best_k = max(speedups, key=speedups.get)
    served_off = measured["off"].tokens_per_s
    served_speedup = measured["policy"].tokens_per_s / served_off
    served_fixed = {k: result.tokens_per_s / served_off for k, result in measured["fixed"].items()}
    served_best_k = max(served_fixed, key=served_fixed.get)
    identical = sum(
        a == b for a, b in zip(measured["policy"].outputs, measured["off"].outputs, strict=True)
    )
    same_as_in_process = sum(
        a == b for a, b in zip(measured["off"].outputs, in_process[0].outputs, strict=True)
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
            "draft_placement": measured["draft_placement"],
            "bad_request": measured["bad_request"],
            "policy": row(measured["policy"]),
            "off": row(measured["off"]),
            "fixed": {str(k): row(result) for k, result in measured["fixed"].items()},
        },
        # the path's cost of speculating: its best fixed k against the in-process best
        "served_best_fixed_k": served_best_k,
        "served_best_fixed_speedup": round(served_fixed[served_best_k], 4),
        "served_fixed_over_in_process": round(served_fixed[served_best_k] / speedups[best_k], 4),
        # the policy's choices: the policy against the served best fixed k
        "policy_over_served_best_fixed": round(served_speedup / served_fixed[served_best_k], 4),
        "served_speedup": round(served_speedup, 4),
        "served_over_in_process": round(served_speedup / speedups[best_k], 4),
        "greedy_outputs_identical_on_off": f"{identical}/{len(measured['off'].outputs)}",
        "greedy_outputs_identical_served_in_process": (
            f"{same_as_in_process}/{len(measured['off'].outputs)}"
        ),
    }


def format_served_speedup(report: dict) -> str:
    lines = [
        f"{report['prompts']} chat prompts, greedy, {report['config']['max_tokens']} tokens, "
        f"{report['config']['num_threads']} torch thread(s) per process",
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
        f"served (draft {served['draft_placement']}): bad request first ({bad['accepted']}/"
        f"{bad['drafted']} drafted accepted)",
        f"  policy       {served['policy']['tokens_per_s']:8.2f} tok/s  accepted "
        f"{served['policy']['accepted']}/{served['policy']['drafted']}",
        f"  off          {served['off']['tokens_per_s']:8.2f} tok/s",
        *(
            f"  on, k={k:<7} {row['tokens_per_s']:8.2f} tok/s  accepted {row['accepted']}"
            f"/{row['drafted']}"
            for k, row in served["fixed"].items()
        ),
        f"speedup: served {report['served_speedup']:.3f}x, in process (k="
        f"{report['in_process_best_k']}) {report['in_process_speedup']:.3f}x, ratio "
        f"{report['served_over_in_process']:.3f} (goal >= 0.9)",
        f"  served best fixed k={report['served_best_fixed_k']}: "
        f"{report['served_best_fixed_speedup']:.3f}x ("
        f"{report['served_fixed_over_in_process']:.3f} of in process); the policy "
        f"{report['policy_over_served_best_fixed']:.3f} of it",
    ]
    return "\n".join(lines)
