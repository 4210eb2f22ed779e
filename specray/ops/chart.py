"""Offline validation of the Helm chart (``helm/specray``): no cluster, no network, no helm
binary needed. What ``specray cluster validate`` runs, step by step:

1. ``helm lint --strict`` through Helm's own Go library (PyPI ``helm-python-sdk``); with a
   ``helm`` binary on PATH also its ``lint --strict`` and ``template`` (same documents?).
2. The values (``values.yaml``, then merged with the user's) against ``values.schema.json``.
3. Every rendered document of a core kind through ``kubernetes-validate --strict``; the
   RayService through the vendored KubeRay schema (``deploy/schemas/kuberay``); a
   ServiceMonitor / PodMonitor through a minimal hand-written schema and against what it
   selects (:mod:`specray.ops.chart_checks`).
4. ``serveConfigV2`` through Ray Serve's ``ServeDeploySchema`` and its args through
   ``AppArgs``; compared with :func:`specray.serve.launch.deploy_config` of those args.
5. The pods' wiring (ports, the auth token's env var, the TLS mount), the Ray pods' metrics
   ports, volume mounts and GCS fault tolerance, the PodDisruptionBudgets' selectors
   (:mod:`specray.ops.chart_checks`), and the node groups, read back as
   :class:`~specray.ops.node_types.NodeType`, through ``placement_problems``.

    report = validate_chart("helm/specray", {"app": {"tp_size": 4}, "targetGroup": {"gpus": 4}})
    print(report.text()); assert report.ok

Each ``check_*`` function takes rendered documents (``render``'s output, possibly edited) and
returns :class:`Check` results, so a single step can be run, or fed a broken document.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

from specray.ops.chart_checks import (
    Check,
    Report,
    check_disruption_budgets,
    check_pod_monitor,
    check_ray_pods,
    check_service_monitor,
    ray_containers,
)
from specray.ops.chart_checks import error_text as _error
from specray.ops.chart_checks import label as _label
from specray.ops.chart_checks import only as _only
from specray.ops.chart_checks import passed as _passed

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "specray"
KUBERAY_SCHEMA = ROOT / "deploy" / "schemas" / "kuberay" / "rayservice-v1.schema.json"
KUBERNETES_VERSION = "1.37.0"  # the newest release kubernetes-validate 1.37.0 ships
RELEASE, NAMESPACE = "specray", "default"
LINT_WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error; --strict fails on >= 2
HTTP_PORT = 8000  # Serve's HTTP proxy on the head (http_options.port)
TLS_FIELDS = ("tls_cert", "tls_key", "tls_client_ca")


# ---- Helm ---------------------------------------------------------------------------------
def _helm_library() -> str:
    import helm_python

    return (
        f"helm-python-sdk {helm_python.__version__}, Helm {helm_python.helm_sdk_version()} library"
    )


def lint(chart_dir: str | Path = CHART_DIR, values: Mapping | None = None) -> list[str]:
    """``helm lint --strict``: its warnings and errors as ``path: message`` (empty: clean)."""
    import helm_python

    result = helm_python.lint(str(chart_dir), _plain(values), strict=True)
    problems = [
        f"{message['path']}: {' '.join(message['error'].split())}"
        for message in result.get("messages", [])
        if message.get("severity", 0) >= LINT_WARNING
    ]
    known = {problem.split(": ", 1)[1] for problem in problems}
    errors = (" ".join(error.split()) for error in result.get("errors", []))
    problems += [error for error in errors if error not in known]
    return problems


def render(
    chart_dir: str | Path = CHART_DIR,
    values: Mapping | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[dict]:
    """``helm template``: the rendered documents (test hooks included, NOTES.txt not)."""
    return _documents(text for _, text in _manifests(chart_dir, values, name, namespace))


def render_text(
    chart_dir: str | Path = CHART_DIR,
    values: Mapping | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> str:
    """``helm template``'s output: each document after ``---`` and a ``# Source:`` line."""
    return "".join(
        f"---\n# Source: {path}\n{document.strip()}\n"
        for path, text in _manifests(chart_dir, values, name, namespace)
        for document in _DOCUMENT_SEPARATOR.split(text)
        if document.strip()
    )


_DOCUMENT_SEPARATOR = re.compile(r"^---[ \t]*$", re.MULTILINE)


