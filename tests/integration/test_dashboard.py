"""The Grafana dashboard (specray.ops.dashboard): the shipped JSON is the module's output, it
loads back into the Grafana SDK's dashboard model, every series its queries read is on a served
run's ``/metrics``, and the chart ships it in a ConfigMap for Grafana's sidecar.

The served run is a backend of its own (the tiny chat pair, WITH its draft, so the speculative
decoding series exist) reached through the HTTP app in process, as test_served_metrics.py."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import time

import helm_python
import httpx
import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus

from specray.engine_core.coordinator import CoordinatorConfig
from specray.engine_core.metrics import CoordinatorMetrics
from specray.ops import chart as chart_ops
from specray.ops import dashboard
from specray.serve.openai_api import build_http_app
from specray.serve.service import LocalBackend
from tests.helpers.tiny_models import save_tiny_chat_pair

CHART = chart_ops.CHART_DIR
METRIC_NAME = re.compile(r"specray:[a-zA-Z0-9_:]+")  # Prometheus: [a-zA-Z_:][a-zA-Z0-9_:]*
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
GRID_COLUMNS = 24
# What the dashboard must show (issue 22 item 4): each a series some query reads.
REQUIRED = {
    "specray:generation_tokens_total",
    "specray:request_success_total",
    *(
        f"specray:{name}_seconds_bucket"
        for name in (
            "time_to_first_token",
            "inter_token_latency",
            "e2e_request_latency",
            "request_queue_time",
            "request_prefill_time",
            "request_decode_time",
            "draft_latency",
            "verify_latency",
            "network_latency",
        )
    ),
    "specray:num_requests_running",
    "specray:num_requests_waiting",
    "specray:kv_cache_usage_perc",
    "specray:spec_decode_num_accepted_tokens_total",
    "specray:spec_decode_num_draft_tokens_total",
    "specray:spec_decode_num_accepted_tokens_per_pos_total",
    "specray:spec_decode_num_drafts_total",
    "specray:target_busy_fraction",
    "specray:pipeline_bubble_seconds_total",
    "specray:draft_wire_bytes_total",
    "specray:dropped_draft_blocks_total",
    "specray:draft_worker_restarts_total",
    "specray:num_preemptions_total",
    "specray:iteration_tokens_total_bucket",
}
# Series whose first sample comes with a fault: a healthy run never drops a block, replaces a
# draft worker or refuses a request. For these the exposition only declares the family (its
# # HELP / # TYPE lines); every other series the dashboard reads must have samples.
FAULT_ONLY = {
    "specray:dropped_draft_blocks_total",
    "specray:draft_worker_restarts_total",
    "specray:request_rejected_total",
}
MODEL = "tiny"
MODEL_NAME_QUERY = "label_values(specray:num_requests_running, model_name)"
PROMPTS = ["The quick brown fox", "one two three", "a b c d e f", "seven eight"]
MAX_TOKENS = 16
PROBE_WAIT_S = 60.0  # the network latency probe runs every 0.5 s while requests run


def shipped() -> dict:
    return json.loads(dashboard.DEPLOY_PATH.read_text())


def queries(dashboard_json: dict) -> list[str]:
    """Every panel target's PromQL expression."""
    return [
        target["expr"]
        for panel in dashboard_json["panels"]
        for target in panel.get("targets", [])
        if panel["type"] != "row"
    ]


def metric_names(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}


def declared(exposition: str) -> dict[str, str]:
    """Family name (counters with ``_total``) -> type, from the ``# TYPE`` lines."""
    types = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
    return types


def sample_names(exposition: str) -> set[str]:
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }


