"""The Helm chart (helm/specray), validated offline by specray.ops.chart: Helm's own library
renders and lints it, Kubernetes' and KubeRay's schemas check the documents, Ray Serve and
AppArgs check the Serve config, placement_problems checks the node groups. Each negative
control breaks one thing and must be caught by the step meant to catch it."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from specray.cluster.serve_env import SERVE_ENV
from specray.ops import chart as chart_ops
from specray.serve.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specray"
VARIANTS = {
    "autoscaling off": {"app": {"max_draft_workers": None}, "rayAutoscaler": {"enabled": False}},
    "auth secret": {"auth": {"existingSecret": "specray-token", "secretKey": "api-key"}},
    "tls with mTLS": {"tls": {"existingSecret": "specray-tls", "clientCA": True}},
    "servicemonitor with auth": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "auth": {"existingSecret": "specray-token"},
    },
    "tp 4 on 4 GPUs": {"app": {"tp_size": 4}, "targetGroup": {"gpus": 4}},
    "target only": {"app": {"draft": "none"}},
    "no gRPC API": {"app": {"grpc_port": None}},
    "colocated draft": {"app": {"draft_placement": "colocated"}},
    "Serve's Python proxy": {"rayServe": {"haproxy": False}},
    "CPU only, bundled model": {  # null deletes a default, as `--set key=null` does
        "app": {
            "target": "default",
            "draft": "default",
            "tp_size": 1,
            "draft_num_gpus": 0,
            "target_num_gpus": 0,
        },
        "models": {"claimName": ""},
        "draftGroup": {"gpus": 0, "nodeSelector": None, "tolerations": None},
        "targetGroup": {"gpus": 0, "shmSize": "", "nodeSelector": None, "tolerations": None},
    },
}
# AppArgs fields the chart sets itself (values.yaml has no key for them).
CHART_SET = {"ingress_on_head", "auth_token", "auth_token_env", "autoscaling"}
CHART_SET.update(chart_ops.TLS_FIELDS)
# values.yaml's app defaults that differ from AppArgs' on purpose (a GPU cluster, real models).
GPU_CLUSTER_DEFAULTS = {"target", "draft", "tp_size", "max_draft_workers"}
GPU_CLUSTER_DEFAULTS.update({"draft_num_gpus", "target_num_gpus", "draft_placement"})
# Values documented as one README row (Kubernetes objects passed through).
OBJECT_VALUES = {"resources", "rayStartParams", "nodeSelector", "affinity", "podAnnotations"}
OBJECT_VALUES.update({"podLabels", "sources"})
OBJECT_VALUES.update({"annotations", "labels", "podSecurityContext", "containerSecurityContext"})


def failures(report: chart_ops.Report) -> list[str]:
    return [line for line in report.lines() if line.startswith("FAIL")]


def only(docs: list[dict], kind: str) -> dict:
    return chart_ops._only(docs, kind)


def app_of(docs: list[dict]) -> dict:
    return chart_ops.serve_config(docs)["applications"][0]


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return chart_ops.render(CHART)


# ---- what must pass ----------------------------------------------------------------------
def test_default_values_pass_every_step():
    report = chart_ops.validate_chart(CHART)
    assert report.ok, report.text()
    passed = " | ".join(c.name for c in report.checks if c.status == "PASS")
    for step in (
        "helm lint --strict",
        "helm template",
        "values.schema.json",
        "KubeRay schema RayService/specray",
        "kubernetes-validate --strict Service/specray",
        "kubernetes-validate --strict Pod/specray-test-generation",
        "kubernetes-validate --strict PodDisruptionBudget/specray-target",
        "serveConfigV2 ServeDeploySchema",
        "AppArgs of application 'specray'",
        "serveConfigV2 vs deploy_config",
        "wiring",
        "Ray pods (metrics port, volume mounts, GCS fault tolerance)",
        "disruption budgets",
        "placement",
    ):
        assert step in passed, report.text()
    skipped = [c for c in report.checks if c.status == "SKIP"]
    if shutil.which("helm") is None:
        assert [c.name for c in skipped] == ["helm CLI"]
        assert "helm binary absent" in skipped[0].detail
    else:
        assert skipped == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_values_variants_pass(variant):
    report = chart_ops.validate_chart(CHART, VARIANTS[variant])
    assert report.ok, report.text()


def test_default_render_matches_the_app(default_docs):
    app = app_of(default_docs)
    args = app["args"]
    assert args["ingress_on_head"] is True
    assert (args["draft_num_gpus"], args["target_num_gpus"]) == (1, 1)
    assert args["autoscaling"] == "application"
    assert app["autoscaling_policy"]["policy_kwargs"]["max_drafts_per_group"] == 2
    cluster = only(default_docs, "RayService")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["rayStartParams"]
    assert (head["num-cpus"], head["num-gpus"], head["dashboard-host"]) == ("0", "0", "0.0.0.0")
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert chart_ops.ray_resources(groups["draft"]["rayStartParams"]["resources"]) == {
        "draft": 1000.0
    }
    target = groups["target"]["template"]["spec"]
    assert target["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in target["containers"][0]["volumeMounts"]
    assert {"medium": "Memory", "sizeLimit": "64Gi"} in [
        v.get("emptyDir") for v in target["volumes"]
    ]
    ports = {p["name"]: p["containerPort"] for p in ray_container(default_docs, "head")["ports"]}
    assert ports == {
        "gcs": 6379,
        "dashboard": 8265,
        "client": 10001,
        "serve": 8000,
        "grpc": 50051,
        "metrics": 8080,
    }


def ray_container(docs: list[dict], group: str) -> dict:
    return chart_ops.ray_containers(only(docs, "RayService"))[group]


def test_variant_renders():
    docs = chart_ops.render(CHART, VARIANTS["autoscaling off"])
    assert "autoscaling_policy" not in app_of(docs)
    assert "autoscaling" not in app_of(docs)["args"]
    assert only(docs, "RayService")["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False

    docs = chart_ops.render(CHART, VARIANTS["auth secret"])
    assert app_of(docs)["args"]["auth_token_env"] == "SPECRAY_AUTH_TOKEN"
    assert "auth_token" not in app_of(docs)["args"]  # never the token itself
    secret_ref = {"secretKeyRef": {"name": "specray-token", "key": "api-key"}}
    for container in [*chart_ops.ray_containers(only(docs, "RayService")).values()]:
        assert {"name": "SPECRAY_AUTH_TOKEN", "valueFrom": secret_ref} in container["env"]
    test_pod = only(docs, "Pod")["spec"]["containers"][0]
    assert {"name": "SPECRAY_AUTH_TOKEN", "valueFrom": secret_ref} in test_pod["env"]

    docs = chart_ops.render(CHART, VARIANTS["tls with mTLS"])
    args = app_of(docs)["args"]
    assert (args["tls_cert"], args["tls_key"], args["tls_client_ca"]) == (
        "/etc/specray/tls/tls.crt",
        "/etc/specray/tls/tls.key",
        "/etc/specray/tls/ca.crt",
    )

    docs = chart_ops.render(CHART, VARIANTS["servicemonitor with auth"])
    monitor = only(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    endpoint = monitor["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["authorization"]["credentials"] == {"name": "specray-token", "key": "token"}

    for draft in ("none", ""):  # AppArgs reads both as "no draft"
        docs = chart_ops.render(CHART, {"app": {"draft": draft}})
        groups = only(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        assert [g["groupName"] for g in groups] == ["target"]
        assert "autoscaling_policy" not in app_of(docs)

    # A colocated draft runs in the target pods: no draft group, no pool sizes, no pool policy.
    docs = chart_ops.render(CHART, VARIANTS["colocated draft"])
    groups = only(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["target"]
    args = app_of(docs)["args"]
    assert args["draft_placement"] == "colocated" and args["draft"] == "/models/draft"
    assert not {"num_draft_workers", "max_draft_workers", "autoscaling"} & set(args)
    assert "autoscaling_policy" not in app_of(docs)

    # Helm deletes a key set to null; the chart renders this one's null explicitly.
    docs = chart_ops.render(CHART, VARIANTS["no gRPC API"])
    assert app_of(docs)["args"]["grpc_port"] is None
    assert "grpc" not in {p["name"] for p in ray_container(docs, "head")["ports"]}
    assert [p["name"] for p in only(docs, "Service")["spec"]["ports"]] == ["http"]


def serve_env_of(container: dict) -> dict[str, str]:
    env = container.get("env", [])
    return {e["name"]: e["value"] for e in env if e["name"].startswith("RAY_SERVE_")}


def test_every_ray_container_runs_serve_as_specray_serve_does(default_docs):
    """The chart's Ray pods get the Serve settings the embedded local Ray gets (HAProxy
    ingress, throughput profile), and none of them with ``rayServe.haproxy: false``."""
    containers = chart_ops.ray_containers(only(default_docs, "RayService"))
    assert set(containers) == {"head", "draft", "target"}
    for container in containers.values():
        assert serve_env_of(container) == dict(SERVE_ENV)
    docs = chart_ops.render(CHART, VARIANTS["Serve's Python proxy"])
    for container in chart_ops.ray_containers(only(docs, "RayService")).values():
        assert serve_env_of(container) == {}


def test_helm_test_hook_pod(default_docs):
    pod = only(default_docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "hook-succeeded" in pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    container = pod["spec"]["containers"][0]
    assert container["image"] == ray_container(default_docs, "head")["image"]  # no other image
    assert container["command"] == ["python", "-c"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPECRAY_URL"] == "http://specray:8000"  # the Service, its http port
    assert pod["spec"]["restartPolicy"] == "Never"


class FakeSpecray(BaseHTTPRequestHandler):
    """/health, /v1/models and /v1/completions as the app answers them; ``text`` is what the
    completion returns, ``token`` the bearer token it requires (None: no auth)."""

    text = "Paris"
    token: str | None = None

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: dict):
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _authorized(self) -> bool:
        return self.token is None or self.headers.get("Authorization") == f"Bearer {self.token}"

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, {"status": "ok"})
        if not self._authorized():
            return self._send(401, {"error": {"message": "missing or invalid API key"}})
        return self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self):
        if not self._authorized():
            return self._send(401, {"error": {"message": "missing or invalid API key"}})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("model") != "tiny" or body.get("max_tokens") != 4:
            return self._send(400, {"error": {"message": f"unexpected request {body}"}})
        usage = {"prompt_tokens": 5, "completion_tokens": 4 if self.text else 0}
        self._send(200, {"choices": [{"index": 0, "text": self.text}], "usage": usage})


def run_hook_script(
    docs: list[dict], *, text: str, token: str | None
) -> subprocess.CompletedProcess:
    handler = type("Handler", (FakeSpecray,), {"text": text, "token": token})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        script = only(docs, "Pod")["spec"]["containers"][0]["args"][0]
        env = {**os.environ, "SPECRAY_URL": f"http://127.0.0.1:{server.server_port}"}
        env.pop("SPECRAY_AUTH_TOKEN", None)
        env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1"  # urllib would proxy loopback too
        if token is not None:
            env["SPECRAY_AUTH_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()


def test_hook_script_passes_on_text_and_fails_on_empty_text(default_docs):
    ok = run_hook_script(default_docs, text=" Paris", token=None)
    assert ok.returncode == 0 and "PASS model 'tiny'" in ok.stdout, ok.stdout + ok.stderr
    empty = run_hook_script(default_docs, text="", token=None)
    assert empty.returncode == 1 and "empty text" in empty.stdout, empty.stdout + empty.stderr
    docs = chart_ops.render(CHART, VARIANTS["auth secret"])
    authed = run_hook_script(docs, text=" Paris", token="s3cret")
    assert authed.returncode == 0, authed.stdout + authed.stderr


# ---- negative controls: each must fail, at the step meant to catch it ------------------------
def test_typo_in_values_fails_the_schema():
    report = chart_ops.validate_chart(CHART, {"app": {"tp_sise": 4}})
    assert not report.ok
    schema = [line for line in failures(report) if line.startswith("FAIL values.schema.json")]
    assert schema and "'tp_sise' was unexpected" in schema[0], report.text()


def test_too_few_gpus_for_tp_fails_placement():
    report = chart_ops.validate_chart(CHART, {"targetGroup": {"gpus": 4}})
    assert [line.split(":")[0] for line in failures(report)] == [
        "FAIL placement (node groups vs AppArgs)"
    ], report.text()
    assert "tp_size=8" in failures(report)[0] and "GPU: 4" in failures(report)[0]


def test_draft_ceiling_without_ray_autoscaler_fails_placement():
    """Without Ray's autoscaler a group stays at its replicas: no room for the draft ceiling."""
    report = chart_ops.validate_chart(CHART, {"rayAutoscaler": {"enabled": False}})
    assert len(failures(report)) == 1, report.text()
    assert "room for 1 draft worker(s), the app may scale to 2" in failures(report)[0]