def _manifests(chart_dir, values, name: str, namespace: str) -> list[tuple[str, str]]:
    """(template path, rendered text), sorted by path: manifests only. The Helm library
    checks the values against values.schema.json first (HelmValuesError)."""
    import helm_python

    with helm_python.Chart.load(str(chart_dir)) as chart:
        manifests = chart.render(_plain(values), name=name, namespace=namespace)
    return [(path, text) for path, text in sorted(manifests.items()) if _is_manifest(path)]


def _is_manifest(path: str) -> bool:
    return not path.endswith("NOTES.txt") and not Path(path).name.startswith("_")


def _documents(texts: Iterable[str]) -> list[dict]:
    return [doc for text in texts for doc in yaml.safe_load_all(text) if doc]


def _plain(values: Mapping | None) -> dict | None:
    return None if values is None else json.loads(json.dumps(values))


def values_from_files(paths: Sequence[str | Path]) -> dict:
    """User values from ``-f`` files, later files winning key by key (as Helm merges them)."""
    merged: dict = {}
    for path in paths:
        _deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    return merged


def _deep_merge(into: dict, update: Mapping) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def check_helm_binary(
    chart_dir: str | Path,
    values: Mapping | None,
    docs: Sequence[dict],
    *,
    name: str,
    namespace: str,
) -> list[Check]:
    """The ``helm`` CLI's own lint and template, when one is on PATH."""
    helm = shutil.which("helm")
    if helm is None:
        reason = "skipped helm lint/template (the Helm library via helm-python-sdk ran)"
        return [Check("SKIP", "helm CLI", f"helm binary absent: {reason}")]
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if values is not None:
            values_file = Path(tmp) / "values.json"  # JSON is YAML
            values_file.write_text(json.dumps(values))
            extra = ["-f", str(values_file)]
        linted = subprocess.run(
            [helm, "lint", "--strict", str(chart_dir), *extra], capture_output=True, text=True
        )
        templated = subprocess.run(
            [helm, "template", name, str(chart_dir), "--namespace", namespace, *extra],
            capture_output=True,
            text=True,
        )
    checks = [_passed("helm CLI lint --strict", [_tail(linted)] if linted.returncode else [])]
    if templated.returncode:
        return [*checks, Check("FAIL", "helm CLI template", _tail(templated))]
    theirs = _documents([templated.stdout])
    same = sorted(map(_canonical, theirs)) == sorted(map(_canonical, docs))
    problems = [] if same else ["renders other documents than the Helm library"]
    return [*checks, _passed("helm CLI template", problems, f"{len(theirs)} documents, same")]


def _tail(process: subprocess.CompletedProcess) -> str:
    return (process.stderr or process.stdout).strip()[-500:]


def _canonical(doc: Mapping) -> str:
    return json.dumps(doc, sort_keys=True)


