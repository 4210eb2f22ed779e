"""``specray distill --target T --out DIR``: train a compact draft for a causal LM target."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from specray.distill.config import STDLIB, DistillConfig
from specray.distill.pipeline import LOG_FILE, PHASES

# CLI flag -> config field (every field is settable; the defaults are DistillConfig's).
_FLAGS = {field.name: "--" + field.name.replace("_", "-") for field in fields(DistillConfig)}


def add_distill_parser(commands) -> None:
    parser = commands.add_parser(
        "distill",
        help="distil a compact draft model from a target (resumable)",
        description="Generate the target's own answers, train a small draft against its "
        "distribution, and write a draft directory that --draft accepts. Rerunning with the "
        "same --out resumes: finished data shards and the last checkpoint are kept.",
    )
    parser.add_argument("--out", required=True, help="run directory (data, checkpoint, draft)")
    parser.add_argument("--phase", choices=PHASES, default="all")
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="end this session's training at this step (checkpointed; rerun to continue)",
    )
    parser.add_argument(
        "--background", action="store_true", help=f"detach; progress goes to OUT/{LOG_FILE}"
    )
    defaults = DistillConfig()
    for field in fields(DistillConfig):
        value = getattr(defaults, field.name)
        if isinstance(value, tuple):  # a list of paths: --local-text DIR FILE ...
            parser.add_argument(
                _FLAGS[field.name],
                dest=field.name,
                nargs="+",
                default=None,
                metavar="PATH",
                help=f"files or directories ('{STDLIB}': Python's standard library; default none)",
            )
            continue
        kind = {bool: _bool, int: int, float: float}.get(type(value), str)
        parser.add_argument(
            _FLAGS[field.name],
            dest=field.name,
            type=kind,
            default=None,
            help=f"(default {value!r})",
        )


def _bool(text: str) -> bool:
    if text.lower() in {"1", "true", "yes", "on"}:
        return True
    if text.lower() in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _foreground_argv(args: argparse.Namespace, explicit: set[str]) -> list[str]:
    """The same command without ``--background`` (for the detached process)."""
    argv = ["distill", "--out", str(args.out), "--phase", args.phase]
    if args.stop_at_step is not None:
        argv += ["--stop-at-step", str(args.stop_at_step)]
    for name in sorted(explicit):
        value = getattr(args, name)
        if isinstance(value, list):
            argv += [_FLAGS[name], *value]
            continue
        argv += [_FLAGS[name], str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def run_distill_cli(args: argparse.Namespace) -> int:
    from specray.distill.pipeline import resolve_config, run_distill

    explicit = {name for name in _FLAGS if getattr(args, name) is not None}
    requested = DistillConfig(**{name: getattr(args, name) for name in explicit})
    out = Path(args.out)
    config = resolve_config(out, requested, explicit)
    if args.background:
        out.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "specray.cli", *_foreground_argv(args, explicit)]
        with (out / LOG_FILE).open("a") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        print(f"specray: distilling in the background (pid {process.pid}); follow {out / LOG_FILE}")
        return 0
    summary = run_distill(out, config, args.phase, args.stop_at_step)
    print(json.dumps(summary, indent=2))
    return 0
