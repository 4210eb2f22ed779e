"""``specray bench --plot FILE.png``: one figure per run, drawn from the report the bench returns
(the dict ``--json`` prints).

One pure function per bench: a report and a path in, a PNG out, and the matplotlib ``Figure``
returned so that a caller (a test) can read what was drawn. Figures are drawn on matplotlib's
Agg canvas directly, without pyplot: no global state, no display needed.

- :func:`plot_bench_report` (the main bench): tokens/s per configuration.
- :func:`plot_serving_report` (``--concurrency``): tokens/s and speedup over target-only per
  concurrency and schedule, and the acceptance per draft position of each speculative row.
- :func:`plot_drafters_report` (``--drafters``): tokens/s and speedup per drafter at its k,
  first-position and fitted per-position acceptance, and the pipelined runs when there are any.

Acceptance at position j (vLLM's per-position rate): the rounds that accepted the j-th drafted
token over the rounds that drafted at all, ``accepted_per_position[j - 1] / num_drafts``.
Worked example: 10 rounds with drafts, ``accepted_per_position = [8, 5, 2]`` -> 0.8, 0.5, 0.2.
"""

from __future__ import annotations

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100
PANEL_HEIGHT_IN = 3.0  # one panel of vertical bars or lines
BAR_HEIGHT_IN = 0.3  # one horizontal bar
MODE_COLORS = {  # the serving bench's schedules (specray.bench.serving.MODES, and in-process)
    "target-only": "tab:gray",
    "unpipelined": "tab:orange",
    "pipelined": "tab:blue",
    "in-process": "tab:green",
}
LEVEL_MARKERS = "os^Dv<>p*h"  # acceptance curves: one marker per concurrency, by its order
LEGEND_WIDTH_IN = 2.0


def _new_figure(width_in: float, height_in: float) -> Figure:
    figure = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(figure)  # the Agg canvas: PNG without a display
    return figure


def _save(figure: Figure, path: str) -> Figure:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    return figure


def _grouped_bars(
    axis: Axes,
    labels: list[str],
    values: dict[str, list[float | None]],
    *,
    horizontal: bool = False,
    colors: dict[str, str] | None = None,
    fmt: str = "%.2f",
) -> None:
    """Bars of ``values[series][group]``, the series side by side within each group (None
    leaves a gap), each series one ``BarContainer`` labelled for the legend, each bar labelled
    with its value. Horizontal: the groups run top to bottom in the order of ``labels``."""
    width = 0.8 / len(values)
    for index, (name, heights) in enumerate(values.items()):
        offset = (index - (len(values) - 1) / 2) * width
        placed = [
            (group + offset, height) for group, height in enumerate(heights) if height is not None
        ]
        if not placed:
            continue
        positions, drawn = zip(*placed, strict=True)
        draw = axis.barh if horizontal else axis.bar
        bars = draw(positions, drawn, width, label=name, color=(colors or {}).get(name))
        axis.bar_label(bars, fmt=fmt, fontsize=7, padding=2)
    if horizontal:
        axis.set_yticks(range(len(labels)), labels)
        axis.invert_yaxis()
        axis.margins(x=0.12)  # room for the value labels (bars start at 0: only the far side)
    else:
        axis.set_xticks(range(len(labels)), labels)
        axis.margins(y=0.12)


def _legend_outside(axis: Axes) -> None:
    """The legend right of the axes, where it hides no bar."""
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_bench_report(report: dict, path: str) -> Figure:
    """The main bench (``specray bench``): tokens/s per configuration, specray's rows in blue,
    transformers' in gray."""
    names = [row["configuration"] for row in report["rows"]]
    values = [row["tokens_per_s"] for row in report["rows"]]
    colors = ["tab:blue" if name.startswith("specray") else "tab:gray" for name in names]
    figure = _new_figure(9, 0.5 * len(names) + 1.5)
    axis = figure.add_subplot()
    axis.barh(names[::-1], values[::-1], color=colors[::-1])
    axis.set_xlabel("tokens / s (batch 1, greedy)")
    axis.set_title("specray bench (batch 1, greedy)")
    return _save(figure, path)


