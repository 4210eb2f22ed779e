"""``specray bench --plot``: each bench's figure holds one bar per (configuration, series) and
one acceptance curve per speculative row, drawn from reports shaped as the benches build them;
``--plot`` with a bench that has no figure is refused before anything runs."""

from __future__ import annotations

import struct

import pytest

from specray import cli
from specray.bench.drafters import acceptance_fields
from specray.bench.main import _row
from specray.bench.plots import (
    DPI,
    plot_bench_report,
    plot_drafters_report,
    plot_serving_report,
)
from specray.outputs import SpecDecodeMetrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics_of(rounds: list[tuple[int, int]]) -> SpecDecodeMetrics:
    """Counters after verification rounds of (draft tokens, accepted tokens)."""
    metrics = SpecDecodeMetrics()
    for num_draft_tokens, num_accepted in rounds:
        metrics.record(num_draft_tokens, num_accepted)
    return metrics


def assert_png(path, figure) -> None:
    """A PNG of the figure's size in pixels (IHDR: width and height, big-endian, at byte 16)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000  # drawn, not blank
    width_px, height_px = struct.unpack(">II", data[16:24])
    width_in, height_in = figure.get_size_inches()
    assert (width_px, height_px) == (round(width_in * DPI), round(height_in * DPI))


def bar_counts(axis) -> dict[str, int]:
    return {container.get_label(): len(container) for container in axis.containers}


def bar_heights(axis, label: str, *, horizontal: bool = False) -> list[float]:
    (container,) = [c for c in axis.containers if c.get_label() == label]
    return [bar.get_width() if horizontal else bar.get_height() for bar in container]


# --- the concurrency bench (specray.bench.serving.run_serving_bench) ---

ROUNDS = {  # (draft tokens, accepted) per round, per speculative schedule
    "unpipelined": [(4, 4), (4, 2), (4, 0), (2, 1)],
    "pipelined": [(4, 3), (3, 3), (4, 1)],
}


def serving_row(concurrency: int, mode: str, tokens_per_s: float, *, drafts: bool) -> dict:
    """The fields of ``_run_mode``'s row that the figure reads (``metrics`` is
    ``SpecDecodeMetrics.to_dict()``), beside a few it does not."""
    metrics = metrics_of(ROUNDS[mode] if drafts and mode in ROUNDS else [(0, 0)] * 3)
    return {
        "concurrency": concurrency,
        "mode": mode,
        "tokens_per_s": tokens_per_s,
        "requests": 2 * concurrency,
        "acceptance_rate": metrics.acceptance_rate,
        "mean_acceptance_length": metrics.mean_acceptance_length,
        "mean_k": metrics.num_draft_tokens / max(metrics.num_drafts, 1),
        "metrics": metrics.to_dict(),
        "coordinator": {"max_running": concurrency, "num_speculative_tokens": 8},
    }


def serving_report(levels: tuple[int, ...], *, drafts: bool = True) -> dict:
    """As ``run_serving_bench`` returns it: three schedules per concurrency with speedups over
    that concurrency's target-only row, then the in-process Engine's row per concurrency."""
    rows = []
    for level in levels:
        for mode, tokens_per_s in (("target-only", 10.0), ("unpipelined", 12.0), ("pipelined", 15)):
            rows.append(serving_row(level, mode, tokens_per_s * level**0.5, drafts=drafts))
    by_key = {(row["concurrency"], row["mode"]): row for row in rows}
    for row in rows:
        row["speedup"] = (
            row["tokens_per_s"] / by_key[(row["concurrency"], "target-only")]["tokens_per_s"]
        )
    for level in levels:
        rows.append(
            {
                "concurrency": level,
                "mode": "in-process",
                "tokens_per_s": 11.0 * level,
                "requests": 2 * level,
                "acceptance_rate": 0.5,
                "mean_acceptance_length": 2.0,
                "num_speculative_tokens": 4,
                "speedup": 11.0 * level / by_key[(level, "target-only")]["tokens_per_s"],
            }
        )
    config = {"target": "default", "draft": "default" if drafts else "none", "concurrency": levels}
    return {"config": config, "calibration": {}, "rows": rows, "acceptance_traces": None}


def test_serving_plot_bars_per_concurrency_and_acceptance_per_position(tmp_path):
    report = serving_report((1, 4, 16))
    figure = plot_serving_report(report, str(tmp_path / "serving.png"))
    assert_png(tmp_path / "serving.png", figure)
    throughput, speedup, acceptance = figure.axes
    modes = ("target-only", "unpipelined", "pipelined", "in-process")
    assert bar_counts(throughput) == dict.fromkeys(modes, 3)  # one bar per concurrency
    expected = [row["tokens_per_s"] for row in report["rows"] if row["mode"] == "pipelined"]
    assert bar_heights(throughput, "pipelined") == pytest.approx(expected)
    assert bar_counts(speedup) == dict.fromkeys(modes[1:], 3)  # target-only is the 1.0 line
    assert bar_heights(speedup, "pipelined") == pytest.approx([1.5] * 3)
    # One curve per speculative row; position j: rounds accepting it over rounds with drafts.
    curves = {line.get_label(): list(line.get_ydata()) for line in acceptance.get_lines()}
    assert len(curves) == 2 * 3
    assert curves["unpipelined, concurrency 4"] == pytest.approx([3 / 4, 2 / 4, 1 / 4, 1 / 4])
    assert curves["pipelined, concurrency 16"] == pytest.approx([1.0, 2 / 3, 2 / 3, 0.0])
    assert all(axis.get_title() and axis.get_ylabel() for axis in figure.axes)


def test_serving_plot_without_drafts_has_no_acceptance_panel_and_widens_with_levels(tmp_path):
    narrow = plot_serving_report(serving_report((1,), drafts=False), str(tmp_path / "a.png"))
    wide = plot_serving_report(
        serving_report(tuple(range(1, 9)), drafts=False), str(tmp_path / "b.png")
    )
    assert_png(tmp_path / "b.png", wide)
    assert len(narrow.axes) == len(wide.axes) == 2
    assert bar_counts(wide.axes[0])["target-only"] == 8
    assert wide.get_size_inches()[0] > narrow.get_size_inches()[0]


# --- the drafters bench (specray.bench.drafters.run_drafters_bench) ---


def test_drafters_plot_of_a_report_without_per_position_counts(tmp_path):
    """Reports written before the rows carried per-position counts: the first position."""
    report = drafters_report(pipelined=False)
    for row in report["rows"]:
        row.pop("acceptance_per_position", None)
    figure = plot_drafters_report(report, str(tmp_path / "old.png"))
    assert bar_counts(figure.axes[2]) == {
        "position 1 (measured)": 2,
        "α per position (fitted to E)": 2,
    }


def drafter_row(draft: str, k: int, tokens_per_s: float, baseline_tps: float, metrics) -> dict:
    """A row as ``run_drafters_bench`` builds it from the measured counters."""
    row = {
        "draft": draft,
        "k": k,
        "tokens_per_s": round(tokens_per_s, 3),
        "speedup": round(tokens_per_s / baseline_tps, 3),
        "matches_target_only": True,
        "calibration_alpha": 0.5,
        "calibration_bound": 1.4,
    }
    if metrics.num_draft_tokens:
        row |= acceptance_fields(metrics, k) | {"draft_profile": None}
    return row


def drafters_report(*, pipelined: bool) -> dict:
    baseline = {"draft": "none", "k": 0, "tokens_per_s": 20.0, "speedup": 1.0}
    rows = [
        baseline | {"matches_target_only": True},
        drafter_row("ngram", 4, 26.0, 20.0, metrics_of([(4, 4), (4, 1), (4, 0)])),
        drafter_row("self:int8", 3, 31.0, 20.0, metrics_of([(3, 3), (3, 2)])),
        drafter_row("ngram+distilled", 4, 18.0, 20.0, metrics_of([])),  # never drafted
    ]
    rows[3]["matches_target_only"] = False
    report = {
        "config": {"target": "default", "num_prompts": 12, "max_tokens": 64},
        "machine": {"torch_threads": 2},
        "target_step_ms": 40.0,
        "verify_ratio": {1: 1.1, 2: 1.2},
        "rows": rows,
        "winner": {"draft": "self:int8", "k": 3},
    }
    if pipelined:
        report["pipelined"] = [
            {
                "draft": draft,
                "target_only_tokens_per_s": 9.0,
                "unpipelined_tokens_per_s": 11.0,
                "pipelined_tokens_per_s": pipelined_tps,
                "speedup": pipelined_tps / 9.0,
                "acceptance_rate": 0.6,
                "mean_k": 3.5,
                "fraction_of_bound": 0.8,
                "matches_target_only": True,
            }
            for draft, pipelined_tps in (("self:int8", 14.0), ("ngram", 12.0))
        ]
    return report


@pytest.mark.parametrize("pipelined", [False, True])
def test_drafters_plot_bars_per_drafter(tmp_path, pipelined):
    report = drafters_report(pipelined=pipelined)
    figure = plot_drafters_report(report, str(tmp_path / "drafters.png"))
    assert_png(tmp_path / "drafters.png", figure)
    assert len(figure.axes) == (4 if pipelined else 3)
    throughput, speedup, acceptance = figure.axes[:3]
    assert bar_counts(throughput) == {"tokens/s": 4}
    labels = [tick.get_text() for tick in throughput.get_yticklabels()]
    assert labels == [
        "target-only",
        "ngram k=4",
        "self:int8 k=3",
        "ngram+distilled k=4 (output differs)",
    ]
    assert bar_heights(throughput, "tokens/s", horizontal=True) == [20.0, 26.0, 31.0, 18.0]
    assert bar_heights(speedup, "speedup", horizontal=True) == [1.3, 1.55, 0.9]
    # Acceptance only for the drafters that drafted: measured per position (ngram drafted 4,
    # self:int8 3), fitted α.
    assert bar_counts(acceptance) == {
        "position 1 (measured)": 2,
        "position 2 (measured)": 2,
        "position 3 (measured)": 2,
        "position 4 (measured)": 1,
        "α per position (fitted to E)": 2,
    }
    first = bar_heights(acceptance, "position 1 (measured)", horizontal=True)
    assert first == pytest.approx([2 / 3, 1.0], abs=1e-4)  # rounded to 4 places
    third = bar_heights(acceptance, "position 3 (measured)", horizontal=True)
    assert third == pytest.approx([1 / 3, 0.5], abs=1e-4)
    if pipelined:
        served = figure.axes[3]
        assert bar_counts(served) == {"target-only": 2, "unpipelined": 2, "pipelined": 2}
        assert bar_heights(served, "pipelined", horizontal=True) == [14.0, 12.0]
    assert all(axis.get_title() and axis.get_xlabel() for axis in figure.axes)


# --- the main bench (specray.bench.main.run_bench) ---


def test_main_plot_one_bar_per_configuration(tmp_path):
    outputs = [[1, 2, 3]]
    runs = {
        "specray target-only": {"tokens": 64, "wall_s": 4.0, "tokens_per_s": 16.0},
        "transformers generate": {"tokens": 64, "wall_s": 5.0, "tokens_per_s": 12.8},
        "specray draft=ngram k=4": {"tokens": 64, "wall_s": 2.0, "tokens_per_s": 32.0},
    }
    rows = [_row(name, run | {"outputs": outputs}, 16.0, outputs) for name, run in runs.items()]
    figure = plot_bench_report({"rows": rows, "batched": []}, str(tmp_path / "main.png"))
    assert_png(tmp_path / "main.png", figure)
    (axis,) = figure.axes
    (bars,) = axis.containers
    assert sorted(bar.get_width() for bar in bars) == [12.8, 16.0, 32.0]


# --- the command line ---


def bench_args(*argv: str):
    return cli._build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize(
    "argv, plot",
    [
        ((), plot_bench_report),
        (("--concurrency", "1,4"), plot_serving_report),
        (("--drafters", "all"), plot_drafters_report),
        (("--concurrency", "1", "--backend", "distributed"), plot_serving_report),
    ],
)
def test_plot_dispatches_by_bench_mode(tmp_path, argv, plot):
    assert cli._bench_plotter(bench_args(*argv, "--plot", str(tmp_path / "x.png"))) is plot
    assert cli._bench_plotter(bench_args(*argv)) is None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--verify",), "--verify"),
        (("--overhead", "1"), "--overhead"),
        (("--serving",), "--serving"),
        (("--tp-memory",), "--tp-memory"),
        (("--steps", "1", "--concurrency", "1"), "--steps"),
        (("--backend", "distributed"), "--backend distributed"),
    ],
)
def test_plot_refused_for_bench_modes_without_a_figure(tmp_path, argv, flag):
    with pytest.raises(ValueError, match=f"--plot .* not {flag}"):
        cli._bench_plotter(bench_args(*argv, "--plot", str(tmp_path / "x.png")))


def test_cli_refuses_plot_before_the_bench_runs(tmp_path, monkeypatch, capsys):
    def never(config):
        raise AssertionError("the bench ran: --plot should have been refused first")

    monkeypatch.setattr("specray.bench.verify.run_verify_bench", never)
    monkeypatch.setattr("specray.bench.drafters.run_drafters_bench", never)
    assert cli.main(["bench", "--verify", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    # A plot into a directory that does not exist: refused up front too.
    missing = str(tmp_path / "no" / "x.png")
    assert cli.main(["bench", "--drafters", "ngram", "--plot", missing]) == 2
    assert "--plot: no directory" in capsys.readouterr().err


def test_the_concurrency_bench_drafts_on_its_draft_node_unless_told():
    """Its cluster has a draft node beside the target's (the pipelined bound assumes the
    draft works in parallel): workers by default, colocated when asked, nothing else."""
    from specray.bench.serving import ServingBenchConfig

    assert ServingBenchConfig().draft_placement == "workers"
    assert ServingBenchConfig(draft_placement="colocated").draft_placement == "colocated"
    with pytest.raises(ValueError, match=r"draft_placement .*'nearby'"):
        ServingBenchConfig(draft_placement="nearby")