def test_removed_required_field_fails_the_kuberay_schema(default_docs):
    assert chart_ops.check_rayservice(only(default_docs, "RayService")).status == "PASS"
    broken = copy.deepcopy(only(default_docs, "RayService"))
    del broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    check = chart_ops.check_rayservice(broken)
    assert check.status == "FAIL" and "'groupName' is a required property" in check.detail


def test_unknown_app_arg_fails_app_args(default_docs):
    docs = copy.deepcopy(default_docs)
    rayservice = only(docs, "RayService")
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    config["applications"][0]["args"]["draft_workers"] = 2
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    checks = {check.name.split(" (")[0]: check for check in chart_ops.check_serve_config(docs)}
    assert checks["serveConfigV2 ServeDeploySchema"].status == "PASS"  # args are opaque to Serve
    app_args = checks["AppArgs of application 'specray'"]
    assert app_args.status == "FAIL" and "draft_workers: Extra inputs" in app_args.detail


def test_bad_pod_field_fails_kubernetes_validate(default_docs):
    docs = copy.deepcopy(default_docs)
    only(docs, "Pod")["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    failed = [c for c in chart_ops.check_kubernetes(docs) if c.status == "FAIL"]
    assert [c.name for c in failed] == ["kubernetes-validate --strict Pod/specray-test-generation"]
    assert "'imagePullPolcy' was unexpected" in failed[0].detail


def test_broken_template_fails_lint(tmp_path):
    chart = shutil.copytree(CHART, tmp_path / "specray")
    (chart / "templates" / "broken.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n"
        "data:\n  tp: {{ .Values.app.tp_size | quot }}\n"  # quot: no such function
    )
    problems = chart_ops.lint(chart)
    assert problems and any('function "quot" not defined' in p for p in problems), problems
    report = chart_ops.validate_chart(chart)
    assert failures(report)[0].startswith("FAIL helm lint --strict"), report.text()


def test_ray_resources_needs_the_quoted_form():
    assert chart_ops.ray_resources('"{\\"draft\\": 2}"') == {"draft": 2.0}
    with pytest.raises(ValueError, match="quoted JSON object"):
        chart_ops.ray_resources('{"draft": 2}')  # the shell would split and unquote it


# ---- the chart's files stay in step with the code ------------------------------------------
def test_vendored_kuberay_schema_regenerates_byte_for_byte():
    path = ROOT / "scripts" / "vendor_kuberay_schema.py"
    spec = importlib.util.spec_from_file_location("vendor_kuberay_schema", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUTPUT.read_bytes() == module.build().encode("utf-8")


def test_app_values_cover_app_args():
    schema = json.loads((CHART / "values.schema.json").read_text())
    app_keys = set(schema["properties"]["app"]["properties"])
    assert app_keys == set(AppArgs.model_fields) - CHART_SET
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["app"]
    assert set(defaults) == app_keys
    differing = {
        key for key, value in defaults.items() if value != AppArgs.model_fields[key].get_default()
    }
    assert differing == GPU_CLUSTER_DEFAULTS


def leaf_paths(values: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and key not in OBJECT_VALUES:
            paths += leaf_paths(value, path + ".")
        else:
            paths.append(path)
    return paths


def test_readme_values_table_lists_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in readme.splitlines()
        if line.startswith("| `")
    }
    missing = [path for path in leaf_paths(values) if path not in rows]
    assert missing == [], missing