# ---- values ---------------------------------------------------------------------------------
def check_values(chart_dir: str | Path = CHART_DIR, values: Mapping | None = None) -> Check:
    """``values.yaml``, and the values Helm would install with, against values.schema.json."""
    import helm_python
    import jsonschema

    chart_dir = Path(chart_dir)
    schema = json.loads((chart_dir / "values.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    defaults = yaml.safe_load((chart_dir / "values.yaml").read_text())
    problems = [f"values.yaml: {_error(error)}" for error in validator.iter_errors(defaults)]
    if values is not None:
        with helm_python.Chart.load(str(chart_dir)) as chart:
            merged = chart.merge_values(_plain(values))
        problems += [f"merged values: {_error(e)}" for e in validator.iter_errors(merged)]
    scope = "values.yaml" if values is None else "values.yaml and merged user values"
    return _passed("values.schema.json", problems, f"jsonschema draft-07, {scope}")


# ---- Kubernetes and KubeRay schemas ----------------------------------------------------------
def check_kubernetes(docs: Sequence[dict]) -> list[Check]:
    """Core kinds through kubernetes-validate --strict; the CRDs go to their own checks."""
    import kubernetes_validate

    checks = []
    for doc in docs:
        label = _label(doc)
        if doc.get("kind") == "RayService":
            checks.append(check_rayservice(doc))
        elif doc.get("kind") == "ServiceMonitor":
            checks.append(check_service_monitor(doc, docs))
        elif doc.get("kind") == "PodMonitor":
            checks.append(check_pod_monitor(doc, docs))
        else:
            name = f"kubernetes-validate --strict {label}"
            try:
                version = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                checks.append(Check("FAIL", name, _error(error)))
            except kubernetes_validate.SchemaNotFoundError as error:
                checks.append(Check("FAIL", name, error.message))
            else:
                checks.append(Check("PASS", name, f"Kubernetes {version}"))
    return checks


def check_rayservice(doc: Mapping, schema_path: str | Path = KUBERAY_SCHEMA) -> Check:
    """The RayService against the vendored, strict KubeRay schema."""
    import jsonschema

    name = f"KubeRay schema {_label(doc)}"
    schema_path = Path(schema_path)
    if not schema_path.is_file():
        return Check("SKIP", name, f"{schema_path} not found (not in a source checkout)")
    validator = jsonschema.Draft202012Validator(json.loads(schema_path.read_text()))
    errors = sorted(validator.iter_errors(doc), key=lambda error: list(error.absolute_path))
    return _passed(name, [_error(error) for error in errors], f"vendored {schema_path.name}")


# ---- the Serve config -----------------------------------------------------------------------
def serve_config(docs: Sequence[dict]) -> dict:
    """The RayService's ``serveConfigV2``, parsed."""
    return yaml.safe_load(_only(docs, "RayService")["spec"]["serveConfigV2"])


def load_app_args(args: Mapping):
    """``AppArgs(**args)`` and a note. TLS paths name files inside the pods; where they do not
    exist here, empty stand-in files take their place for the check (AppArgs requires them)."""
    from specray.serve.config import AppArgs

    missing = [f for f in TLS_FIELDS if args.get(f) is not None and not Path(args[f]).is_file()]
    if not missing:
        return AppArgs(**args), ""
    with tempfile.TemporaryDirectory() as tmp:
        stand_ins = {}
        for index, field in enumerate(missing):
            stand_ins[field] = Path(tmp) / f"{index}-{Path(args[field]).name}"
            stand_ins[field].touch()
        validated = AppArgs(**{**args, **{k: str(v) for k, v in stand_ins.items()}})
    note = f"{', '.join(missing)}: pod paths, absent here, checked with stand-in files"
    return validated.model_copy(update={f: args[f] for f in missing}), note


def check_serve_config(docs: Sequence[dict]) -> list[Check]:
    """Ray Serve's ServeDeploySchema, AppArgs per application, and deploy_config's shape."""
    import pydantic
    import ray
    from ray.serve.schema import ServeDeploySchema

    name = f"serveConfigV2 ServeDeploySchema (ray {ray.__version__})"
    try:
        config = serve_config(docs)
        ServeDeploySchema(**config)
    except (ValueError, KeyError, yaml.YAMLError) as error:  # pydantic's errors are ValueErrors
        return [Check("FAIL", name, _pydantic(error))]
    checks = [Check("PASS", name, f"{len(config['applications'])} application(s)")]
    for app in config["applications"]:
        app_name = f"AppArgs of application {app['name']!r}"
        try:
            args, note = load_app_args(app.get("args") or {})
        except (pydantic.ValidationError, ValueError) as error:
            checks.append(Check("FAIL", app_name, _pydantic(error)))
            continue
        checks.append(Check("PASS", app_name, note or "specray.serve.config"))
        problems = _deploy_config_differences(config, app, args)
        checks.append(_passed("serveConfigV2 vs deploy_config", problems, "same app and policy"))
    return checks


def _pydantic(error: Exception) -> str:
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return str(error).strip()
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in errors())


def _deploy_config_differences(config: Mapping, app: Mapping, args) -> list[str]:
    """What `specray serve` would deploy for these args (on 0.0.0.0:8000), against the chart's."""
    from specray.cluster.scaling_rules import AutoscalingSettings
    from specray.serve.launch import deploy_config

    expected = deploy_config(args, http_host="0.0.0.0", http_port=HTTP_PORT)
    # The chart keeps Serve's proxy on plain HTTP inside the pod: KubeRay's readiness probe
    # calls http://localhost:8000/-/healthz. HTTPS ends at the Ingress / Gateway in front.
    expected["http_options"] = {
        key: value for key, value in expected["http_options"].items() if not key.startswith("ssl_")
    }
    wanted_app = expected["applications"][0]
    problems = [
        f"{key} is {config.get(key)!r}, deploy_config has {expected[key]!r}"
        for key in ("proxy_location", "http_options")
        if config.get(key) != expected[key]
    ]
    problems += [
        f"application {key} is {app.get(key)!r}, deploy_config has {wanted_app[key]!r}"
        for key in ("name", "route_prefix", "import_path")
        if app.get(key) != wanted_app[key]
    ]
    if wanted_app["args"].get("autoscaling", "deployment") != args.autoscaling:
        problems.append(
            f"args.autoscaling is {args.autoscaling!r}, deploy_config sets "
            f"{wanted_app['args'].get('autoscaling')!r}"
        )
    policy, wanted_policy = app.get("autoscaling_policy"), wanted_app.get("autoscaling_policy")
    if (policy is None) != (wanted_policy is None):
        problems.append(f"autoscaling_policy is {policy!r}, deploy_config has {wanted_policy!r}")
    elif policy is not None:
        if policy.get("policy_function") != wanted_policy["policy_function"]:
            problems.append(f"policy_function is {policy.get('policy_function')!r}")
        try:
            settings = AutoscalingSettings.from_dict(policy.get("policy_kwargs") or {})
        except (TypeError, ValueError) as error:
            problems.append(f"policy_kwargs: {error}")
        else:
            if settings != AutoscalingSettings.from_dict(wanted_policy["policy_kwargs"]):
                problems.append("policy_kwargs differ from AppArgs.autoscaling_settings()")
    return problems


# ---- pods: wiring and placement ------------------------------------------------------------
def check_wiring(docs: Sequence[dict]) -> Check:
    """What ties the pods to the app's args: ports, the auth token's env var, TLS mounts."""
    name = "wiring (ports, auth env, TLS mounts, head)"
    try:
        rayservice, service = _only(docs, "RayService"), _only(docs, "Service")
        args, _ = load_app_args(serve_config(docs)["applications"][0].get("args") or {})
        problems = _wiring_problems(rayservice, service, args)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        return Check("FAIL", name, f"cannot read the rendered documents: {error!r}")
    return _passed(name, problems, f"Service {service['metadata']['name']} -> head")


def _wiring_problems(rayservice: Mapping, service: Mapping, args) -> list[str]:
    containers = ray_containers(rayservice)
    head_group = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    head_ports = {p.get("name"): p["containerPort"] for p in containers["head"].get("ports", [])}
    problems = []
    if not args.ingress_on_head:
        problems.append("args.ingress_on_head must be true: the gRPC API runs on the head")
    if head_group.get("serviceType", "ClusterIP") != "ClusterIP":
        problems.append("the head Service (Ray's internal ports) must stay ClusterIP")
    if head_ports.get("serve") != HTTP_PORT:  # KubeRay's serve Service and proxy health check
        problems.append(f"head container port 'serve' must be {HTTP_PORT}")
    if head_ports.get("grpc") != args.grpc_port:
        problems.append(
            f"head container port 'grpc' is {head_ports.get('grpc')}, "
            f"args.grpc_port is {args.grpc_port}"
        )
    client_ports = {name for name in ("serve", "grpc") if name in head_ports}
    client_ports |= {head_ports[name] for name in client_ports}
    for port in service["spec"].get("ports", []):
        if port.get("targetPort") not in {*head_ports, *head_ports.values()}:
            problems.append(f"Service port {port.get('name')!r}: no such head container port")
        elif port.get("targetPort") not in client_ports:
            problems.append(
                f"Service port {port.get('name')!r} targets {port.get('targetPort')!r}: only the "
                "serve (HTTP) and grpc ports face clients; Ray's stay internal"
            )
        if port.get("name") == "grpc" and port.get("port") != args.grpc_port:
            problems.append(
                f"Service port 'grpc' is {port.get('port')}, args.grpc_port {args.grpc_port}"
            )
    if service["spec"].get("selector", {}).get("ray.io/node-type") != "head":
        problems.append("the Service must select the head pod (ray.io/node-type: head)")
    for group, container in containers.items():
        env = {e["name"]: e for e in container.get("env", [])}
        token_env = env.get(args.auth_token_env or "") or {}
        if args.auth_token_env and "secretKeyRef" not in token_env.get("valueFrom", {}):
            problems.append(f"{group}: no env {args.auth_token_env} from a Secret (auth_token_env)")
        mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
        for field in TLS_FIELDS:
            path = getattr(args, field)
            if path and not any(path.startswith(mount) for mount in mounts):
                problems.append(f"{group}: {field} {path} is on no volume mount")
    if args.auth_token is not None:
        problems.append("args.auth_token puts the token in the spec: use auth_token_env")
    return problems


def node_types(rayservice: Mapping) -> list:
    """The RayService's groups as the node types Ray sees: CPU from num-cpus (else the
    container's CPU limit, else its request, rounded up as KubeRay does), GPU from num-gpus
    (else nvidia.com/gpu), custom resources from the ``resources`` flag. max_nodes: pods x
    numOfHosts, where pods is maxReplicas with Ray's autoscaler, else the fixed replicas."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    autoscaled = bool(cluster.get("enableInTreeAutoscaling"))
    types = [_node_type("head", cluster["headGroupSpec"], 1, is_head=True)]
    for group in cluster.get("workerGroupSpecs") or []:
        low, high = group.get("minReplicas", 0), group["maxReplicas"]
        pods = high if autoscaled else min(max(group.get("replicas", 0), low), high)
        types.append(_node_type(group["groupName"], group, pods * group.get("numOfHosts", 1)))
    return types


def _node_type(name: str, group: Mapping, max_nodes: int, *, is_head: bool = False):
    from specray.ops.node_types import NodeType

    params = group.get("rayStartParams") or {}
    container = group["template"]["spec"]["containers"][0]
    limits = (container.get("resources") or {}).get("limits") or {}
    requests = (container.get("resources") or {}).get("requests") or {}
    if "num-cpus" in params:
        cpus = float(params["num-cpus"])
    else:
        cpu = limits.get("cpu", requests.get("cpu"))
        cpus = float(math.ceil(cpu_quantity(cpu))) if cpu is not None else 0.0
    gpus = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    resources = {"CPU": cpus, "GPU": gpus, **ray_resources(params.get("resources"), name)}
    return NodeType(name=name, resources=resources, max_nodes=max_nodes, is_head=is_head)


def cpu_quantity(value) -> float:
    """A Kubernetes CPU quantity: 4, "4", "4.5", "500m"."""
    text = str(value).strip()
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ray_resources(value: str | None, group: str = "?") -> dict[str, float]:
    """``rayStartParams.resources`` in the form KubeRay's docs require: the JSON object as a
    quoted string with escaped quotes, ``"{\\"draft\\": 1000}"`` (it reaches a shell unquoted)."""
    if value is None:
        return {}
    text = value.strip()
    if not (len(text) >= 2 and text[0] == text[-1] == '"' and '\\"' in text):
        raise ValueError(
            f"group {group!r}: rayStartParams.resources {value!r} must be a quoted JSON object "
            'with escaped quotes, e.g. "{\\"draft\\": 1000}"'
        )
    parsed = json.loads(text[1:-1].replace('\\"', '"'))
    if not isinstance(parsed, dict):
        raise ValueError(f"group {group!r}: rayStartParams.resources is not a JSON object")
    return {key: float(amount) for key, amount in parsed.items()}


def check_placement(docs: Sequence[dict]) -> Check:
    """The node groups against the app's placement groups and draft pool at their largest."""
    from specray.ops.node_types import PlacementAsk, placement_problems

    name = "placement (node groups vs AppArgs)"
    try:
        types = node_types(_only(docs, "RayService"))
        args, _ = load_app_args(serve_config(docs)["applications"][0].get("args") or {})
    except (KeyError, IndexError, TypeError, ValueError) as error:
        return Check("FAIL", name, str(error))
    problems = placement_problems(PlacementAsk.from_app_args(args), types)
    amounts = [", ".join(f"{k}: {v:g}" for k, v in t.resources.items()) for t in types]
    shown = ", ".join(
        f"{t.name} x{t.max_nodes} {{{a}}}" for t, a in zip(types, amounts, strict=True)
    )
    return _passed(name, problems, shown)


# ---- all of it ------------------------------------------------------------------------------
def validate_chart(
    chart_dir: str | Path = CHART_DIR,
    values: Mapping | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Report:
    """Every check above on the chart rendered with ``values`` (the user's overrides, as
    ``-f``/``--set`` give them; None: the defaults). ``report.ok`` is False on any FAIL."""
    import helm_python

    checks = [_passed("helm lint --strict", lint(chart_dir, values), _helm_library())]
    try:
        docs = render(chart_dir, values, name=name, namespace=namespace)
    except (helm_python.HelmError, yaml.YAMLError) as error:
        checks.append(Check("FAIL", "helm template", " ".join(str(error).split())))
        checks.append(check_values(chart_dir, values))
        checks.append(Check("SKIP", "rendered documents", "nothing rendered"))
        return Report(tuple(checks))
    kinds = ", ".join(_label(doc) for doc in docs)
    checks.append(Check("PASS", "helm template", f"{len(docs)} documents: {kinds}"))
    checks += check_helm_binary(chart_dir, values, docs, name=name, namespace=namespace)
    checks.append(check_values(chart_dir, values))
    checks += check_kubernetes(docs)
    checks += check_serve_config(docs)
    checks.append(check_wiring(docs))
    checks.append(check_ray_pods(docs))
    checks.append(check_disruption_budgets(docs))
    checks.append(check_placement(docs))
    return Report(tuple(checks))
