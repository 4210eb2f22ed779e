"""Ray Serve autoscaling for specray: the decision rule of :mod:`specray.cluster.scaling_rules`
(read its docstring for the rule and a worked example) as Serve policies, the helpers replicas
publish their signals with, and the per-deployment ``autoscaling_config``.

Only the standard library and specray's pure rule module are imported: Serve's controller
imports this module to run the policies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from specray.cluster.scaling_rules import (
    COORDINATOR,
    COORDINATOR_METRICS,
    DEFAULT_SETTINGS,
    DRAFT_DOWNSCALE_DELAY_S,
    DRAFT_UPSCALE_DELAY_S,
    DRAFT_UTILIZATION,
    DRAFT_WORKER,
    INGRESS,
    LOOK_BACK_PERIOD_S,
    METRICS_INTERVAL_S,
    TARGET_WORKER,
    AutoscalingSettings,
    DraftPoolSignals,
    GroupSignals,
    TargetScalingState,
    _number,
    decide,
    decide_draft_pool,
)

log = logging.getLogger(__name__)


# ---- Ray Serve adapters: AutoscalingContext in, replica counts out ---------------------------
# Duck-typed on ray.serve.config.AutoscalingContext (ray >= 2.51): aggregated_metrics is
# {metric name: {ReplicaID: mean over look_back_period_s}}, holding only replicas that pushed.
# A policy must never raise: the controller calls it inside its update loop.
def group_signals(ctx) -> tuple[GroupSignals, ...] | None:
    """One GroupSignals per running Coordinator replica, or None when any of them has not yet
    reported every metric (or reported one out of range): no data, no decision."""
    metrics = ctx.aggregated_metrics or {}
    groups = []
    for replica in ctx.running_replicas:
        values = [metrics.get(name, {}).get(replica) for name in COORDINATOR_METRICS]
        try:
            groups.append(GroupSignals(*values))
        except ValueError:  # missing (None) or invalid
            return None
    return tuple(groups) or None


def draft_pool_signals(ctx) -> DraftPoolSignals:
    """The DraftWorker pool; replicas without a (valid) utilization yet are left out."""
    per_replica = (ctx.aggregated_metrics or {}).get(DRAFT_UTILIZATION, {})
    values = [per_replica.get(replica) for replica in ctx.running_replicas]
    valid = tuple(
        float(v)
        for v in values
        if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1
    )
    return DraftPoolSignals(len(ctx.running_replicas), ctx.target_num_replicas, valid)


def _now_s(ctx) -> float:
    # Serve always sets current_time; fall back to the wall clock for a hand-built context.
    if ctx is None or ctx.current_time is None:
        return time.time()
    return ctx.current_time


def draft_pool_policy(ctx, settings: AutoscalingSettings = DEFAULT_SETTINGS):
    """Deployment-level policy for DraftWorker, ``fn(ctx) -> (num_replicas, state)``. It sees
    only draft utilization (a deployment's context holds its own metrics), so it sizes the pool
    by utilization alone; the application-level policy also weighs acceptance and queues."""
    pool = draft_pool_signals(ctx)
    return decide_draft_pool(pool, None, num_groups_next=None, settings=settings), {}


def application_policy(contexts: Mapping, settings: AutoscalingSettings = DEFAULT_SETTINGS):
    """Application-level policy: ``{DeploymentID: ctx} -> ({DeploymentID: replicas},
    {DeploymentID: state})``. Coordinator and TargetWorker get the same count (neither moves
    unless both are autoscaled); the hysteresis state lives in the Coordinator's entry. A
    deployment left out of the decisions keeps its target. Ingress (or any other autoscaled
    deployment) gets Serve's default request-based rule: an application-level policy replaces
    every deployment-level one."""
    named = {dep_id.name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
    coordinator_id, coordinator = named.pop(COORDINATOR, (None, None))
    target_id, target = named.pop(TARGET_WORKER, (None, None))
    draft_id, drafts = named.pop(DRAFT_WORKER, (None, None))
    both = coordinator is not None and target is not None
    if not both:
        settings = replace(settings, scale_target_groups=False)
    settled = both and all(
        len(c.running_replicas) == c.target_num_replicas == coordinator.target_num_replicas
        for c in (coordinator, target)
    )
    decision = decide(
        None if drafts is None else draft_pool_signals(drafts),
        None if coordinator is None else group_signals(coordinator),
        num_groups=None if coordinator is None else coordinator.target_num_replicas,
        groups_settled=settled,
        state=TargetScalingState.from_state_dict(coordinator and coordinator.policy_state),
        now_s=_now_s(coordinator),
        settings=settings,
    )
    decisions: dict[Any, float] = {}
    states: dict[Any, dict] = {}
    if both:
        decisions[coordinator_id] = decisions[target_id] = decision.num_target_groups
        states[coordinator_id] = decision.state.to_state_dict()
    if drafts is not None:
        decisions[draft_id] = decision.num_draft_workers
    if named:
        from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

        for dep_id, ctx in named.values():
            decisions[dep_id], states[dep_id] = replica_queue_length_autoscaling_policy(ctx)
    return decisions, states


class ApplicationPolicy:
    """``application_policy`` with settings: Serve instantiates a class ``policy_function``
    once with ``policy_kwargs`` (see ``application_autoscaling_policy``)."""

    def __init__(self, **settings):
        self.settings = AutoscalingSettings.from_dict(settings)

    def __call__(self, contexts):
        return application_policy(contexts, self.settings)


class DraftPoolPolicy:
    """``draft_pool_policy`` with settings, for a DraftWorker's ``autoscaling_config.policy``."""

    def __init__(self, **settings):
        self.settings = AutoscalingSettings.from_dict(settings)

    def __call__(self, ctx):
        return draft_pool_policy(ctx, self.settings)


# ---- Serve configuration --------------------------------------------------------------------
Scope = Literal["application", "deployment", "plain"]


def supports_custom_policies() -> bool:
    """Whether the installed Ray runs these policies: ``AutoscalingPolicy`` with
    ``policy_function`` and ``policy_kwargs`` (a class instantiated with settings), and an
    application-level ``autoscaling_policy`` in the app config schema."""
    try:
        from ray.serve.config import AutoscalingPolicy
        from ray.serve.schema import ServeApplicationSchema
    except ImportError:
        return False

    def names(model) -> set[str]:  # pydantic v2, then v1
        return set(getattr(model, "model_fields", None) or getattr(model, "__fields__", {}))

    policy_fields = names(AutoscalingPolicy)
    return {"policy_function", "policy_kwargs"} <= policy_fields and "autoscaling_policy" in names(
        ServeApplicationSchema
    )


def application_autoscaling_policy(settings: AutoscalingSettings = DEFAULT_SETTINGS) -> dict:
    """The app config's ``autoscaling_policy`` entry (an application in a ServeDeploySchema /
    ``serve deploy`` config; ``serve.run`` has no such argument)."""
    return {"policy_function": f"{__name__}:ApplicationPolicy", "policy_kwargs": settings.to_dict()}


def _timing(upscale_delay_s: float, downscale_delay_s: float) -> dict[str, float]:
    return {
        "metrics_interval_s": METRICS_INTERVAL_S,
        "look_back_period_s": LOOK_BACK_PERIOD_S,
        "upscale_delay_s": upscale_delay_s,
        "downscale_delay_s": downscale_delay_s,
    }


def _bounds(low: int, high: int, initial: int) -> dict[str, int]:
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": initial}


def _resolve_scope(scope: Scope | None) -> Scope:
    if scope not in (None, "application", "deployment", "plain"):
        raise ValueError(f"scope must be 'application', 'deployment' or 'plain', got {scope!r}")
    supported = supports_custom_policies()
    if scope is None:
        if supported:
            return "application"
        log.warning(
            "this Ray has no custom autoscaling policies: request-based autoscaling only "
            "(drafts ignore acceptance and queues, target groups stay fixed)"
        )
        return "plain"
    if scope != "plain" and not supported:
        raise RuntimeError(f"scope {scope!r} needs custom autoscaling policies (ray >= 2.51)")
    return scope


def autoscaling_config(
    deployment_name: str,
    settings: AutoscalingSettings = DEFAULT_SETTINGS,
    *,
    scope: Scope | None = None,
    initial_target_groups: int | None = None,
) -> dict:
    """A deployment's ``autoscaling_config`` dict.

    scope "application": the app config also carries ``application_autoscaling_policy``;
    Coordinator / TargetWorker get Serve delays of 0 so that the policy's own hold and cooldown,
    one clock for both, decide when they move. "deployment" (``serve.run``, which takes no
    application policy): DraftWorker runs ``DraftPoolPolicy``, target groups stay fixed.
    "plain": ``plain_autoscaling_config``. None: "application" where supported, else "plain"
    with a warning. Ingress gets Serve's request-based rule in every scope: each open stream is
    one ongoing request for its whole generation while the front end only relays tokens, so 64
    per replica (one full Coordinator batch, max_running = 64) before a second one is started.
    """
    known = (INGRESS, COORDINATOR, TARGET_WORKER, DRAFT_WORKER)
    if deployment_name not in known:
        raise ValueError(f"deployment_name must be one of {known}, got {deployment_name!r}")
    scope = _resolve_scope(scope)
    if initial_target_groups is None:
        groups = settings.min_target_groups
    else:
        low, high = settings.min_target_groups, settings.max_target_groups
        groups = _number("initial_target_groups", initial_target_groups, low, high, integer=True)
    if deployment_name == INGRESS:
        return {
            **_bounds(1, settings.max_ingress_replicas, 1),
            "target_ongoing_requests": settings.ingress_target_ongoing_requests,
            **_timing(DRAFT_UPSCALE_DELAY_S, DRAFT_DOWNSCALE_DELAY_S),
        }
    scaling = scope == "application" and settings.scale_target_groups
    low, high = (
        (settings.min_target_groups, settings.max_target_groups) if scaling else (groups,) * 2
    )
    if deployment_name in (COORDINATOR, TARGET_WORKER):
        return {**_bounds(low, high, groups), **_timing(0.0, 0.0)}
    per_group_low, per_group_high = settings.min_drafts_per_group, settings.max_drafts_per_group
    config = {
        **_bounds(per_group_low * low, per_group_high * high, per_group_low * groups),
        **_timing(DRAFT_UPSCALE_DELAY_S, DRAFT_DOWNSCALE_DELAY_S),
    }
    if scope == "deployment":
        policy = f"{__name__}:DraftPoolPolicy"
        config["policy"] = {"policy_function": policy, "policy_kwargs": settings.to_dict()}
    elif scope == "plain":
        config["target_ongoing_requests"] = settings.target_draft_utilization
    return config


def plain_autoscaling_config(
    deployment_name: str,
    settings: AutoscalingSettings = DEFAULT_SETTINGS,
    *,
    initial_target_groups: int | None = None,
) -> dict:
    """Fallback for a Ray without custom policies: Serve's request-based rule only.

    DraftWorker: ``target_ongoing_requests`` = ``target_draft_utilization`` (0.7). A draft
    replica runs one draft call at a time, so its time-mean of ongoing calls is its utilization
    and Serve sizes the pool to total / 0.7: the utilization half of the custom rule, without
    the acceptance and queue terms (and counting only calls made through Serve handles).
    Coordinator / TargetWorker: fixed at the initial group count, because two independent
    request-based rules cannot keep their counts equal. Ingress: as in every scope.
    """
    return autoscaling_config(
        deployment_name, settings, scope="plain", initial_target_groups=initial_target_groups
    )
