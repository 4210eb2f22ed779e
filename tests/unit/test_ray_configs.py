"""The shipped ``ray up`` configs (deploy/ray/) pass specray.ops.ray_config.validate, and each
negative control, one edit away from a shipped config, is caught with a message naming it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from specray.ops import ray_config
from specray.serve.config import AppArgs
from specray.serve.launch import deploy_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "ray"
SERVE_CONFIG = "deploy/ray/serve_config.gpu.yaml"
CLUSTERS = ["aws.yaml", "gcp.yaml"]


def shipped(name: str) -> dict:
    return ray_config.load(DEPLOY / name)


def head_start(config: dict) -> str:
    """The shipped head command that runs `ray start --head`."""
    return next(c for c in config["head_start_ray_commands"] if "ray start --head" in c)


def edit_head_start(config: dict, old: str, new: str) -> None:
    commands = config["head_start_ray_commands"]
    index = commands.index(head_start(config))
    assert old in commands[index]
    commands[index] = commands[index].replace(old, new)


def caught(problems: list[str], pattern: str) -> None:
    """The control is caught: some problem matches ``pattern``."""
    assert any(re.search(pattern, p) for p in problems), problems


@pytest.mark.parametrize("name", CLUSTERS)
def test_shipped_cluster_configs_have_no_problems(name):
    assert ray_config.validate(shipped(name), base_dir=ROOT) == []


def test_shipped_serve_config_is_what_deploy_config_makes_of_its_args():
    data = yaml.safe_load((ROOT / SERVE_CONFIG).read_text())
    args = AppArgs(**data["applications"][0]["args"])
    assert deploy_config(args, http_host="0.0.0.0") == data
    assert (args.tp_size, args.target_num_gpus, args.draft_num_gpus) == (8, 1.0, 1.0)
    assert args.ingress_on_head and args.auth_token_env == "SPECRAY_AUTH_TOKEN"
    assert args.auth_token is None  # the token itself is never in the config


@pytest.mark.parametrize("name", CLUSTERS)
def test_both_clusters_deploy_the_same_serve_config(name):
    assert SERVE_CONFIG.rsplit("/", 1)[1] in "\n".join(shipped(name)["head_start_ray_commands"])


def test_summary_tables():
    assert ray_config.summary(shipped("aws.yaml")) == [
        "node type  role    instance     resources               min  max",
        "head       head    m6i.2xlarge  CPU=0 GPU=0               1    1",
        "draft      worker  g6.xlarge    CPU=4 GPU=1 draft=2       2    8",
        "target     worker  p5.48xlarge  CPU=192 GPU=8 target=8    1    1",
        "provider aws us-west-2; at most 9 worker node(s) besides the head",
    ]
    assert ray_config.summary(shipped("gcp.yaml"))[1:4] == [
        "head       head    n2-standard-8  CPU=0 GPU=0               1    1",
        "draft      worker  g2-standard-8  CPU=8 GPU=1 draft=2       2    8",
        "target     worker  a3-highgpu-8g  CPU=208 GPU=8 target=8    1    1",
    ]


# ---- negative controls on the cluster config --------------------------------------------------
@pytest.mark.parametrize("name", CLUSTERS)
def test_unknown_top_level_key_fails_rays_schema(name):
    config = shipped(name)
    config["max_worker"] = 9  # a typo of max_workers
    problems = ray_config.validate(config, base_dir=ROOT)
    caught(problems, r"ray-schema: \(top level\): .*'max_worker' was unexpected")


@pytest.mark.parametrize("name", CLUSTERS)
def test_target_node_with_four_gpus_cannot_hold_tp8(name):
    config = shipped(name)
    config["available_node_types"]["target"]["resources"].update(GPU=4)
    problems = ray_config.validate(config, base_dir=ROOT)
    caught(problems, r"'target' .* cannot hold one target group \(tp_size=8\)")
    caught(problems, r"room for 0 target group\(s\)")


@pytest.mark.parametrize("name", CLUSTERS)
def test_head_advertising_target_is_caught_in_node_type_and_flags(name):
    config = shipped(name)
    config["available_node_types"]["head"]["resources"]["target"] = 8
    caught(ray_config.validate(config, base_dir=ROOT), r"head node type 'head' advertises 'target'")
    config = shipped(name)
    edit_head_start(config, "--num-gpus=0", "--num-gpus=0 --resources='{\"target\": 8}'")
    caught(ray_config.validate(config, base_dir=ROOT), r"--resources advertises 'target'")


@pytest.mark.parametrize("name", CLUSTERS)
def test_draft_node_without_the_draft_resource(name):
    config = shipped(name)
    del config["available_node_types"]["draft"]["resources"]["draft"]
    problems = ray_config.validate(config, base_dir=ROOT)
    assert problems == ["no node type advertises the draft resource 'draft'"]


@pytest.mark.parametrize("name", CLUSTERS)
def test_dashboard_bound_to_all_interfaces(name):
    config = shipped(name)
    edit_head_start(config, "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
    problems = ray_config.validate(config, base_dir=ROOT)
    assert len(problems) == 1
    caught(problems, r"--dashboard-host=127.0.0.1 \(got '0.0.0.0'\)")


@pytest.mark.parametrize("name", CLUSTERS)
def test_head_with_cpus_or_gpus_to_schedule(name):
    config = shipped(name)
    edit_head_start(config, "--num-gpus=0", "--num-gpus=1")
    caught(ray_config.validate(config, base_dir=ROOT), r"pass --num-gpus=0 \(got '1'\)")
    # resources without CPU: 0 would override --num-cpus=0 (RAY_OVERRIDE_RESOURCES)
    config = shipped(name)
    del config["available_node_types"]["head"]["resources"]["CPU"]
    caught(ray_config.validate(config, base_dir=ROOT), r"must declare resources CPU: 0")


def test_worker_counts_must_add_up():
    config = shipped("aws.yaml")
    config["max_workers"] = 5  # below draft 8 + target 1
    caught(ray_config.validate(config, base_dir=ROOT), r"below the sum of the node types' max")
    config = shipped("aws.yaml")
    del config["available_node_types"]["draft"]["max_workers"]
    caught(ray_config.validate(config, base_dir=ROOT), r"'draft': set max_workers")
    config = shipped("aws.yaml")
    config["available_node_types"]["draft"]["max_workers"] = 7  # one short of the ceiling 8
    problems = ray_config.validate(config, base_dir=ROOT)
    assert problems == [
        "room for 7 draft worker(s), the app may scale to 8 (max_draft_workers x num_target_groups)"
    ]


def test_only_the_served_ports_may_be_public():
    config = shipped("aws.yaml")
    rules = config["provider"]["security_group"]["IpPermissions"]
    rules.append(
        {
            "IpProtocol": "tcp",
            "FromPort": 8265,
            "ToPort": 8265,
            "IpRanges": [{"CidrIp": "0.0.0.0/0"}],
        }
    )
    problems = ray_config.validate(config, base_dir=ROOT)
    assert len(problems) == 1
    caught(problems, r"opens port\(s\) 8265 to 0.0.0.0/0")
    rules[-1] = {"IpProtocol": "-1", "IpRanges": [{"CidrIp": "10.0.0.0/8"}]}
    caught(ray_config.validate(config, base_dir=ROOT), r"opens port\(s\) 0-65535")


def test_gcp_disk_types_follow_the_zone():
    config = shipped("gcp.yaml")
    config["provider"]["availability_zone"] = "us-central1-b"
    problems = ray_config.validate(config, base_dir=ROOT)
    assert len(problems) == 3  # head, draft and target boot disks
    caught(problems, r"'target': diskType zones/us-central1-a/diskTypes/pd-ssd is in us-central1-a")


def test_serve_deploy_must_name_a_synced_file():
    config = shipped("aws.yaml")
    config["file_mounts"] = {"~/other": "."}
    caught(ray_config.validate(config, base_dir=ROOT), r"not under any file_mounts entry")


# ---- negative controls on the Serve config it deploys -----------------------------------------
def with_serve_config(tmp_path: Path, edit) -> list[str]:
    """Validate the AWS config against a copy of the repository's Serve config, edited."""
    target = tmp_path / SERVE_CONFIG
    target.parent.mkdir(parents=True)
    shutil.copy(ROOT / SERVE_CONFIG, target)
    data = yaml.safe_load(target.read_text())
    edit(data)
    target.write_text(yaml.safe_dump(data))
    return ray_config.validate(shipped("aws.yaml"), base_dir=tmp_path)


