"""Ray's ports stay internal wherever specray starts Ray; only HTTP (8000) and gRPC face
clients. Each check goes through the validator that guards it, with one control it must catch.

- ``specray cluster up --local``: ``specray.ops.local.plan`` puts every node on 127.0.0.1 and
  the dashboard on 127.0.0.1.
- ``ray up`` (``deploy/ray/*.yaml``): ``specray.ops.ray_config.validate`` passes the shipped
  configs and flags a public dashboard or a security group opening a Ray port.
- Helm (``helm/specray``): ``specray.ops.chart.check_wiring`` passes the default render and
  flags a head Service that is not ClusterIP or a client Service that targets a Ray port.
- The internal draft -> target gRPC port and the engine core's session port (plaintext,
  unauthenticated) of an in-process server are not reachable on this machine's non-loopback
  address.
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import pytest

from specray.ops import chart, ray_config
from specray.ops.local import LocalClusterSpec, Ports, plan

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = sorted(
    path.name for path in (ROOT / "deploy" / "ray").glob("*.yaml") if "serve" not in path.name
)
RAY_PORTS = (6379, 8265, 10001)  # GCS, dashboard, Ray client


def test_local_launcher_binds_ray_to_loopback():
    launches = plan(
        LocalClusterSpec(draft_nodes=2, target_nodes=1),
        "draft",
        "target",
        Ports(gcs=1, dashboard=2, client_server=3, agents=(4, 5, 6, 7)),
        "/tmp/specray-security-plan",
    )
    head = launches[0].argv
    assert "--dashboard-host=127.0.0.1" in head
    for launch in launches:
        assert "--node-ip-address=127.0.0.1" in launch.argv, launch.name
        assert not any("0.0.0.0" in arg for arg in launch.argv), launch.argv


@pytest.mark.parametrize("name", CLUSTERS)
def test_ray_up_configs_keep_ray_ports_internal(name):
    assert CLUSTERS == ["aws.yaml", "gcp.yaml"]
    config = ray_config.load(ROOT / "deploy" / "ray" / name)
    assert ray_config.validate(config, base_dir=ROOT) == []
    public_dashboard = copy.deepcopy(config)
    commands = public_dashboard["head_start_ray_commands"]
    index = next(i for i, c in enumerate(commands) if "--dashboard-host=127.0.0.1" in c)
    commands[index] = commands[index].replace(
        "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0"
    )
    assert any(
        "--dashboard-host" in p for p in ray_config.validate(public_dashboard, base_dir=ROOT)
    )


@pytest.mark.parametrize("port", RAY_PORTS)
def test_ray_up_security_group_may_not_open_a_ray_port(port):
    config = ray_config.load(ROOT / "deploy" / "ray" / "aws.yaml")
    rule = {"IpProtocol": "tcp", "FromPort": port, "ToPort": port}
    config["provider"]["security_group"]["IpPermissions"].append(
        rule | {"IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
    )
    problems = ray_config.validate(config, base_dir=ROOT)
    assert any(f"opens port(s) {port}" in p for p in problems), problems


@pytest.fixture(scope="module")
def helm_docs() -> list[dict]:
    return chart.render(chart.CHART_DIR)


def _wiring_problems(docs) -> str:
    check = chart.check_wiring(docs)
    return "" if check.status == "PASS" else check.detail


def test_helm_keeps_ray_ports_internal(helm_docs):
    assert _wiring_problems(helm_docs) == ""
    service = chart._only(helm_docs, "Service")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"serve", "grpc"}

    exposed_head = copy.deepcopy(helm_docs)
    rayservice = chart._only(exposed_head, "RayService")
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    assert "must stay ClusterIP" in _wiring_problems(exposed_head)

    for target in ("dashboard", "gcs", 8265):
        ray_port = copy.deepcopy(helm_docs)
        ports = chart._only(ray_port, "Service")["spec"]["ports"]
        ports.append({"name": "ray", "port": 8265, "targetPort": target, "protocol": "TCP"})
        assert "Ray's stay internal" in _wiring_problems(ray_port), target


def _public_address() -> str | None:
    """This machine's address on its default route (no packet is sent); None if loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.254", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("port_of", ["verifier", "engine core sessions"])
def test_the_internal_ports_are_not_on_public_interfaces(local_backend, port_of):
    """The draft workers' gRPC port and the front ends' session port of the engine core."""
    address = _public_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    worker = local_backend.workers[0]
    internal = worker.address if port_of == "verifier" else worker.engine_core.address
    host, port = internal.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):
        pass  # the way in from inside works
    with pytest.raises(OSError):
        socket.create_connection((address, int(port)), timeout=5).close()
