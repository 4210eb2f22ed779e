"""The typed application builder and its configs, without deploying: argument validation, the
deployment graph Serve would run, the deploy config ``specray serve`` sends, and the shipped
``examples/serve_config.yaml``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as serve_build
from ray.serve.schema import ServeDeploySchema

from specray.serve import build_app
from specray.serve.config import AppArgs
from specray.serve.launch import deploy_config

ROOT = Path(__file__).resolve().parents[2]


def deployments(args: AppArgs) -> dict:
    built = serve_build(build_app(args), name="specray")
    return {d.name: d for d in built.deployments}


def test_unknown_keys_and_bad_values_are_errors_naming_the_key():
    with pytest.raises(ValidationError, match="num_drafts"):
        AppArgs(num_drafts=2)
    with pytest.raises(ValidationError, match="tp_size"):
        AppArgs(tp_size=0)
    with pytest.raises(ValidationError, match="max_draft_workers"):
        AppArgs(num_draft_workers=3, max_draft_workers=2)
    with pytest.raises(ValidationError, match="tls_cert"):
        AppArgs(tls_cert="/no/such/cert.pem", tls_key="/no/such/key.pem")
    with pytest.raises(ValidationError, match="num_micro_batches"):
        AppArgs(num_micro_batches=99)


def test_text_values_from_the_command_line_are_converted():
    args = AppArgs(**{"num_speculative_tokens": "6", "draft": "none", "grpc_port": "9001"})
    assert args.num_speculative_tokens == 6 and args.grpc_port == 9001
    assert args.draft is None
    assert args.coordinator_config().num_speculative_tokens == 0  # no draft, no speculation


def test_the_graph_has_stable_names_tp_bundles_and_draft_placement():
    args = AppArgs(tp_size=2, num_draft_workers=2, draft_resource="l4", target_resource="h100")
    graph = deployments(args)
    assert set(graph) == {"Ingress", "Coordinator", "TargetWorker", "DraftWorker"}
    bundles = graph["TargetWorker"]._replica_config.placement_group_bundles
    assert [b.get("h100", 0) for b in bundles] == [0, 1.0, 1.0]  # the replica, then 2 ranks
    assert graph["TargetWorker"]._replica_config.placement_group_strategy == "STRICT_PACK"
    draft_options = graph["DraftWorker"].ray_actor_options
    assert "l4" in draft_options["resources"]
    assert graph["DraftWorker"].num_replicas == 2
    # Serve lets more requests through than the engine core admits: its 503 comes first.
    assert graph["Ingress"].max_ongoing_requests > args.max_running + args.max_queue
    assert graph["TargetWorker"].num_replicas == 1
    assert "Draft" not in str(deployments(AppArgs(draft="none")))


def test_a_colocated_draft_deploys_no_draft_pool_and_takes_no_pool_sizes():
    args = AppArgs(draft="ngram", draft_placement="colocated")
    assert set(deployments(args)) == {"Ingress", "Coordinator", "TargetWorker"}
    assert not args.draft_pool and not args.autoscaled
    assert args.coordinator_config().num_speculative_tokens > 0  # it still speculates
    for sizes in ({"num_draft_workers": 2}, {"max_draft_workers": 2}):
        with pytest.raises(ValidationError, match="draft_placement='colocated'"):
            AppArgs(draft_placement="colocated", **sizes)
    with pytest.raises(ValidationError, match="draft_placement"):
        AppArgs(draft_placement="beside")


def test_auto_placement_is_resolved_once_when_the_app_is_built():
    """The default ("auto") colocates the default target's default draft; the graph and every
    deployment's arguments carry the answer, never "auto"."""
    args = AppArgs()
    assert args.draft_placement == "auto" and args.resolved_draft_placement == "colocated"
    built = serve_build(build_app(args), name="specray")
    assert {d.name for d in built.deployments} == {"Ingress", "Coordinator", "TargetWorker"}
    for deployment in built.deployments:
        assert deployment.init_args[0]["draft_placement"] == "colocated"
    sized = AppArgs(num_draft_workers=2)  # a sized pool: workers
    assert sized.resolved_draft_placement == "workers" and "DraftWorker" in deployments(sized)
    assert AppArgs(draft="self:bf16").resolved_draft_placement == "workers"


