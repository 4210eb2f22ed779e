"""What :func:`specray.ops.chart.validate_chart` reports, and its checks of the objects around
the RayService's Ray pods, on rendered documents alone (no Helm, no Ray, no cluster):

- :func:`check_service_monitor`, :func:`check_pod_monitor`: the Prometheus Operator objects
  against minimal hand-written schemas (the CRDs are not vendored) and against what they
  select: the client Service and its ports, the Ray pods and their ``metrics`` port.
- :func:`check_disruption_budgets`: each PodDisruptionBudget selects the pods of exactly one
  worker group, by labels the pods will carry, with a count the disruption controller can use.
- :func:`check_ray_pods`: every Ray container's ``metrics`` port is Ray's
  ``metrics-export-port``, every volume mount names a volume of its pod, and KubeRay's rules for
  GCS fault tolerance hold (its admission check rejects the RayService otherwise).

Labels of a Ray pod: the template's, then KubeRay's own (``ray.io/node-type``, ``ray.io/group``,
``ray.io/is-ray-node``; ``ray.io/cluster`` is the RayCluster's generated name, so a selector
the chart renders cannot use it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RAY_METRICS_PORT = 8080  # Ray's default metrics-export-port
HEAD_GROUP = "headgroup"  # KubeRay's ray.io/group of the head pod
KUBERAY_CLUSTER_LABEL = "ray.io/cluster"
# KubeRay's ValidateRayClusterSpec: with gcsFaultToleranceOptions the Redis settings come from
# there only; without it RAY_REDIS_ADDRESS alone would turn GCS fault tolerance on.
GCS_FT_ENV = ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD")
GCS_FT_ANNOTATIONS = ("ray.io/ft-enabled", "ray.io/external-storage-namespace")


@dataclass(frozen=True)
class Check:
    status: str  # "PASS", "SKIP" or "FAIL"
    name: str
    detail: str = ""

    def line(self) -> str:
        if not self.detail:
            return f"{self.status} {self.name}"
        if self.status == "PASS":
            return f"{self.status} {self.name} ({self.detail})"
        return f"{self.status} {self.name}: {self.detail}"


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(check.status != "FAIL" for check in self.checks)

    def lines(self) -> list[str]:
        return [check.line() for check in self.checks]

    def text(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        return "\n".join([*self.lines(), f"{verdict}: {len(self.checks)} checks"])


def passed(name: str, problems: Sequence[str], detail: str = "") -> Check:
    if problems:
        return Check("FAIL", name, "; ".join(problems))
    return Check("PASS", name, detail)


def error_text(error) -> str:
    """A jsonschema error as ``path: message``."""
    where = "/".join(str(part) for part in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"


def label(doc: Mapping) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def only(docs: Sequence[dict], kind: str) -> dict:
    found = [doc for doc in docs if doc.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"expected one {kind}, rendered {len(found)}")
    return found[0]


# ---- the Ray pods -------------------------------------------------------------------------
def ray_groups(rayservice: Mapping) -> dict[str, dict]:
    """The head's and each worker group's spec, by group name ("head" for the head)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster.get("workerGroupSpecs") or []})
    return groups


def ray_containers(rayservice: Mapping) -> dict[str, dict]:
    """The Ray container (KubeRay's: the first one) of the head and of each worker group."""
    groups = ray_groups(rayservice)
    return {name: group["template"]["spec"]["containers"][0] for name, group in groups.items()}


def ray_pod_labels(rayservice: Mapping) -> dict[str, dict[str, str]]:
    """The labels each group's pods will carry: the template's, then KubeRay's own."""
    labels = {}
    for name, group in ray_groups(rayservice).items():
        node_type, group_label = ("head", HEAD_GROUP) if name == "head" else ("worker", name)
        template = (group["template"].get("metadata") or {}).get("labels") or {}
        kuberay = {"ray.io/node-type": node_type, "ray.io/group": group_label}
        labels[name] = {"ray.io/is-ray-node": "yes", **template, **kuberay}
    return labels


def _selected_groups(rayservice: Mapping, match_labels: Mapping) -> list[str]:
    return [
        name
        for name, labels in ray_pod_labels(rayservice).items()
        if match_labels.items() <= labels.items()
    ]