def family_of(name: str, types: dict[str, str]) -> tuple[str, str | None]:
    """(family, type) of a sample name: a histogram's ``_bucket`` / ``_sum`` / ``_count``
    belong to the histogram, any other name is its own family."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and types.get(base) == "histogram":
            return base, "histogram"
    return name, types.get(name)


# ---- 1. the shipped files -------------------------------------------------------------------
def test_shipped_files_are_the_modules_output():
    expected = dashboard.dashboard_json().encode()
    assert expected.endswith(b"}\n") and b'\n  "panels": [' in expected  # sorted, 2-space
    for path in dashboard.SHIPPED_PATHS:
        assert path.read_bytes() == expected, f"{path} is stale: python -m specray.ops.dashboard"


def test_entry_point_writes_the_same_file(tmp_path):
    out = tmp_path / "nested" / "dashboard.json"
    assert dashboard.main(["--out", str(out)]) == 0
    assert out.read_text() == dashboard.DEPLOY_PATH.read_text()


# ---- 2. the Grafana model -------------------------------------------------------------------
FILTERED_SERIES = re.compile(r'specray:[a-zA-Z0-9_:]+\{model_name=~"\$model_name"\}')


def structure_problems(data: dict) -> list[str]:
    """What is wrong with a dashboard document, read through the SDK's dashboard model."""
    register_default_plugins()  # the SDK's way to decode panels and Prometheus queries
    loaded = model.Dashboard.from_json(data)
    problems = []
    if json.loads(JSONEncoder(sort_keys=True).encode(loaded)) != data:
        problems.append("the model does not encode back to the same document")
    variables = {variable.name: variable for variable in loaded.templating.list_val or []}
    source = variables.get("datasource")
    if source is None or (source.type_val, source.query) != ("datasource", "prometheus"):
        problems.append("no Prometheus datasource variable")
    model_name = variables.get("model_name")
    if model_name is None or model_name.query != MODEL_NAME_QUERY:
        problems.append("no model_name variable")
    ids = [panel.id_val for panel in loaded.panels or []]
    if None in ids or len(set(ids)) != len(ids):
        problems.append(f"panel ids not unique: {ids}")
    cells: set[tuple[int, int]] = set()
    for panel in loaded.panels or []:
        grid = panel.grid_pos
        if not (grid.w > 0 and grid.h > 0 and grid.x >= 0 and grid.x + grid.w <= GRID_COLUMNS):
            problems.append(f"panel {panel.id_val}: gridPos outside 24 columns")
        columns, rows = range(grid.x, grid.x + grid.w), range(grid.y, grid.y + grid.h)
        covered = {(x, y) for x in columns for y in rows}
        if covered & cells:
            problems.append(f"panel {panel.id_val} overlaps another")
        cells |= covered
        if isinstance(panel, model.RowPanel):
            continue
        if panel.datasource is None or panel.datasource.uid != "${datasource}":
            problems.append(f"{panel.title}: not on the datasource variable")
        if not panel.targets:
            problems.append(f"{panel.title}: no targets")
        for target in panel.targets or []:
            expr = getattr(target, "expr", None)
            if not isinstance(target, prometheus.Dataquery) or not isinstance(expr, str):
                problems.append(f"{panel.title}: a target without a PromQL expr")
                continue
            # Every series the query reads keeps the selected models only.
            names = METRIC_NAME.findall(expr)
            if not names or len(FILTERED_SERIES.findall(expr)) != len(names):
                problems.append(f"{panel.title}: a series without the model_name filter")
    return problems


def test_loads_as_a_grafana_dashboard_model():
    data = shipped()
    assert structure_problems(data) == []
    loaded = model.Dashboard.from_json(data)
    assert (loaded.title, loaded.uid) == ("specray", "specray")
    panels = [panel for panel in loaded.panels if isinstance(panel, model.Panel)]
    assert len(panels) >= 20
    assert all(isinstance(t, prometheus.Dataquery) for panel in panels for t in panel.targets)


def test_broken_dashboards_are_caught():
    """Negative controls: each edit breaks one rule the structure check enforces."""
    data = shipped()
    first, second = [i for i, p in enumerate(data["panels"]) if p["type"] != "row"][:2]
    edits = {
        "no Prometheus datasource variable": lambda d: d["templating"]["list"].pop(0),
        "panel ids not unique": lambda d: d["panels"][second].update(id=d["panels"][first]["id"]),
        "gridPos outside 24 columns": lambda d: d["panels"][first]["gridPos"].update(x=20),
        "overlaps another": lambda d: d["panels"][second]["gridPos"].update(
            d["panels"][first]["gridPos"]
        ),
        "without the model_name filter": lambda d: d["panels"][first]["targets"][0].update(
            expr="sum(rate(specray:generation_tokens_total[5m]))"
        ),
        "no targets": lambda d: d["panels"][first].update(targets=[]),
    }
    for expected, edit in edits.items():
        broken = copy.deepcopy(data)
        edit(broken)
        problems = structure_problems(broken)
        assert any(expected in problem for problem in problems), (expected, problems)


def test_queries_read_only_series_metrics_py_defines_and_all_it_must_show():
    types = declared(CoordinatorMetrics("x").render().decode())
    names = metric_names(queries(shipped()))
    undefined = sorted(name for name in names if family_of(name, types)[1] is None)
    assert undefined == []
    assert sorted(REQUIRED - names) == []


def test_a_misspelt_series_is_caught():
    """Negative control for the two checks above and the served one below."""
    types = declared(CoordinatorMetrics("x").render().decode())
    for wrong in ("specray:generation_tokens", "specray:draft_latency_seconds_total"):
        assert family_of(wrong, types)[1] is None, wrong
    assert family_of("specray:draft_latency_seconds_bucket", types) == (
        "specray:draft_latency_seconds",
        "histogram",
    )


# ---- 3. every series on a served run --------------------------------------------------------
@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("chat-pair"))


