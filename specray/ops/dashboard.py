"""The specray Grafana dashboard, built with Grafana's own typed builders (PyPI
``grafana-foundation-sdk``), never written by hand.

:func:`build_dashboard` is pure: it returns the SDK's dashboard model. :func:`dashboard_json`
encodes it (sorted keys, 2-space indent, trailing newline) and :func:`write_dashboard` writes
it; ``python -m specray.ops.dashboard`` regenerates the shipped copies
(``deploy/grafana/specray-dashboard.json`` and the Helm chart's
``helm/specray/dashboards/specray.json``, which its ``grafanaDashboard`` ConfigMap carries).

Every query reads a series of :mod:`specray.engine_core.metrics` (``specray:``, vLLM's names)
and keeps the models the ``model_name`` variable selects. A served app's exposition labels
each target group's series with ``replica``, and Prometheus adds its own target labels, so
every query aggregates: rates and counts are summed, per-group shares (busy, bubbles) averaged,
histograms summed by ``le`` before ``histogram_quantile``.

    python -m specray.ops.dashboard                  # both shipped files
    python -m specray.ops.dashboard --out dash.json  # one file elsewhere
"""

from __future__ import annotations

import argparse
import string
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_PATH = ROOT / "deploy" / "grafana" / "specray-dashboard.json"
CHART_PATH = ROOT / "helm" / "specray" / "dashboards" / "specray.json"  # .Files.Get reads it
SHIPPED_PATHS = (DEPLOY_PATH, CHART_PATH)

UID = "specray"
MODEL_FILTER = '{model_name=~"$model_name"}'  # every query keeps the selected models
WINDOW = "[$__rate_interval]"  # Grafana's rate window: >= 4 scrape intervals
QUANTILES = (0.5, 0.9, 0.99)
PANEL_HEIGHT = 8  # grid rows
THIRD, HALF = 8, 12  # panel widths on Grafana's 24-column grid

Query = tuple[str, str]  # (PromQL expression, legend format)


# ---- PromQL -------------------------------------------------------------------------------
def windowed(
    series: str, *, function: str = "rate", aggregate: str = "sum", by: str = "model_name"
) -> str:
    """A counter (or a histogram's ``_bucket`` / ``_sum`` / ``_count``) over Grafana's rate
    window, aggregated over replicas and scrape targets.

    >>> windowed("specray:generation_tokens_total")
    'sum by (model_name) (rate(specray:generation_tokens_total{model_name=~"$model_name"}[$__rate_interval]))'
    """  # noqa: E501
    return f"{aggregate} by ({by}) ({function}({series}{MODEL_FILTER}{WINDOW}))"


def gauge(series: str, aggregate: str) -> str:
    """A gauge aggregated per model: ``sum`` for counts, ``max`` / ``avg`` for shares."""
    return f"{aggregate} by (model_name) ({series}{MODEL_FILTER})"


def ratio(numerator: str, denominator: str) -> str:
    """Rate of one counter over another's, per model: ``accepted / draft tokens``."""
    return f"{windowed(numerator)} / {windowed(denominator)}"


def quantile_queries(histogram: str) -> list[Query]:
    """p50 / p90 / p99 of a histogram (``histogram`` without ``_bucket``) per model."""
    buckets = windowed(histogram + "_bucket", by="model_name, le")
    return [
        (f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)} {{{{model_name}}}}")
        for q in QUANTILES
    ]


def mean_query(histogram: str) -> Query:
    """The mean observation of a histogram over the window: rate of its sum / of its count."""
    return ratio(histogram + "_sum", histogram + "_count"), "mean {{model_name}}"


# ---- panels -------------------------------------------------------------------------------
def _datasource() -> model.DataSourceRef:
    return model.DataSourceRef(type_val="prometheus", uid="${datasource}")


def timeseries(
    title: str,
    description: str,
    queries: Sequence[Query],
    *,
    unit: str = "short",
    width: int = THIRD,
    max_value: float | None = None,
) -> Timeseries:
    """A time series panel on the ``datasource`` variable, one target per query (A, B, ...)."""
    if len(queries) > len(string.ascii_uppercase):
        raise ValueError(f"{title}: at most 26 queries (refIds A-Z), got {len(queries)}")
    panel = (
        Timeseries()
        .title(title)
        .description(description)
        .datasource(_datasource())
        .unit(unit)
        .min(0)
        .fill_opacity(10)  # a light fill under each line
        .span(width)
        .height(PANEL_HEIGHT)
    )
    if max_value is not None:
        panel = panel.max(max_value)
    for ref_id, (expr, legend) in zip(string.ascii_uppercase, queries, strict=False):
        target = PrometheusQuery().expr(expr).legend_format(legend).ref_id(ref_id)
        panel = panel.with_target(target.datasource(_datasource()))
    return panel


