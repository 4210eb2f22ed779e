"""``specray simulate --config FILE``: simulate a deployment and print one row per sweep point.

Wire into ``specray.cli``: ``add_simulate_parser(commands)`` and the handler ``run_simulate``;
``python -m specray.sim --config FILE`` works on its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="simulation config (.yaml or .json)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="worker processes for the sweep's runs (default: one per CPU)",
    )


def add_simulate_parser(commands) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to an ``add_subparsers()`` object."""
    parser = commands.add_parser(
        "simulate", help="discrete-event simulation of a cluster (sizing, k, RTT)"
    )
    add_simulate_arguments(parser)
    return parser


def _json_value(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def run_simulate(args: argparse.Namespace) -> int:
    from specray.sim import format_table, load_sim_config, simulate

    config = load_sim_config(args.config)
    started = time.perf_counter()
    points = len(config.points())
    print(f"specray: simulating {config.name!r}: {points} point(s)", file=sys.stderr)

    def progress(row: dict) -> None:
        if args.json:
            print(json.dumps({key: _json_value(value) for key, value in row.items()}), flush=True)

    rows = simulate(
        config,
        on_row=progress,
        processes=args.processes or os.cpu_count() or 1,
    )
    if not args.json:
        print(format_table(rows))
    print(f"specray: {points} point(s) in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specray simulate", description=__doc__)
    add_simulate_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_simulate(args)
    except ValueError as error:
        print(f"specray: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
