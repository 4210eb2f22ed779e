"""The Helm chart's operator options (upgrade strategy, GCS fault tolerance, disruption budgets,
model downloads, pod fields, Ray's PodMonitor) and ``specray cluster render``, offline as
test_helm_chart.py: Helm's library renders, the schemas and specray.ops.chart_checks judge.
Every option on must pass every check and every option off must render none of them; each
negative control breaks one thing and must be caught by the step meant to catch it."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from specray import cli
from specray.ops import chart as chart_ops
from specray.ops import chart_checks

CHART = chart_ops.CHART_DIR
EVERY_OPTION_ON = {
    "upgradeStrategy": "NewCluster",
    "gcsFaultTolerance": {
        "enabled": True,
        "redisAddress": "redis.db.svc:6379",
        "redisPassword": {"secretName": "specray-redis", "secretKey": "redis-password"},
    },
    "models": {
        "claimName": "",
        "download": {
            "enabled": True,
            "sources": {
                "target": "s3://models/llama-3.1-70b",
                "draft": "hf://meta-llama/Llama-3.2-1B@main",
                "tokenizers": "gs://models/tokenizers",
            },
            "credentialsSecret": "model-credentials",
            "sizeLimit": "400Gi",
        },
    },
    "priorityClassName": "inference",
    "serviceAccountName": "specray",
    "runtimeClassName": "nvidia",
    "schedulerName": "volcano",
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "specray"}},
        }
    ],
    "podLabels": {"team": "inference", "app.kubernetes.io/component": "ignored"},
    "extraEnv": [{"name": "HF_HOME", "value": "/tmp/hf"}],
    "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "initContainers": [{"name": "warmup", "image": "busybox:1.36", "command": ["true"]}],
    "head": {"priorityClassName": "system-cluster-critical", "podLabels": {"tier": "head"}},
    "draftGroup": {
        "podDisruptionBudget": {"enabled": True},
        "schedulerName": "default-scheduler",
        "extraEnv": [{"name": "DRAFT_ONLY", "value": "1"}],
    },
    "targetGroup": {
        "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "target"}},
            }
        ],
        "initContainers": [{"name": "nccl-check", "image": "busybox:1.36", "command": ["true"]}],
    },
    "metrics": {"serviceMonitor": {"enabled": True}, "rayPodMonitor": {"enabled": True}},
    "auth": {"existingSecret": "specray-token"},
}


def failures(report: chart_ops.Report) -> list[str]:
    return [line for line in report.lines() if line.startswith("FAIL")]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc.get("kind") == kind]


def cluster_of(docs: list[dict]) -> dict:
    return chart_ops._only(docs, "RayService")["spec"]["rayClusterConfig"]


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    rayservice = chart_ops._only(docs, "RayService")
    return {name: g["template"] for name, g in chart_checks.ray_groups(rayservice).items()}


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return chart_ops.render(CHART)


@pytest.fixture(scope="module")
def all_on_docs() -> list[dict]:
    return chart_ops.render(CHART, EVERY_OPTION_ON)


# ---- every option on, every option off ----------------------------------------------------
def test_every_option_on_passes_every_step():
    report = chart_ops.validate_chart(CHART, EVERY_OPTION_ON)
    assert report.ok, report.text()
    passed = " | ".join(c.line() for c in report.checks if c.status == "PASS")
    for step in (
        "KubeRay schema RayService/specray",
        "kubernetes-validate --strict PodDisruptionBudget/specray-draft",
        "kubernetes-validate --strict PodDisruptionBudget/specray-target",
        "hand-written schema PodMonitor/specray-ray (selector and endpoints only, not the CRD; "
        "scrapes head, draft, target)",
        "hand-written schema ServiceMonitor/specray",
        "GCS fault tolerance: Redis redis.db.svc:6379",
        "PodDisruptionBudget/specray-draft -> draft (minAvailable 1)",
        "PodDisruptionBudget/specray-target -> target (minAvailable 1)",
    ):
        assert step in passed, report.text()


def test_defaults_render_none_of_the_options(default_docs):
    spec = chart_ops._only(default_docs, "RayService")["spec"]
    assert "upgradeStrategy" not in spec  # unset: KubeRay's default
    assert "gcsFaultToleranceOptions" not in spec["rayClusterConfig"]
    assert of_kind(default_docs, "PodMonitor") == []
    for name, template in pod_specs(default_docs).items():
        pod = template["spec"]
        assert "initContainers" not in pod, name
        for field in ("priorityClassName", "serviceAccountName", "runtimeClassName"):
            assert field not in pod, (name, field)
        assert "schedulerName" not in pod and "topologySpreadConstraints" not in pod, name
        assert {v["name"] for v in pod.get("volumes", [])} <= {"models", "dshm"}, name
        models = [v for v in pod.get("volumes", []) if v["name"] == "models"]
        assert models[0]["persistentVolumeClaim"]["claimName"] == "specray-models", name
    # One budget, the target group's, keeping every target group's pod.
    [budget] = of_kind(default_docs, "PodDisruptionBudget")
    assert budget["metadata"]["name"] == "specray-target"
    assert budget["spec"]["minAvailable"] == 1
    docs = chart_ops.render(CHART, {"app": {"num_target_groups": 3}})
    assert of_kind(docs, "PodDisruptionBudget")[0]["spec"]["minAvailable"] == 3


def test_bundled_default_model_needs_no_volume():
    values = {"app": {"target": "default", "draft": "default"}, "models": {"claimName": ""}}
    for template in pod_specs(chart_ops.render(CHART, values)).values():
        assert "models" not in {v["name"] for v in template["spec"].get("volumes", [])}
        assert "initContainers" not in template["spec"]


# ---- what each option renders -------------------------------------------------------------
def test_upgrade_strategy_and_gcs_fault_tolerance(all_on_docs):
    spec = chart_ops._only(all_on_docs, "RayService")["spec"]
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}
    assert spec["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.db.svc:6379",
        "redisPassword": {
            "valueFrom": {"secretKeyRef": {"name": "specray-redis", "key": "redis-password"}}
        },  # the password itself never in the spec
    }
    values = copy.deepcopy(EVERY_OPTION_ON)
    values["gcsFaultTolerance"]["externalStorageNamespace"] = "specray-prod"
    options = cluster_of(chart_ops.render(CHART, values))["gcsFaultToleranceOptions"]
    assert options["externalStorageNamespace"] == "specray-prod"
    docs = chart_ops.render(CHART, {"upgradeStrategy": "None"})
    assert chart_ops._only(docs, "RayService")["spec"]["upgradeStrategy"] == {"type": "None"}


def test_model_downloads_fill_the_volume_the_ray_container_reads(all_on_docs):
    for name, template in pod_specs(all_on_docs).items():
        pod = template["spec"]
        downloads = {c["name"]: c for c in pod["initContainers"] if "download" in c["name"]}
        assert list(downloads) == ["download-draft", "download-target", "download-tokenizers"]
        target, draft = downloads["download-target"], downloads["download-draft"]
        assert target["image"] == "amazon/aws-cli:2.22.0"
        assert target["command"][-2:] == ["s3://models/llama-3.1-70b", "/models/target"]
        assert draft["image"] == "specray:0.1.0"  # hf://: the chart's own image
        assert draft["command"][-2:] == ["meta-llama/Llama-3.2-1B@main", "/models/draft"]
        assert "gcloud storage rsync" in downloads["download-tokenizers"]["command"][2]
        for container in downloads.values():
            assert container["envFrom"] == [{"secretRef": {"name": "model-credentials"}}]
            assert container["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
        # The extra init containers run after the downloads (the group's after the chart's).
        extra = [c["name"] for c in pod["initContainers"] if c["name"] not in downloads]
        assert extra == (["warmup", "nccl-check"] if name == "target" else ["warmup"])
        assert {"name": "models", "emptyDir": {"sizeLimit": "400Gi"}} in pod["volumes"]
        mount = {"name": "models", "mountPath": "/models", "readOnly": True}
        assert mount in pod["containers"][0]["volumeMounts"]
        assert "envFrom" not in pod["containers"][0]  # the credentials stay in the downloads


def test_pod_fields_merge_group_over_chart_wide(all_on_docs):
    templates = pod_specs(all_on_docs)
    head, draft, target = (templates[g] for g in ("head", "draft", "target"))
    assert head["spec"]["priorityClassName"] == "system-cluster-critical"  # the group's
    assert draft["spec"]["priorityClassName"] == "inference"  # the chart-wide one
    assert draft["spec"]["schedulerName"] == "default-scheduler"
    assert head["spec"]["schedulerName"] == "volcano"
    for template in templates.values():
        spec = template["spec"]
        assert (spec["serviceAccountName"], spec["runtimeClassName"]) == ("specray", "nvidia")
        assert template["metadata"]["labels"]["team"] == "inference"
        assert {"name": "scratch", "mountPath": "/scratch"} in spec["containers"][0]["volumeMounts"]
    # The chart's own labels win: its Service and budgets select on them.
    assert [t["metadata"]["labels"]["app.kubernetes.io/component"] for t in templates.values()] == [
        "head",
        "draft",
        "target",
    ]
    assert head["metadata"]["labels"]["tier"] == "head"
    spread = [c["topologyKey"] for c in target["spec"]["topologySpreadConstraints"]]
    assert spread == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    env = [e["name"] for e in draft["spec"]["containers"][0]["env"]]
    assert env.index("HF_HOME") < env.index("DRAFT_ONLY")
    assert "DRAFT_ONLY" not in [e["name"] for e in target["spec"]["containers"][0]["env"]]


def test_disruption_budgets_select_one_worker_group_each(all_on_docs):
    budgets = {
        b["metadata"]["name"]: b["spec"] for b in of_kind(all_on_docs, "PodDisruptionBudget")
    }
    assert budgets["specray-draft"]["minAvailable"] == 1  # null: draftGroup.minReplicas
    assert budgets["specray-draft"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "specray",
        "app.kubernetes.io/instance": "specray",
        "ray.io/node-type": "worker",
        "ray.io/group": "draft",
    }
    for spec in budgets.values():
        assert "maxUnavailable" not in spec and "ray.io/cluster" not in spec["selector"]
    docs = chart_ops.render(CHART, {"app": {"draft": "none"}, **_pdbs(draft=True)})
    assert [b["metadata"]["name"] for b in of_kind(docs, "PodDisruptionBudget")] == [
        "specray-target"
    ]  # no draft group, no draft budget
    assert (
        of_kind(chart_ops.render(CHART, _pdbs(draft=False, target=False)), "PodDisruptionBudget")
        == []
    )


def _pdbs(*, draft: bool, target: bool = True) -> dict:
    return {
        "draftGroup": {"podDisruptionBudget": {"enabled": draft}},
        "targetGroup": {"podDisruptionBudget": {"enabled": target}},
    }


def test_ray_pod_monitor_scrapes_every_ray_pod(all_on_docs):
    monitor = chart_ops._only(all_on_docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"]["ray.io/is-ray-node"] == "yes"
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["relabelings"][0]["targetLabel"] == "ray_io_cluster"
    cluster = cluster_of(all_on_docs)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert {g["rayStartParams"]["metrics-export-port"] for g in groups} == {"8080"}
    for container in chart_ops.ray_containers(chart_ops._only(all_on_docs, "RayService")).values():
        assert {"name": "metrics", "containerPort": 8080} in container["ports"]


def test_ray_containers_keep_kuberay_probes(all_on_docs):
    """No probe on /health: KubeRay deploys the app only once the head is Ready (a readiness
    probe on the app would never pass), and a liveness probe would restart the GCS (README)."""
    for container in chart_ops.ray_containers(chart_ops._only(all_on_docs, "RayService")).values():
        assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(container)


# ---- negative controls: each must fail, at the step meant to catch it ----------------------
@pytest.mark.parametrize(
    "values, message",
    [
        ({"upgradeStrategy": "NewClusterWithIncrementalUpgrade"}, "is not one of"),
        ({"gcsFaultTolerance": {"redisAdress": "redis:6379"}}, "'redisAdress' was unexpected"),
        ({"models": {"download": {"source": "s3://b/m"}}}, "'source' was unexpected"),
        ({"models": {"download": {"sources": {"target": "http://x/m"}}}}, "does not match"),
        ({"targetGroup": {"podDisruptionBudget": {"maxUnavailable": 0}}}, "'maxUnavailable'"),
        ({"metrics": {"rayPodMonitor": {"enable": True}}}, "'enable' was unexpected"),
        ({"head": {"priorityClass": "high"}}, "'priorityClass' was unexpected"),
    ],
)
def test_typo_in_a_new_value_fails_the_schema(values, message):
    check = chart_ops.check_values(CHART, values)
    assert check.status == "FAIL" and message in check.detail, check.line()


def test_typo_fails_render_and_validate():
    report = chart_ops.validate_chart(CHART, {"gcsFaultTolerance": {"redisAdress": "redis:6379"}})
    lines = failures(report)
    assert [line.split(":")[0] for line in lines] == [
        "FAIL helm lint --strict",
        "FAIL helm template",
        "FAIL values.schema.json",
    ], report.text()


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"models": {"download": {"enabled": True, "sources": {"target": "s3://b/m"}}}},
            'set models.claimName to "" (the PVC is read-only)',
        ),
        ({"models": {"claimName": "", "download": {"enabled": True}}}, "needs models.download"),
        ({"gcsFaultTolerance": {"enabled": True}}, "gcsFaultTolerance.redisAddress is required"),
    ],
)
def test_incomplete_option_fails_rendering(values, message):
    report = chart_ops.validate_chart(CHART, values)
    template = [line for line in failures(report) if line.startswith("FAIL helm template")]
    assert template and message in template[0], report.text()


def test_disruption_budget_check_catches_what_kubernetes_would_not(default_docs):
    assert chart_checks.check_disruption_budgets(default_docs).status == "PASS"

    def broken(edit) -> chart_checks.Check:
        docs = copy.deepcopy(default_docs)
        edit(of_kind(docs, "PodDisruptionBudget")[0]["spec"])
        return chart_checks.check_disruption_budgets(docs)

    def max_unavailable(spec):
        del spec["minAvailable"]
        spec["maxUnavailable"] = 1

    check = broken(max_unavailable)
    assert check.status == "FAIL" and "no eviction is ever allowed" in check.detail
    check = broken(lambda spec: spec.update(minAvailable="50%"))
    assert check.status == "FAIL" and "minAvailable as a count" in check.detail
    check = broken(lambda spec: spec["selector"]["matchLabels"].update({"ray.io/cluster": "x"}))
    assert check.status == "FAIL" and "KubeRay names the RayCluster" in check.detail
    check = broken(lambda spec: spec["selector"]["matchLabels"].update({"ray.io/group": "drafts"}))
    assert check.status == "FAIL" and "selects the pods of [], not one worker group" in check.detail
    check = broken(lambda spec: spec["selector"]["matchLabels"].pop("ray.io/group"))
    assert check.status == "FAIL" and "['draft', 'target']" in check.detail


def test_pod_monitor_check_catches_a_wrong_port_or_selector(all_on_docs):
    docs = copy.deepcopy(all_on_docs)
    chart_ops._only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] = "metric"
    check = chart_checks.check_pod_monitor(chart_ops._only(docs, "PodMonitor"), docs)
    assert check.status == "FAIL" and "no port named 'metric'" in check.detail

    docs = copy.deepcopy(all_on_docs)
    monitor = chart_ops._only(docs, "PodMonitor")
    del monitor["spec"]["selector"]["matchLabels"]["ray.io/is-ray-node"]
    check = chart_checks.check_pod_monitor(monitor, docs)
    assert check.status == "FAIL" and "Pod/specray-test-generation" in check.detail

    monitor["spec"]["selector"]["matchLabels"]["ray.io/node-type"] = "worker"
    check = chart_checks.check_pod_monitor(monitor, docs)
    assert check.status == "FAIL" and "selects no pods of ['head']" in check.detail


def test_ray_pod_check_catches_ports_mounts_and_kuberay_ft_rules(default_docs):
    name = "Ray pods (metrics port, volume mounts, GCS fault tolerance)"
    docs = copy.deepcopy(default_docs)
    cluster_of(docs)["workerGroupSpecs"][0]["rayStartParams"]["metrics-export-port"] = "9090"
    check = chart_checks.check_ray_pods(docs)
    assert check.status == "FAIL" and "draft: container port 'metrics' is 8080" in check.detail

    report = chart_ops.validate_chart(
        CHART, {"targetGroup": {"extraVolumeMounts": [{"name": "cache", "mountPath": "/c"}]}}
    )
    assert [line.split(":")[0] for line in failures(report)] == [f"FAIL {name}"], report.text()
    assert "target: container ray-worker mounts 'cache', no volume" in failures(report)[0]

    password_env = {"head": {"extraEnv": [{"name": "REDIS_PASSWORD", "value": "x"}]}}
    ft = {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"}}
    report = chart_ops.validate_chart(CHART, {**ft, **password_env})
    assert [line.split(":")[0] for line in failures(report)] == [f"FAIL {name}"], report.text()
    assert "head env REDIS_PASSWORD with gcsFaultToleranceOptions" in failures(report)[0]

    docs = chart_ops.render(
        CHART, {"extraEnv": [{"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}]}
    )
    check = chart_checks.check_ray_pods(docs)
    assert check.status == "FAIL" and "RAY_REDIS_ADDRESS needs gcsFaultToleranceOptions" in (
        check.detail
    )


def test_kuberay_schema_is_strict_under_gcs_fault_tolerance(all_on_docs):
    rayservice = copy.deepcopy(chart_ops._only(all_on_docs, "RayService"))
    assert chart_ops.check_rayservice(rayservice).status == "PASS"
    options = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    options["redisPasword"] = options.pop("redisPassword")
    check = chart_ops.check_rayservice(rayservice)
    assert check.status == "FAIL" and "'redisPasword' was unexpected" in check.detail
    del options["redisAddress"]
    assert "'redisAddress' is a required property" in chart_ops.check_rayservice(rayservice).detail


# ---- specray cluster render ---------------------------------------------------------------
def canonical(docs: list[dict]) -> list[str]:
    return sorted(json.dumps(doc, sort_keys=True) for doc in docs)


def test_cli_render_prints_the_documents_validate_checks(capsys, default_docs):
    assert cli.main(["cluster", "render", str(CHART)]) == 0
    out = capsys.readouterr().out
    docs = [doc for doc in yaml.safe_load_all(out) if doc]
    assert canonical(docs) == canonical(default_docs)
    assert {"RayService", "PodDisruptionBudget", "Service", "Pod"} == {d["kind"] for d in docs}
    sections = out.split("---\n")[1:]
    assert len(sections) == len(docs)
    assert all(s.startswith("# Source: specray/templates/") for s in sections)


def test_cli_render_takes_values_files_and_reports_schema_errors(capsys, tmp_path, all_on_docs):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(EVERY_OPTION_ON))
    assert cli.main(["cluster", "render", str(CHART), "--values", str(values)]) == 0
    docs = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    assert canonical(docs) == canonical(all_on_docs)
    assert [d["metadata"]["name"] for d in of_kind(docs, "PodDisruptionBudget")] == [
        "specray-draft",
        "specray-target",
    ]

    values.write_text("gcsFaultTolerance: {redisAdress: 'redis:6379'}\n")
    assert cli.main(["cluster", "render", str(CHART), "--values", str(values)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "'redisAdress' not allowed" in captured.err
