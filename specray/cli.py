"""``specray`` command line: serve, generate, bench, simulate."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time


def _draft_arg(value: str) -> str | None:
    return None if value.lower() in {"none", "off", ""} else value


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="'default', a model dir or .gguf")
    parser.add_argument(
        "--draft",
        type=_draft_arg,
        default="default",
        help="'none', 'ngram', 'self:auto|bf16|fp16|fp32|int8', 'distilled[:fp32|fp16|bf16]' "
        "(shipped for the default target), a distilled draft or model dir / .gguf, "
        "'ngram+<one of those>', or "
        "'default' / 'auto' (the drafter `specray bench --drafters all --record` measured best)",
    )
    parser.add_argument("--k", type=int, default=4, help="speculative tokens per round")
    parser.add_argument(
        "--draft-probs-encoding", default="fp32", help="fp32 | fp16 | bf16 | top<M> (exact)"
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="run on Ray: 'auto' (embedded local Ray) or a cluster address; default in process",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="target tensor-parallel ranks")
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (a GPU when one is visible, else the CPU) | cpu | cuda | cuda:N",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA, float32 on the CPU) | float32 | bfloat16 | float16",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the target's logits for a token identical in any batch and with or without "
        "speculation (slower)",
    )


def _build_parser() -> argparse.ArgumentParser:
    from specray.cluster.placement import DRAFT_PLACEMENTS  # (no torch: --help stays quick)

    parser = argparse.ArgumentParser(prog="specray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one prompt")
    generate.add_argument("--prompt", required=True)
    _add_model_args(generate)
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0)
    generate.add_argument("--presence-penalty", type=float, default=0.0)
    generate.add_argument("--frequency-penalty", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--no-chat-template", action="store_true")
    generate.add_argument("--json", action="store_true", help="print one JSON object")
    generate.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="send the request to a running server's gRPC API (the client library) instead "
        "of loading the models here",
    )
    generate.add_argument("--token", default=None, help="bearer token for --server")

    bench = commands.add_parser("bench", help="side-by-side speed and acceptance benchmark")
    bench.add_argument("--target", default=None, help="'default' (bundled), a dir or .gguf")
    bench.add_argument("--k", default="ngram=4,default=4", help="N, or drafter=N pairs")
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--num-prompts", type=int, default=None, help="24 (12 with --drafters)")
    bench.add_argument("--batch-size", type=int, default=8, help="for the batched comparison")
    bench.add_argument("--skip-transformers", action="store_true")
    bench.add_argument(
        "--backend",
        choices=["local", "distributed"],
        default="local",
        help="distributed: the distribution tax on a local multi-node Ray cluster",
    )
    bench.add_argument(
        "--concurrency",
        metavar="1,4,16",
        help="the coordinator under closed-loop load: target-only vs unpipelined vs pipelined "
        "on a local multi-node Ray cluster (draft and target nodes, one core each)",
    )
    bench.add_argument("--draft", default="default", help="drafter for --concurrency")
    bench.add_argument("--requests-per-client", type=int, default=2, help="for --concurrency")
    bench.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="for --overhead and --serving: turns of every path (summed)",
    )
    bench.add_argument(
        "--draft-deadline",
        type=float,
        default=5.0,
        help="for --concurrency: seconds the target waits for a block before going alone",
    )
    bench.add_argument(
        "--overhead",
        metavar="1,16",
        help="serving overhead: Engine.generate in process vs the served app by gRPC and HTTP "
        "at these concurrencies (target 'tiny' by default: a random model made here, so the "
        "figures are the machinery's)",
    )
    bench.add_argument(
        "--serving",
        action="store_true",
        help="the served app's speculation policy (a badly-drafted request first, then the chat "
        "prompts with speculation on and off) against the in-process engine's best fixed k",
    )
    bench.add_argument(
        "--draft-placement",
        choices=DRAFT_PLACEMENTS,
        help="for --serving: where the served app runs its draft (default: the app's, auto); "
        "for --concurrency: on the draft node (workers, the default) or in the target's process",
    )
    bench.add_argument(
        "--steps",
        metavar="1,4,16",
        help="one target forward (a decode step and a k=4 verification) at these batch sizes: "
        "specray's runner vs transformers' DynamicCache, side by side",
    )
    bench.add_argument(
        "--contexts", default="64,256", help="for --steps: cached tokens per sequence"
    )
    bench.add_argument(
        "--mixed-prompts",
        default="16,64",
        help="for --steps: new prompts' lengths, each prefilled in one forward beside the "
        "others' decode step (packed against padded)",
    )
    bench.add_argument(
        "--drafters",
        metavar="all|A,B",
        help="every drafter (ngram, self:bf16|fp16|int8, distilled:fp32|fp16|int8, ngram+X...) "
        "on the held-out prompts, each at its measured best k; --num-prompts defaults to 12 here",
    )
    bench.add_argument(
        "--pipelined-top",
        type=int,
        default=0,
        help="with --drafters: the N fastest also run pipelined (draft and target on separate "
        "one-core Ray nodes)",
    )
    bench.add_argument(
        "--record",
        action="store_true",
        help="with --drafters: record the winner as what draft='auto' / 'default' resolve to",
    )
    bench.add_argument(
        "--tp-memory",
        action="store_true",
        help="peak memory of a target rank loading a random ~1.1B model at TP = 1 and TP = 2",
    )
    bench.add_argument(
        "--verify",
        action="store_true",
        help="the verification rules alone on random data: one round's cost against a softmax",
    )
    bench.add_argument("--vocab", type=int, default=128256, help="for --verify")
    bench.add_argument("--batch", type=int, default=16, help="for --verify: requests per round")
    bench.add_argument(
        "--verify-k", type=int, default=None, help="for --verify: draft tokens (or --k N; 4)"
    )
    bench.add_argument("--encoding", default="top64", help="for --verify: q on the wire")
    bench.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process, for --verify and --serving (both paths)",
    )
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument(
        "--plot", metavar="FILE.png", help="a PNG of the main, --concurrency or --drafters report"
    )

    from specray.distill.cli import add_distill_parser
    from specray.ops.cli import add_cluster_parser
    from specray.serve.cli import add_serve_parser
    from specray.sim.cli import add_simulate_parser

    add_serve_parser(commands)
    add_cluster_parser(commands)
    add_simulate_parser(commands)
    add_distill_parser(commands)
    return parser


def _sampling_fields(args: argparse.Namespace) -> dict:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }


def _generate_remote(args: argparse.Namespace) -> int:
    """Through the client library: streams the text as it is committed."""
    from specray.client import Client
    from specray.prompts import user_turn

    fields = _sampling_fields(args)
    if fields["seed"] is None:
        del fields["seed"]
    prompt = (
        {"prompt": args.prompt} if args.no_chat_template else {"messages": user_turn(args.prompt)}
    )
    from specray.client import SpecrayClientError

    try:
        with Client(args.server, token=args.token) as client:
            completion = None
            for chunk in client.stream(**prompt, num_speculative_tokens=args.k, **fields):
                if not args.json:
                    print(chunk.text, end="", flush=True)
                completion = chunk.completion or completion
    except SpecrayClientError as error:
        print(f"specray: error: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    spec = dict(completion.speculative_decoding)
    if args.json:
        record = {
            "request_id": completion.request_id,
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "seed": completion.seed,
            "usage": completion.usage,
            "speculative_decoding": spec | {"num_accepted_tokens_per_pos": list(
                spec.get("num_accepted_tokens_per_pos", ())
            )},
        }  # fmt: skip
        _print_json(json.dumps(record))
    else:
        print()
        print(
            f"[{completion.completion_tokens} tokens, acceptance "
            f"{spec.get('acceptance_rate', 0.0):.2f}, finish {completion.finish_reason}, "
            f"seed {completion.seed}]",
            file=sys.stderr,
        )
    return 0


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    from specray import Engine, SamplingParams

    params = SamplingParams(**_sampling_fields(args))
    print(f"specray: loading target={args.target} draft={args.draft}", file=sys.stderr)
    engine = Engine(
        args.target,
        draft=args.draft,
        num_speculative_tokens=args.k,
        draft_probs_encoding=args.draft_probs_encoding,
        cluster=args.cluster,
        tp_size=args.tp_size,
        device=args.device,
        dtype=args.dtype,
        batch_invariant=args.batch_invariant,
    )
    try:
        started = time.perf_counter()
        output = engine.generate(
            [args.prompt], params, use_chat_template=not args.no_chat_template
        )[0]
        wall_s = time.perf_counter() - started
    finally:
        engine.shutdown()
    record = output.to_dict() | {
        "wall_s": wall_s,
        "tokens_per_s": len(output.token_ids) / wall_s if wall_s > 0 else 0.0,
    }
    record.update(record.pop("metrics"))
    if args.json:
        _print_json(json.dumps(record))
    else:
        print(output.text)
        print(
            f"[{len(output.token_ids)} tokens, {record['tokens_per_s']:.1f} tok/s, "
            f"acceptance {output.metrics.acceptance_rate:.2f}, mean accepted length "
            f"{output.metrics.mean_acceptance_length:.2f}, finish {output.finish_reason}, "
            f"seed {output.seed}]",
            file=sys.stderr,
        )
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from specray.sim.cli import run_simulate

    return run_simulate(args)


def _serving_bench(args: argparse.Namespace) -> int:
    from specray.bench.serving import (
        ServingBenchConfig,
        parse_concurrency,
        print_serving_report,
        run_serving_bench,
    )

    config = ServingBenchConfig(
        target=args.target,
        draft=args.draft,
        concurrency=parse_concurrency(args.concurrency),
        max_tokens=args.max_tokens,
        requests_per_client=args.requests_per_client,
        draft_deadline_s=args.draft_deadline,
        draft_placement=args.draft_placement or "workers",
    )
    report = run_serving_bench(config)
    if args.json:
        _print_json(json.dumps(report, indent=2))
    else:
        print_serving_report(report)
    _write_plot(args, report)
    return 0


def _overhead_bench(args: argparse.Namespace) -> int:
    from specray.bench.overhead import OverheadConfig, format_overhead, run_overhead_bench
    from specray.bench.serving import parse_concurrency

    config = OverheadConfig(
        target=args.target or "tiny",
        draft=_draft_arg(args.draft) if args.draft != "default" else None,
        max_tokens=args.max_tokens,
        concurrency=parse_concurrency(args.overhead),
        requests_per_client=args.requests_per_client,
        repeats=args.repeats,
    )
    report = run_overhead_bench(config)
    _print_json(json.dumps(report, indent=2) if args.json else format_overhead(report))
    return 0


def _steps_bench(args: argparse.Namespace) -> int:
    from specray.bench.serving import parse_concurrency
    from specray.bench.steps import StepsConfig, format_steps, run_steps_bench

    config = StepsConfig(
        target=args.target,
        batches=parse_concurrency(args.steps, param="--steps"),
        contexts=parse_concurrency(args.contexts, param="--contexts"),
        mixed_prompts=parse_concurrency(args.mixed_prompts, param="--mixed-prompts"),
    )
    report = run_steps_bench(config)
    _print_json(json.dumps(report, indent=2) if args.json else format_steps(report))
    return 0


def _verify_bench(args: argparse.Namespace) -> int:
    from specray.bench.verify import VerifyBenchConfig, format_verify, run_verify_bench

    config = VerifyBenchConfig(
        vocab=args.vocab,
        batch=args.batch,
        k=args.verify_k or (int(args.k) if args.k.isdigit() else 4),
        encoding=args.encoding,
        threads=args.threads,
    )
    report = run_verify_bench(config)
    _print_json(json.dumps(report, indent=2) if args.json else format_verify(report))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from specray.bench.main import (
        BenchConfig,
        parse_k,
        print_report,
        run_bench,
        run_distributed_bench,
    )

    _bench_plotter(args)  # refuses --plot where there is no plot before anything runs
    if args.verify:
        return _verify_bench(args)
    if args.overhead:
        return _overhead_bench(args)
    if args.serving:
        from specray.bench.served_speedup import (
            ServedSpeedupConfig,
            format_served_speedup,
            run_served_speedup_bench,
        )

        config = ServedSpeedupConfig(
            target=args.target or "default",
            draft=args.draft,
            max_tokens=args.max_tokens,
            num_prompts=args.num_prompts,
            num_threads=args.threads,
            repeats=args.repeats,
            draft_placement=args.draft_placement,
        )
        report = run_served_speedup_bench(config)
        _print_json(json.dumps(report, indent=2) if args.json else format_served_speedup(report))
        return 0
    if args.tp_memory:
        from specray.bench.tp_memory import format_report, run_tp_memory

        report = run_tp_memory()
        if args.json:
            _print_json(json.dumps(report, indent=1))
        else:
            print(format_report(report))
        return 0
    args.target = args.target or "default"
    if args.steps:
        return _steps_bench(args)
    if args.concurrency:
        return _serving_bench(args)
    if args.drafters:
        return _drafters_bench(args)
    config = BenchConfig(
        target=args.target,
        k=parse_k(args.k),
        max_tokens=args.max_tokens,
        num_prompts=24 if args.num_prompts is None else args.num_prompts,
        batch_size=args.batch_size,
        compare_transformers=not args.skip_transformers,
    )
    if args.backend == "distributed":
        report = run_distributed_bench(config)
        _print_json(json.dumps(report, indent=2))
        return 0
    report = run_bench(config)
    if args.json:
        _print_json(json.dumps(report, indent=2))
    else:
        print_report(report)
    _write_plot(args, report)
    return 0


def _bench_plotter(args: argparse.Namespace):
    """The function that draws this bench mode's report for ``--plot`` (None without it), in
    the order ``_bench`` picks the mode; a ValueError naming --plot for a mode without one."""
    if not args.plot:
        return None
    from specray.bench import plots

    modes = {"--verify": args.verify, "--overhead": args.overhead, "--serving": args.serving,
             "--tp-memory": args.tp_memory, "--steps": args.steps,
             "--concurrency": args.concurrency, "--drafters": args.drafters,
             "--backend distributed": args.backend == "distributed"}  # fmt: skip
    flag = next((flag for flag, on in modes.items() if on), "")
    plot = {"": plots.plot_bench_report, "--concurrency": plots.plot_serving_report,
            "--drafters": plots.plot_drafters_report}.get(flag)  # fmt: skip
    if plot is None:
        raise ValueError(f"--plot draws the main bench, --concurrency and --drafters, not {flag}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise ValueError(f"--plot: no directory for {args.plot!r}")
    return plot


def _write_plot(args: argparse.Namespace, report: dict) -> None:
    plot = _bench_plotter(args)
    if plot is not None:
        plot(report, args.plot)
        print(f"specray: plot written to {args.plot}", file=sys.stderr)


def _drafters_bench(args: argparse.Namespace) -> int:
    from specray.bench.drafters import (
        DraftersBenchConfig,
        parse_drafters,
        print_drafters_report,
        run_drafters_bench,
    )

    config = DraftersBenchConfig(
        target=args.target,
        drafters=parse_drafters(args.drafters),
        max_tokens=args.max_tokens,
        num_prompts=12 if args.num_prompts is None else args.num_prompts,
        pipelined_top=args.pipelined_top,
        record=args.record,
    )
    report = run_drafters_bench(config)
    if args.json:
        _print_json(json.dumps(report, indent=2))
    else:
        print_drafters_report(report)
    _write_plot(args, report)
    return 0


_report_stream = sys.stdout  # where this command's --json report goes (see main)


def _print_json(text: str) -> None:
    print(text, file=_report_stream, flush=True)


def main(argv: list[str] | None = None) -> int:
    global _report_stream
    args = _build_parser().parse_args(argv)
    _report_stream = sys.stdout
    if args.command not in ("generate", "bench") or not args.json:
        return _main(args)
    # Only the report on stdout: whatever else writes there meanwhile (progress; Ray's lines,
    # from this process or the ones it starts) goes to stderr, so that the output parses.
    original = sys.stdout
    with _stdout_descriptor_to_stderr(original) as report:
        _report_stream, sys.stdout = report, sys.stderr
        try:
            return _main(args)
        finally:
            sys.stdout = original


@contextlib.contextmanager
def _stdout_descriptor_to_stderr(stdout):
    """Yields the stream the report goes to. When ``stdout`` writes to file descriptor 1, the
    descriptor points at stderr while inside (child processes and native code write there)
    and the report goes to a copy of the original; otherwise (a test's capture), ``stdout``."""
    try:
        on_descriptor_1 = stdout.fileno() == 1
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        on_descriptor_1 = False
    if not on_descriptor_1:
        yield stdout
        return
    stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w") as report:
            yield report
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _main(args: argparse.Namespace) -> int:
    from specray.distill.cli import run_distill_cli
    from specray.ops.cli import run_cluster
    from specray.serve.cli import run_serve

    handlers = {
        "generate": _generate,
        "bench": _bench,
        "simulate": _simulate,
        "serve": run_serve,
        "cluster": run_cluster,
        "distill": run_distill_cli,
    }
    try:
        return handlers[args.command](args)
    except ValueError as error:  # invalid input: one clear line, no traceback
        print(f"specray: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