@pytest.fixture(scope="module")
def served_exposition(chat_pair) -> str:
    """``/metrics`` after a few completions on a backend with a draft, speculating 4 tokens."""
    target, draft = chat_pair
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    async def run() -> str:
        config = CoordinatorConfig(num_speculative_tokens=4, adaptive_k=False)
        backend = await LocalBackend.start(target, draft, model_name=MODEL, config=config)
        registry = backend.engine.metrics.registry
        labels = {"model_name": MODEL}

        def probed() -> bool:  # a round trip timed while requests ran (every 0.5 s)
            count = registry.get_sample_value("specray:network_latency_seconds_count", labels)
            return bool(count)

        try:
            transport = httpx.ASGITransport(app=build_http_app(backend))
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                deadline = time.monotonic() + PROBE_WAIT_S
                while True:
                    replies = await asyncio.gather(
                        *(
                            client.post("/v1/completions", json=body | {"prompt": p}, timeout=60)
                            for p in PROMPTS
                        )
                    )
                    assert [r.status_code for r in replies] == [200] * len(PROMPTS)
                    if probed() or time.monotonic() > deadline:
                        break
                return (await client.get("/metrics")).text
        finally:
            await backend.stop(drain=False)

    return asyncio.run(run())


def unserved(names: set[str], exposition: str) -> list[str]:
    """The names with no sample in the exposition, but for a FAULT_ONLY family that the
    exposition declares (# HELP / # TYPE): no fault happened, so no sample yet."""
    types, present = declared(exposition), sample_names(exposition)
    missing = []
    for name in sorted(names - present):
        family, kind = family_of(name, types)
        if family not in FAULT_ONLY or kind is None:
            missing.append(name)
    return missing


def test_every_queried_series_is_on_a_served_run(served_exposition):
    assert unserved(metric_names(queries(shipped())), served_exposition) == []
    # What only speculation (and a request running through a probe) produces has samples.
    present = sample_names(served_exposition)
    for name in (
        "specray:spec_decode_num_accepted_tokens_per_pos_total",
        "specray:draft_wire_bytes_total",
        "specray:draft_latency_seconds_bucket",
        "specray:network_latency_seconds_bucket",
    ):
        assert name in present, name


def test_unserved_series_are_caught(served_exposition):
    """Negative controls: a misspelt name, a histogram read without its suffix, and a fault-only
    family the exposition does not declare are each reported."""
    assert unserved({"specray:generation_tokens"}, served_exposition) == [
        "specray:generation_tokens"
    ]
    assert unserved({"specray:draft_latency_seconds"}, served_exposition) == [
        "specray:draft_latency_seconds"
    ]
    declared_only = "specray:draft_worker_restarts_total"
    assert unserved({declared_only}, served_exposition) == []
    undeclared = "\n".join(
        line for line in served_exposition.splitlines() if declared_only not in line
    )
    assert unserved({declared_only}, undeclared) == [declared_only]


# ---- 4. the chart's ConfigMap ---------------------------------------------------------------
def configmaps(docs: list[dict]) -> list[dict]:
    return [doc for doc in docs if doc.get("kind") == "ConfigMap"]


def test_chart_ships_the_dashboard_when_enabled():
    values = {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}
    [configmap] = configmaps(chart_ops.render(CHART, values))
    assert configmap["metadata"]["name"] == "specray-dashboard"
    assert configmap["metadata"]["namespace"] == chart_ops.NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    assert configmap["metadata"]["labels"]["app.kubernetes.io/instance"] == "specray"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert list(configmap["data"]) == ["specray.json"]
    assert configmap["data"]["specray.json"] == dashboard.CHART_PATH.read_text()  # byte for byte
    assert json.loads(configmap["data"]["specray.json"])["uid"] == "specray"

    values = {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}
    values["grafanaDashboard"]["labels"] = {"grafana_dashboard": None, "dashboards": "specray"}
    [configmap] = configmaps(chart_ops.render(CHART, values))
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["dashboards"] == "specray"
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]  # null drops a default


def test_no_configmap_by_default():
    assert configmaps(chart_ops.render(CHART)) == []


def test_chart_with_the_dashboard_passes_validation():
    report = chart_ops.validate_chart(CHART, {"grafanaDashboard": {"enabled": True}})
    assert report.ok, report.text()
    passed = [check.name for check in report.checks if check.status == "PASS"]
    assert "kubernetes-validate --strict ConfigMap/specray-dashboard" in passed


def test_chart_without_the_dashboard_file_fails_to_render(tmp_path):
    broken = tmp_path / "specray"
    shutil.copytree(CHART, broken)
    (broken / "dashboards" / "specray.json").unlink()
    with pytest.raises(helm_python.HelmError, match=r"dashboards/specray\.json is missing"):
        chart_ops.render(broken, {"grafanaDashboard": {"enabled": True}})
    assert configmaps(chart_ops.render(broken)) == []  # off: the file is not read


def test_unknown_dashboard_value_fails_the_schema():
    report = chart_ops.validate_chart(CHART, {"grafanaDashboard": {"enable": True}})
    assert not report.ok
    assert any("grafanaDashboard" in line for line in report.lines() if line.startswith("FAIL"))
