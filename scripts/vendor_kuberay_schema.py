"""Write the vendored KubeRay RayService schema: deploy/schemas/kuberay/rayservice-v1.schema.json.

    python scripts/vendor_kuberay_schema.py          # (re)write the file
    python scripts/vendor_kuberay_schema.py --check  # exit 1 if the file is not what this writes

The KubeRay CRD (~786 KB) is not vendored. Its KubeRay-specific structure is written out below
by hand (field names, types and required lists: see deploy/schemas/kuberay/README.md for where
each comes from), stricter than the API server: unknown fields are errors here, where the
server would prune them silently. The core Kubernetes types it embeds (PodTemplateSpec,
Service, ...) are copied from kubernetes-validate's strict schemas, with every ``$defs`` entry
they reach, so the output is one self-contained draft 2020-12 JSON Schema. Same
kubernetes-validate version in, same bytes out (a test checks the committed file).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "deploy" / "schemas" / "kuberay" / "rayservice-v1.schema.json"
KUBERNETES_VERSION = "1.37.0"  # kubernetes-validate's strict schemas for this release
CORE = "io.k8s.api.core.v1."
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
RAY = "io.ray.v1."  # our names for KubeRay's types (Go package ray-operator/apis/ray/v1)

INT32 = {"type": "integer", "format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1}
BOOLEAN = {"type": "boolean"}
STRING = {"type": "string"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


def strict_object(description: str, properties: dict, required: tuple[str, ...] = ()) -> dict:
    schema = {
        "description": description,
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        schema["required"] = list(required)
    return schema


def kuberay_definitions() -> dict[str, dict]:
    """RayService v1's own types. Required lists: the union over KubeRay v1 releases (older
    CRDs also require rayStartParams in both group specs; newer ones only template)."""
    return {
        RAY + "RayServiceSpec": strict_object(
            "RayServiceSpec: the desired state of a RayService.",
            {
                "serveConfigV2": {
                    **STRING,
                    "description": "The Serve deploy config (applications), a YAML string.",
                },
                "rayClusterConfig": ref(RAY + "RayClusterSpec"),
                "serveService": ref(CORE + "Service"),
                "upgradeStrategy": ref(RAY + "RayServiceUpgradeStrategy"),
                "serviceUnhealthySecondThreshold": {**INT32, "deprecated": True},
                "deploymentUnhealthySecondThreshold": {**INT32, "deprecated": True},
                "excludeHeadPodFromServeSvc": BOOLEAN,
            },
            required=("rayClusterConfig",),
        ),
        RAY + "RayServiceUpgradeStrategy": strict_object(
            "How a RayService rolls out a changed rayClusterConfig.",
            {"type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]}},
        ),
        RAY + "RayClusterSpec": strict_object(
            "RayClusterSpec: the Ray cluster a RayService runs on.",
            {
                "rayVersion": STRING,
                "enableInTreeAutoscaling": BOOLEAN,
                "autoscalerOptions": ref(RAY + "AutoscalerOptions"),
                "headGroupSpec": ref(RAY + "HeadGroupSpec"),
                "workerGroupSpecs": {"type": "array", "items": ref(RAY + "WorkerGroupSpec")},
                "headServiceAnnotations": STRING_MAP,
                "suspend": BOOLEAN,
                "gcsFaultToleranceOptions": ref(RAY + "GcsFaultToleranceOptions"),
            },
            required=("headGroupSpec",),
        ),
        RAY + "GcsFaultToleranceOptions": strict_object(
            "GCS fault tolerance: the GCS's state in an external Redis (KubeRay 1.3+).",
            {
                "redisAddress": STRING,
                "redisUsername": ref(RAY + "RedisCredential"),
                "redisPassword": ref(RAY + "RedisCredential"),
                "externalStorageNamespace": STRING,
            },
            required=("redisAddress",),
        ),
        RAY + "RedisCredential": strict_object(
            "A Redis username or password: a value, or where to read it (a Secret's key).",
            {"value": STRING, "valueFrom": ref(CORE + "EnvVarSource")},
        ),
        RAY + "AutoscalerOptions": strict_object(
            "Overrides for the Ray autoscaler sidecar.",
            {
                "resources": ref(CORE + "ResourceRequirements"),
                "image": STRING,
                "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                "securityContext": ref(CORE + "SecurityContext"),
                "idleTimeoutSeconds": INT32,
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "version": {"enum": ["v1", "v2"]},
                "env": {"type": "array", "items": ref(CORE + "EnvVar")},
                "envFrom": {"type": "array", "items": ref(CORE + "EnvFromSource")},
                "volumeMounts": {"type": "array", "items": ref(CORE + "VolumeMount")},
            },
        ),
        RAY + "HeadGroupSpec": strict_object(
            "The head pod.",
            {
                "rayStartParams": {**STRING_MAP, "description": "`ray start` flags, as strings."},
                "template": ref(CORE + "PodTemplateSpec"),
                "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
                "headService": ref(CORE + "Service"),
                "enableIngress": BOOLEAN,
            },
            required=("rayStartParams", "template"),
        ),
        RAY + "WorkerGroupSpec": strict_object(
            "A group of identical worker pods.",
            {
                "groupName": STRING,
                "replicas": INT32,
                "minReplicas": INT32,
                "maxReplicas": INT32,
                "numOfHosts": INT32,
                "rayStartParams": {**STRING_MAP, "description": "`ray start` flags, as strings."},
                "template": ref(CORE + "PodTemplateSpec"),
                "scaleStrategy": ref(RAY + "ScaleStrategy"),
                "suspend": BOOLEAN,
                "idleTimeoutSeconds": INT32,
            },
            required=("groupName", "maxReplicas", "minReplicas", "rayStartParams", "template"),
        ),
        RAY + "ScaleStrategy": strict_object(
            "Which worker pods to remove.",
            {"workersToDelete": {"type": "array", "items": STRING}},
        ),
    }


def rayservice_schema() -> dict:
    """The top level: a RayService manifest as `kubectl apply` takes it (no status)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "RayService (ray.io/v1), KubeRay-specific fields strict",
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "ray.io/v1"},
            "kind": {"const": "RayService"},
            "metadata": {
                "type": "object",
                "allOf": [ref(META + "ObjectMeta")],
                "required": ["name"],
                # KubeRay's ValidateRayServiceMetadata: it appends 6 characters for the
                # RayCluster's name, which must stay a DNS-1035 label of at most 53.
                "properties": {
                    "name": {
                        "type": "string",
                        "maxLength": 47,
                        "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$",
                    }
                },
            },
            "spec": ref(RAY + "RayServiceSpec"),
        },
    }