def latency(title: str, histogram: str, what: str) -> Timeseries:
    return timeseries(title, f"p50, p90, p99 of {what}.", quantile_queries(histogram), unit="s")


def _throughput() -> list[Timeseries]:
    by_reason = windowed("specray:request_success_total", by="model_name, finished_reason")
    return [
        timeseries(
            "Tokens/s",
            "Generated tokens committed per second, and prompt tokens admitted per second.",
            [
                (windowed("specray:generation_tokens_total"), "generated {{model_name}}"),
                (windowed("specray:prompt_tokens_total"), "prompt {{model_name}}"),
            ],
        ),
        timeseries(
            "Requests/s by finished reason",
            "Finished requests per second by reason (stop, length, abort, ...), and requests "
            "refused at admission because the queue was full.",
            [
                (by_reason, "{{finished_reason}} {{model_name}}"),
                (windowed("specray:request_rejected_total"), "rejected {{model_name}}"),
            ],
            unit="reqps",
        ),
        timeseries(
            "Tokens per round",
            "Tokens a target round ran (prompt tokens prefilled and tokens verified): p50, "
            "p90, p99 and the mean.",
            [
                *quantile_queries("specray:iteration_tokens_total"),
                mean_query("specray:iteration_tokens_total"),
            ],
        ),
    ]


def _latency() -> list[Timeseries]:
    return [
        latency("Time to first token", "specray:time_to_first_token_seconds", "the first token"),
        latency(
            "Inter-token latency",
            "specray:inter_token_latency_seconds",
            "the time between streamed tokens (per token)",
        ),
        latency(
            "End-to-end request latency",
            "specray:e2e_request_latency_seconds",
            "a request's latency, arrival to last token",
        ),
        latency("Queue time", "specray:request_queue_time_seconds", "the wait for a batch slot"),
        latency(
            "Prefill time",
            "specray:request_prefill_time_seconds",
            "admission to the first token (prefill, chunked or not)",
        ),
        latency(
            "Decode time", "specray:request_decode_time_seconds", "the first token to the last"
        ),
    ]


def _load() -> list[Timeseries]:
    return [
        timeseries(
            "Queue depth",
            "Requests being decoded and requests waiting for a batch slot.",
            [
                (gauge("specray:num_requests_running", "sum"), "running {{model_name}}"),
                (gauge("specray:num_requests_waiting", "sum"), "waiting {{model_name}}"),
            ],
        ),
        timeseries(
            "KV cache usage",
            "Share of the target's allocated KV slots in use, in the fullest target group.",
            [(gauge("specray:kv_cache_usage_perc", "max"), "{{model_name}}")],
            unit="percentunit",
            max_value=1,
        ),
        timeseries(
            "Preemptions",
            "Requests preempted per window: always 0 (a specray request keeps its cache rows "
            "until it ends), shown as vLLM's dashboards show it.",
            [(windowed("specray:num_preemptions_total", function="increase"), "{{model_name}}")],
        ),
    ]


def _speculation() -> list[Timeseries]:
    accepted = "specray:spec_decode_num_accepted_tokens_total"
    drafted = "specray:spec_decode_num_draft_tokens_total"
    drafts = "specray:spec_decode_num_drafts_total"
    per_position = windowed(
        "specray:spec_decode_num_accepted_tokens_per_pos_total", by="model_name, position"
    )
    return [
        timeseries(
            "Acceptance rate",
            "Draft tokens accepted / draft tokens verified.",
            [(ratio(accepted, drafted), "{{model_name}}")],
            unit="percentunit",
            max_value=1,
        ),
        timeseries(
            "Acceptance per position",
            "Share of verifications whose draft token at each block position was accepted "
            "(accepted at the position / verifications with drafts).",
            [
                (
                    f"{per_position} / on (model_name) group_left {windowed(drafts)}",
                    "position {{position}} {{model_name}}",
                )
            ],
            unit="percentunit",
            max_value=1,
        ),
        timeseries(
            "Mean acceptance length",
            "Tokens a verification with drafts commits: 1 + accepted / verifications "
            "(the accepted drafts and the recovered or bonus token), vLLM's definition.",
            [(f"1 + {ratio(accepted, drafts)}", "{{model_name}}")],
        ),
    ]