def check_ray_pods(docs: Sequence[dict]) -> Check:
    """Metrics ports, volume mounts, and KubeRay's GCS fault tolerance rules."""
    name = "Ray pods (metrics port, volume mounts, GCS fault tolerance)"
    try:
        rayservice = only(docs, "RayService")
        problems = _ray_pod_problems(rayservice)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        return Check("FAIL", name, f"cannot read the rendered documents: {error!r}")
    cluster = rayservice["spec"]["rayClusterConfig"]
    ft = cluster.get("gcsFaultToleranceOptions")
    detail = f"GCS fault tolerance: Redis {ft['redisAddress']}" if ft else "no GCS fault tolerance"
    return passed(name, problems, detail)


def _ray_pod_problems(rayservice: Mapping) -> list[str]:
    problems = []
    for group_name, group in ray_groups(rayservice).items():
        pod = group["template"]["spec"]
        params = group.get("rayStartParams") or {}
        export_port = int(params.get("metrics-export-port", RAY_METRICS_PORT))
        ports = {p.get("name"): p["containerPort"] for p in pod["containers"][0].get("ports", [])}
        if ports.get("metrics") != export_port:
            problems.append(
                f"{group_name}: container port 'metrics' is {ports.get('metrics')}, Ray exports "
                f"its metrics on {export_port} (rayStartParams metrics-export-port)"
            )
        volumes = {volume["name"] for volume in pod.get("volumes") or []}
        for container in [*(pod.get("initContainers") or []), *pod["containers"]]:
            for mount in container.get("volumeMounts") or []:
                if mount["name"] not in volumes:  # KubeRay's pods would fail to be created
                    problems.append(
                        f"{group_name}: container {container['name']} mounts {mount['name']!r}, "
                        "no volume of its pod"
                    )
    problems += _gcs_fault_tolerance_problems(rayservice)
    return problems


def _gcs_fault_tolerance_problems(rayservice: Mapping) -> list[str]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    env = {e["name"] for e in head["template"]["spec"]["containers"][0].get("env") or []}
    annotations = (rayservice.get("metadata") or {}).get("annotations") or {}
    if cluster.get("gcsFaultToleranceOptions") is None:
        if "RAY_REDIS_ADDRESS" in env:
            return ["head env RAY_REDIS_ADDRESS needs gcsFaultToleranceOptions: KubeRay rejects it"]
        return []
    problems = [
        f"head env {var} with gcsFaultToleranceOptions: KubeRay rejects it (set it there)"
        for var in GCS_FT_ENV
        if var in env
    ]
    if "redis-password" in (head.get("rayStartParams") or {}):
        problems.append("head rayStartParams redis-password with gcsFaultToleranceOptions")
    problems += [
        f"RayService annotation {key} with gcsFaultToleranceOptions: KubeRay rejects it"
        for key in GCS_FT_ANNOTATIONS
        if key in annotations
    ]
    return problems


# ---- disruption budgets -------------------------------------------------------------------
def check_disruption_budgets(docs: Sequence[dict]) -> Check:
    """Each PodDisruptionBudget: one worker group's pods, selected without ray.io/cluster, and
    minAvailable as a count. A RayCluster has no scale subresource; with maxUnavailable or a
    percentage the disruption controller cannot size the group and allows no eviction."""
    name = "disruption budgets (PodDisruptionBudget -> worker group)"
    budgets = [doc for doc in docs if doc.get("kind") == "PodDisruptionBudget"]
    if not budgets:
        return Check("PASS", name, "none rendered")
    try:
        problems, shown = _budget_problems(budgets, only(docs, "RayService"))
    except (KeyError, IndexError, TypeError, ValueError) as error:
        return Check("FAIL", name, f"cannot read the rendered documents: {error!r}")
    return passed(name, problems, ", ".join(shown))