def core_definitions(version: str = KUBERNETES_VERSION) -> dict[str, dict]:
    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = folder / f"v{version}-local-strict" / "_definitions.json"
    return json.loads(path.read_text(encoding="utf-8"))["$defs"]


_REF = re.compile(r"^(?:[^#]*)#/\$defs/(.+)$")


def _local_refs(node, found: list[str]):
    """Rewrite every $ref in ``node`` to ``#/$defs/<name>`` in place; collect the names."""
    if isinstance(node, dict):
        target = node.get("$ref")
        if isinstance(target, str):
            match = _REF.match(target)
            if match is None:
                raise ValueError(f"unexpected $ref {target!r}")
            node["$ref"] = f"#/$defs/{match.group(1)}"
            found.append(match.group(1))
        for value in node.values():
            _local_refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _local_refs(value, found)


def build(version: str = KUBERNETES_VERSION) -> str:
    """The schema file's text: KubeRay's types plus the closure of the core types they use."""
    from kubernetes_validate.version import __version__ as kv_version

    schema = rayservice_schema()
    defs = kuberay_definitions()
    core = core_definitions(version)
    pending: list[str] = []
    _local_refs(schema, pending)
    _local_refs(defs, pending)
    while pending:
        name = pending.pop()
        if name in defs:
            continue
        if name not in core:
            raise KeyError(f"{name} is not in kubernetes-validate's v{version} definitions")
        defs[name] = json.loads(json.dumps(core[name]))  # a copy: refs are rewritten in place
        _local_refs(defs[name], pending)
    schema["$comment"] = (
        "Generated by scripts/vendor_kuberay_schema.py: do not edit. KubeRay RayService v1 "
        "structure (io.ray.v1.*, see deploy/schemas/kuberay/README.md); core types "
        f"(io.k8s.*) copied from kubernetes-validate {kv_version}, "
        f"v{version}-local-strict/_definitions.json."
    )
    schema["$defs"] = {name: defs[name] for name in sorted(defs)}
    return json.dumps(schema, indent=1, ensure_ascii=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    options = parser.parse_args(argv)
    text = build()
    if options.check:
        current = options.output.read_text(encoding="utf-8") if options.output.exists() else ""
        if current != text:
            print(f"{options.output} is stale: run scripts/vendor_kuberay_schema.py")
            return 1
        print(f"{options.output} is up to date")
        return 0
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(text, encoding="utf-8")
    schema = json.loads(text)
    print(f"wrote {options.output}: {len(text)} bytes, {len(schema['$defs'])} definitions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