def test_autoscaled_pool_gets_an_autoscaling_config_and_an_application_policy():
    args = AppArgs(num_draft_workers=1, max_draft_workers=3)
    config = deploy_config(args, http_port=8123)
    schema = ServeDeploySchema(**config)
    application = schema.applications[0]
    assert application.import_path == "specray.serve:build_app"
    assert application.autoscaling_policy["policy_function"].endswith(":ApplicationPolicy")
    assert application.args["autoscaling"] == "application"
    graph = deployments(AppArgs(**application.args))
    scaling = graph["DraftWorker"]._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 3)
    fixed = deployments(AppArgs(num_draft_workers=2))["DraftWorker"]
    assert fixed._deployment_config.autoscaling_config is None and fixed.num_replicas == 2


def test_the_example_serve_config_is_valid_and_consistent():
    config = yaml.safe_load((ROOT / "examples" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema(**config)
    application = schema.applications[0]
    args = AppArgs(**application.args)
    assert set(deployments(args)) == {"Ingress", "Coordinator", "TargetWorker", "DraftWorker"}
    expected = args.autoscaling_settings().to_dict()
    for key, value in application.autoscaling_policy["policy_kwargs"].items():
        assert expected[key] == value, key


def test_auth_token_from_the_environment_stays_out_of_the_config(monkeypatch):
    args = AppArgs(auth_token_env="SPECRAY_TEST_TOKEN")
    assert "SPECRAY_TEST_TOKEN" in str(deploy_config(args))
    with pytest.raises(ValueError, match="auth_token_env='SPECRAY_TEST_TOKEN'"):
        args.resolved_auth_token()  # not set where the ingress runs: a clear error
    monkeypatch.setenv("SPECRAY_TEST_TOKEN", "s3cret")
    assert args.resolved_auth_token() == "s3cret"
    assert "s3cret" not in str(deploy_config(args))
    assert AppArgs(auth_token="t").resolved_auth_token() == "t"
    with pytest.raises(ValidationError, match="not both"):
        AppArgs(auth_token="t", auth_token_env="X")


def test_gpu_asks_and_ingress_on_head_reach_the_deployments():
    args = AppArgs(tp_size=2, target_num_gpus=1, draft_num_gpus=0.5, ingress_on_head=True)
    built = deployments(args)
    target = built["TargetWorker"]._replica_config.placement_group_bundles
    assert target[1:] == [{"CPU": 0.5, "target": 1.0, "GPU": 1}] * 2
    ingress = built["Ingress"]._replica_config.ray_actor_options
    assert ingress["num_cpus"] == 0 and ingress["resources"] == {"node:__internal_head__": 0.001}
    assert args.placement().draft_options()["num_gpus"] == 0.5
    assert "num_gpus" not in AppArgs().placement().draft_options()
    with pytest.raises(ValidationError, match="draft_num_gpus"):
        AppArgs(draft_num_gpus=-1)


def test_batch_invariant_reaches_the_workers_placement_from_the_flag_or_a_value():
    from specray.cli import _build_parser
    from specray.cluster.placement import PlacementConfig
    from specray.serve.cli import load_app_config

    assert AppArgs().placement().batch_invariant is False
    for argv in (["serve", "--batch-invariant"], ["serve", "--set", "batch_invariant=true"]):
        config = load_app_config(_build_parser().parse_args(argv))
        args = AppArgs(**config["applications"][0]["args"])
        assert args.placement().batch_invariant is True
    with pytest.raises(ValidationError, match="batch_invariant"):
        AppArgs(batch_invariant="sometimes")
    with pytest.raises(ValueError, match="batch_invariant must be true or false, got 1"):
        PlacementConfig(batch_invariant=1)