def _pipeline() -> list[Timeseries]:
    busy_s = windowed("specray:target_busy_seconds_total", aggregate="avg")
    bubble_s = windowed("specray:pipeline_bubble_seconds_total", aggregate="avg")
    dropped = windowed("specray:dropped_draft_blocks_total", by="model_name, reason")
    restarts = windowed("specray:draft_worker_restarts_total", function="increase")
    return [
        timeseries(
            "Target busy fraction",
            "Target compute time / wall time per target group (mean over groups): over the "
            "window, and since the coordinator started (the autoscaler's gauge).",
            [
                (busy_s, "window {{model_name}}"),
                (gauge("specray:target_busy_fraction", "avg"), "since start {{model_name}}"),
            ],
            unit="percentunit",
            max_value=1,
        ),
        timeseries(
            "Pipeline bubbles",
            "Share of wall time the target waited for draft blocks, per target group (mean "
            "over groups).",
            [(bubble_s, "{{model_name}}")],
            unit="percentunit",
            max_value=1,
        ),
        timeseries(
            "Draft wire bytes",
            "Draft block bytes sent draft -> target per second (tokens and draft probabilities).",
            [(windowed("specray:draft_wire_bytes_total"), "{{model_name}}")],
            unit="Bps",
        ),
        latency("Draft latency", "specray:draft_latency_seconds", "a draft worker's call"),
        latency("Verify latency", "specray:verify_latency_seconds", "a target verification"),
        latency(
            "Network latency",
            "specray:network_latency_seconds",
            "a no-op call to the target group (round trip)",
        ),
        timeseries(
            "Dropped draft blocks by reason",
            "Draft blocks dropped before verification per second, by reason: their rounds "
            "ran target-only.",
            [(dropped, "{{reason}} {{model_name}}")],
            width=HALF,
        ),
        timeseries(
            "Draft worker restarts",
            "Draft workers replaced after a failed call, per window.",
            [(restarts, "{{model_name}}")],
            width=HALF,
        ),
    ]


ROWS = (
    ("Throughput", _throughput),
    ("Latency", _latency),
    ("Queue and KV cache", _load),
    ("Speculative decoding", _speculation),
    ("Distributed pipeline", _pipeline),
)


# ---- the dashboard ------------------------------------------------------------------------
def build_dashboard() -> model.Dashboard:
    """The specray dashboard: variables ``datasource`` (Prometheus) and ``model_name``, then
    one row per concern. Panel ids count up from 1 in grid order (rows included); the
    builder lays panels out left to right, wrapping at 24 columns."""
    builder = (
        Dashboard("specray")
        .uid(UID)
        .description(
            "specray: exact distributed speculative decoding on Ray Serve "
            "(vLLM's metric names under specray:)."
        )
        .tags(["specray", "speculative-decoding"])
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("model_name")
            .label("Model")
            .datasource(_datasource())
            .query("label_values(specray:num_requests_running, model_name)")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(model.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    panel_id = 0
    for title, panels in ROWS:
        panel_id += 1
        builder = builder.with_row(Row(title).id(panel_id))
        for panel in panels():
            panel_id += 1
            builder = builder.with_panel(panel.id(panel_id))
    return builder.build()


def dashboard_json(dashboard: model.Dashboard | None = None) -> str:
    """The dashboard as shipped: sorted keys, 2-space indent, a trailing newline."""
    dashboard = build_dashboard() if dashboard is None else dashboard
    return JSONEncoder(sort_keys=True, indent=2).encode(dashboard) + "\n"


def write_dashboard(path: str | Path, dashboard: model.Dashboard | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dashboard_json(dashboard))
    return path


def main(argv: list[str] | None = None) -> int:
    shipped = ", ".join(str(path.relative_to(ROOT)) for path in SHIPPED_PATHS)
    parser = argparse.ArgumentParser(
        prog="python -m specray.ops.dashboard",
        description="Write the specray Grafana dashboard (JSON).",
    )
    parser.add_argument(
        "--out",
        type=Path,
        action="append",
        help=f"where to write it (repeatable); default: the shipped copies, {shipped}",
    )
    args = parser.parse_args(argv)
    for path in args.out or SHIPPED_PATHS:
        print(f"wrote {write_dashboard(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