def _budget_problems(budgets: Sequence[dict], rayservice: Mapping) -> tuple[list, list]:
    problems, shown = [], []
    for budget in budgets:
        spec = budget.get("spec") or {}
        selector = spec.get("selector") or {}
        match_labels = selector.get("matchLabels") or {}
        if "maxUnavailable" in spec or not isinstance(spec.get("minAvailable"), int):
            problems.append(
                f"{label(budget)}: needs minAvailable as a count (RayCluster has no scale "
                "subresource: with maxUnavailable or a percentage no eviction is ever allowed)"
            )
        if KUBERAY_CLUSTER_LABEL in match_labels or selector.get("matchExpressions"):
            problems.append(
                f"{label(budget)}: select by matchLabels only, without {KUBERAY_CLUSTER_LABEL} "
                "(KubeRay names the RayCluster)"
            )
            continue
        groups = _selected_groups(rayservice, match_labels)
        if len(groups) != 1 or groups == ["head"]:
            problems.append(f"{label(budget)} selects the pods of {groups}, not one worker group")
        else:
            shown.append(
                f"{label(budget)} -> {groups[0]} (minAvailable {spec.get('minAvailable')})"
            )
    return problems, shown


# ---- Prometheus Operator objects ----------------------------------------------------------
# prometheus-operator's CRDs are not vendored: only the fields this chart relies on are checked.
_INTERVAL = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"}
_ENDPOINT = {
    "type": "object",
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string", "pattern": "^/"},
        "interval": _INTERVAL,
    },
}
_SELECTOR = {"type": "object", "properties": {"matchLabels": {"type": "object"}}}


def _monitor_schema(endpoints_key: str) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": {"type": "object", "required": ["name"]},
            "spec": {
                "type": "object",
                "required": ["selector", endpoints_key],
                "properties": {
                    "selector": _SELECTOR,
                    endpoints_key: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


SERVICE_MONITOR_SCHEMA = _monitor_schema("endpoints")
POD_MONITOR_SCHEMA = _monitor_schema("podMetricsEndpoints")


def _schema_problems(doc: Mapping, schema: Mapping) -> list[str]:
    import jsonschema

    return [error_text(e) for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]


def check_service_monitor(doc: Mapping, docs: Sequence[dict]) -> Check:
    """A minimal schema, then: a rendered Service matches its selector and has its ports."""
    name = f"hand-written schema {label(doc)}"
    problems = _schema_problems(doc, SERVICE_MONITOR_SCHEMA)
    if problems:
        return Check("FAIL", name, "; ".join(problems))
    wanted = doc["spec"]["selector"].get("matchLabels") or {}
    services = [
        d
        for d in docs
        if d.get("kind") == "Service"
        and wanted.items() <= (d["metadata"].get("labels") or {}).items()
    ]
    if len(services) != 1:
        return Check("FAIL", name, f"selects {len(services)} rendered Services, expected 1")
    ports = {port.get("name") for port in services[0]["spec"].get("ports", [])}
    missing = [e["port"] for e in doc["spec"]["endpoints"] if e["port"] not in ports]
    problems = [f"{label(services[0])} has no port named {port!r}" for port in missing]
    detail = f"selector and endpoints only, not the CRD; scrapes {label(services[0])}"
    return passed(name, problems, detail)


def check_pod_monitor(doc: Mapping, docs: Sequence[dict]) -> Check:
    """A minimal schema, then: it selects every Ray pod group and no other rendered pod, and
    each selected Ray container has the endpoints' ports."""
    name = f"hand-written schema {label(doc)}"
    problems = _schema_problems(doc, POD_MONITOR_SCHEMA)
    if problems:
        return Check("FAIL", name, "; ".join(problems))
    rayservice = only(docs, "RayService")
    wanted = doc["spec"]["selector"].get("matchLabels") or {}
    groups = _selected_groups(rayservice, wanted)
    missing = sorted(set(ray_groups(rayservice)) - set(groups))
    if missing:
        problems.append(f"selects no pods of {missing}: Ray's metrics of every node")
    others = [
        label(d)
        for d in docs
        if d.get("kind") == "Pod" and wanted.items() <= (d["metadata"].get("labels") or {}).items()
    ]
    if others:
        problems.append(f"selects {others}, not a Ray pod")
    containers = ray_containers(rayservice)
    for group in groups:
        ports = {p.get("name") for p in containers[group].get("ports", [])}
        problems += [
            f"{group}: the Ray container has no port named {endpoint['port']!r}"
            for endpoint in doc["spec"]["podMetricsEndpoints"]
            if endpoint["port"] not in ports
        ]
    detail = f"selector and endpoints only, not the CRD; scrapes {', '.join(groups)}"
    return passed(name, problems, detail)