def test_unedited_copy_validates(tmp_path):
    assert with_serve_config(tmp_path, lambda data: None) == []


def test_serve_config_arg_typo(tmp_path):
    def typo(data):
        args = data["applications"][0]["args"]
        args["tp_sise"] = args.pop("tp_size")

    problems = with_serve_config(tmp_path, typo)
    assert len(problems) == 1
    caught(problems, r"args\.tp_sise: Extra inputs are not permitted")


def test_serve_config_schema_error(tmp_path):
    problems = with_serve_config(tmp_path, lambda data: data.update(proxy_location="Everywhere?"))
    caught(problems, r"not a Serve deploy config: .*proxy_location")


def test_policy_bounds_must_match_the_args(tmp_path):
    def widen(data):
        data["applications"][0]["args"]["max_draft_workers"] = 6

    problems = with_serve_config(tmp_path, widen)
    assert problems == [
        f"{tmp_path / SERVE_CONFIG}: autoscaling_policy.policy_kwargs.max_drafts_per_group=8 "
        "disagrees with the args (6: num_/max_draft_workers, num_target_groups)"
    ]


def test_tp_size_beyond_the_target_node(tmp_path):
    def sixteen(data):
        data["applications"][0]["args"]["tp_size"] = 16

    caught(with_serve_config(tmp_path, sixteen), r"cannot hold one target group \(tp_size=16\)")


@pytest.mark.parametrize("name", CLUSTERS)
def test_a_node_started_without_serves_settings(name):
    config = shipped(name)
    commands = config["worker_start_ray_commands"]
    index = next(i for i, c in enumerate(commands) if "ray start" in c)
    commands[index] = commands[index].replace("RAY_SERVE_ENABLE_HA_PROXY=1", "")
    caught(
        ray_config.validate(config, base_dir=ROOT),
        r"worker_start_ray_commands: export RAY_SERVE_ENABLE_HA_PROXY=1 before `ray start`",
    )