def acceptance_per_position(metrics: dict) -> list[float]:
    """``accepted_per_position[j] / num_drafts`` for each drafted position (see the module
    docstring); [] for a run that never drafted."""
    if not metrics.get("num_drafts"):
        return []
    return [accepted / metrics["num_drafts"] for accepted in metrics["accepted_per_position"]]


def plot_serving_report(report: dict, path: str) -> Figure:
    """The concurrency bench (``--concurrency``). Panels, top to bottom: tokens/s per
    concurrency, one bar per schedule (target-only, unpipelined, pipelined, the in-process
    Engine); speedup over target-only at the same concurrency, one bar per other schedule;
    acceptance per draft position, one line per (schedule, concurrency) row that drafted
    (the panel is left out when none did)."""
    rows = report["rows"]
    levels = list(dict.fromkeys(row["concurrency"] for row in rows))
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    by_key = {(row["concurrency"], row["mode"]): row for row in rows}

    def per_level(mode: str, name: str) -> list[float | None]:
        return [by_key.get((level, mode), {}).get(name) for level in levels]

    curves = [
        (row["mode"], row["concurrency"], acceptance_per_position(row["metrics"]))
        for row in rows
        if acceptance_per_position(row.get("metrics", {}))
    ]
    num_panels = 3 if curves else 2
    width_in = LEGEND_WIDTH_IN + max(6.0, 1.5 + 0.35 * len(levels) * len(modes))
    figure = _new_figure(width_in, PANEL_HEIGHT_IN * num_panels)
    labels = [str(level) for level in levels]

    throughput = figure.add_subplot(num_panels, 1, 1)
    values = {mode: per_level(mode, "tokens_per_s") for mode in modes}
    _grouped_bars(throughput, labels, values, colors=MODE_COLORS, fmt="%.1f")
    throughput.set_xlabel("concurrent closed-loop clients")
    throughput.set_ylabel("tokens / s (all clients)")
    throughput.set_title(
        f"specray bench --concurrency: throughput (draft={report['config']['draft']})"
    )
    _legend_outside(throughput)

    speedup = figure.add_subplot(num_panels, 1, 2)
    values = {mode: per_level(mode, "speedup") for mode in modes if mode != "target-only"}
    _grouped_bars(speedup, labels, values, colors=MODE_COLORS)
    speedup.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="target-only")
    speedup.set_xlabel("concurrent closed-loop clients")
    speedup.set_ylabel("speedup over target-only")
    speedup.set_title("tokens/s over target-only's at the same concurrency")
    _legend_outside(speedup)

    if curves:
        acceptance = figure.add_subplot(num_panels, 1, 3)
        for mode, level, rates in curves:
            acceptance.plot(
                range(1, len(rates) + 1),
                rates,
                marker=LEVEL_MARKERS[levels.index(level) % len(LEVEL_MARKERS)],
                color=MODE_COLORS.get(mode),
                linestyle="-" if mode == "pipelined" else "--",
                label=f"{mode}, concurrency {level}",
            )
        acceptance.set_xticks(range(1, max(len(rates) for _, _, rates in curves) + 1))
        acceptance.set_xlabel("draft position j")
        acceptance.set_ylabel("rounds accepting position j\n/ rounds with drafts")
        acceptance.set_ylim(0.0, 1.05)
        acceptance.set_title("acceptance per draft position (adaptive k)")
        _legend_outside(acceptance)
    return _save(figure, path)


def _drafter_label(row: dict) -> str:
    label = "target-only" if row["draft"] == "none" else f"{row['draft']} k={row['k']}"
    return label if row["matches_target_only"] else f"{label} (output differs)"


