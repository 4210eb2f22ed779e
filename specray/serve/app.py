"""``build_app``: the specray application for Ray Serve, from validated arguments.

    serve run specray.serve:build_app target=default draft=self:bf16
    serve deploy serve_config.yaml            # import_path: specray.serve:build_app

Deployment names are stable (``Ingress``, ``Coordinator``, ``TargetWorker``, ``DraftWorker``):
dashboards, autoscaling policies and ``serve status`` refer to them.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from specray.serve import deployments as d
from specray.serve.config import REPLICA_CPUS_DEFAULT, REPLICA_SLIVER, AppArgs

INGRESS_MAX_ONGOING = 4096  # admission control is the engine cores'; the ingress forwards


def build_app(args: AppArgs | dict) -> Application:
    """The application graph. ``args``: :class:`specray.serve.config.AppArgs` or a mapping
    of its fields (unknown keys are errors)."""
    if not isinstance(args, AppArgs):
        args = AppArgs(**dict(args))
    # "auto" placement resolved once, here: every deployment then reads the same answer
    # (resolving reads model files, which a replica on another node might see otherwise).
    plain = args.model_dump() | {"draft_placement": args.resolved_draft_placement}
    cpus = {"num_cpus": REPLICA_CPUS_DEFAULT}
    placement = args.placement()
    target = serve.deployment(
        d.TargetWorkerDeployment,
        name="TargetWorker",
        **_scaling("TargetWorker", args, args.num_target_groups),
        ray_actor_options=cpus,
        # Bundle 0 holds the replica; one bundle per TP rank, all on one target node.
        placement_group_bundles=[
            {"CPU": REPLICA_CPUS_DEFAULT},
            *placement.target_bundles(args.tp_size),
        ],
        placement_group_strategy="STRICT_PACK",
        health_check_period_s=10,
        health_check_timeout_s=60,
    ).bind(plain)
    workers = [target]
    if args.draft_pool:
        workers.append(
            serve.deployment(
                d.DraftWorkerDeployment,
                name="DraftWorker",
                ray_actor_options={**cpus, "resources": {args.draft_resource: REPLICA_SLIVER}},
                health_check_period_s=10,
                health_check_timeout_s=60,
                **_scaling("DraftWorker", args, args.num_draft_workers * args.num_target_groups),
            ).bind(plain)
        )
    coordinator = serve.deployment(
        d.CoordinatorDeployment,
        name="Coordinator",
        **_scaling("Coordinator", args, args.num_target_groups),
        ray_actor_options=cpus,
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=60,
    ).bind(plain, *workers)  # bound so they deploy with it; they meet via the registry
    ingress = serve.deployment(
        serve.ingress()(d.IngressDeployment),
        name="Ingress",
        num_replicas=args.num_ingress_replicas,
        ray_actor_options=_ingress_options(args),
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_timeout_s=60,
    )
    return ingress.bind(plain, coordinator)


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource


def _ingress_options(args: AppArgs) -> dict:
    if not args.ingress_on_head:
        return {"num_cpus": REPLICA_CPUS_DEFAULT}
    # No CPU ask: heads usually advertise num-cpus 0 to keep work off them, and the ingress
    # only forwards (as Serve's own proxy there does).
    return {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: REPLICA_SLIVER}}


def _scaling(name: str, args: AppArgs, fixed: int) -> dict:
    """Serve options for a deployment's size: fixed, or its autoscaling config."""
    if not args.autoscaled:
        return {"num_replicas": fixed}
    from specray.cluster.autoscaling import autoscaling_config

    return {
        "autoscaling_config": autoscaling_config(
            name,
            args.autoscaling_settings(),
            scope=args.autoscaling,
            initial_target_groups=args.num_target_groups,
        )
    }