def _measured_positions(row: dict) -> list[float]:
    """A drafters row's measured acceptance per position (the first only in older reports)."""
    return row.get("acceptance_per_position") or [row["first_position_acceptance"]]


def plot_drafters_report(report: dict, path: str) -> Figure:
    """The drafters bench (``--drafters``). Panels, top to bottom, one bar group per drafter at
    the k it ran with: tokens/s (target-only included); speedup over target-only; acceptance
    per draft position as measured, one bar per position, and α, the per-position rate fitted
    to the mean acceptance length (reports made before per-position counts show the first
    position only); and, when the run had ``--pipelined-top``, tokens/s through the
    coordinator per schedule."""
    rows = report["rows"]
    drafted = [row for row in rows if row["draft"] != "none"]
    measured = [row for row in drafted if "alpha" in row]
    pipelined = report.get("pipelined") or []
    bars_per_panel = [len(rows), len(drafted)]
    positions = max((len(_measured_positions(row)) for row in measured), default=0)
    bars_per_panel += [(positions + 1) * len(measured)] if measured else []
    bars_per_panel += [3 * len(pipelined)] if pipelined else []
    heights = [1.4 + BAR_HEIGHT_IN * bars for bars in bars_per_panel]
    figure = _new_figure(8 + LEGEND_WIDTH_IN, sum(heights))
    grid = figure.add_gridspec(len(heights), 1, height_ratios=heights)
    axes = [figure.add_subplot(cell) for cell in grid]
    config = report["config"]

    throughput = axes.pop(0)
    _grouped_bars(
        throughput,
        [_drafter_label(row) for row in rows],
        {"tokens/s": [row["tokens_per_s"] for row in rows]},
        horizontal=True,
        colors={"tokens/s": "tab:blue"},
        fmt="%.1f",
    )
    throughput.set_xlabel(
        f"tokens / s (batch 1, greedy, {config['num_prompts']} prompts x "
        f"{config['max_tokens']} tokens)"
    )
    throughput.set_title("specray bench --drafters: throughput per drafter at its k")

    speedup = axes.pop(0)
    _grouped_bars(
        speedup,
        [_drafter_label(row) for row in drafted],
        {"speedup": [row["speedup"] for row in drafted]},
        horizontal=True,
        colors={"speedup": "tab:blue"},
    )
    speedup.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    speedup.set_xlabel("speedup over target-only (tokens/s ratio)")
    speedup.set_title("speedup per drafter at its k")

    if measured:
        acceptance = axes.pop(0)
        values = {
            f"position {j + 1} (measured)": [
                (rates[j] if j < len(rates) else None)
                for rates in map(_measured_positions, measured)
            ]
            for j in range(positions)
        }
        values["α per position (fitted to E)"] = [row["alpha"] for row in measured]
        shade = colormaps["Purples"]
        colors = [shade(0.9 - 0.5 * j / max(positions, 1)) for j in range(positions)]
        _grouped_bars(
            acceptance,
            [_drafter_label(row) for row in measured],
            values,
            horizontal=True,
            colors=dict(zip(values, [*colors, "tab:cyan"], strict=True)),
        )
        acceptance.set_xlim(0.0, 1.15)
        acceptance.set_xlabel("acceptance (fraction of rounds with drafts)")
        acceptance.set_title("acceptance per position")
        _legend_outside(acceptance)

    if pipelined:
        served = axes.pop(0)
        values = {
            mode: [row[f"{mode.replace('-', '_')}_tokens_per_s"] for row in pipelined]
            for mode in ("target-only", "unpipelined", "pipelined")
        }
        _grouped_bars(
            served,
            [row["draft"] for row in pipelined],
            values,
            horizontal=True,
            colors=MODE_COLORS,
            fmt="%.1f",
        )
        served.set_xlabel("tokens / s (concurrency 1, draft and target on one-core Ray nodes)")
        served.set_title("through the coordinator (adaptive k, --pipelined-top)")
        _legend_outside(served)
    return _save(figure, path)
