"""Autoscaling: the decision rule on synthetic signals, the Serve adapters on real
AutoscalingContext objects, and the autoscaling_config dicts as Serve parses them."""

import logging
import math
import re

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy
from ray.serve.schema import ServeApplicationSchema

from specray.cluster import autoscaling
from specray.cluster.autoscaling import (
    COORDINATOR,
    COORDINATOR_METRICS,
    DRAFT_UTILIZATION,
    DRAFT_WORKER,
    INGRESS,
    TARGET_WORKER,
    ApplicationPolicy,
    AutoscalingSettings,
    DraftPoolPolicy,
    DraftPoolSignals,
    GroupSignals,
    TargetScalingState,
    application_autoscaling_policy,
    application_policy,
    autoscaling_config,
    decide,
    decide_draft_pool,
    plain_autoscaling_config,
    supports_custom_policies,
)
from specray.cluster.scaling_rules import (
    ACCEPTANCE_RATE,
    QUEUE_DEPTH,
    RUNNING,
    SPECULATING_FRACTION,
    TARGET_BUSY_FRACTION,
    coordinator_stats,
    decide_target_groups,
    draft_worker_stats,
    group_draft_needs,
)

# Serve warns on any non-default metrics_interval_s, which it still uses as the push interval.
pytestmark = pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")

SETTINGS = AutoscalingSettings(max_target_groups=4)  # defaults otherwise
APP = "specray"
ALL = (INGRESS, COORDINATOR, TARGET_WORKER, DRAFT_WORKER)


def group(alpha=0.8, running=8, speculating=1.0, queue=0.0, busy=0.6):
    return GroupSignals(
        queue_depth=queue,
        running=running,
        acceptance_rate=alpha,
        target_busy_fraction=busy,
        speculating_fraction=speculating,
    )


def pool(*utilizations, running=None, target=None):
    running = len(utilizations) if running is None else running
    return DraftPoolSignals(running, running if target is None else target, utilizations)


def drafts(pool_signals, groups, num_groups_next=None, settings=SETTINGS):
    next_groups = len(groups) if num_groups_next is None and groups else num_groups_next
    return decide_draft_pool(pool_signals, groups, num_groups_next=next_groups, settings=settings)


# ---- draft pool -----------------------------------------------------------------------------
def test_module_docstring_worked_example():
    utilizations = (0.9, 0.9, 0.8, 0.0)  # 2.6 drafts busy
    a, b = group(alpha=0.8, running=8, busy=0.6), group(alpha=0.2)
    decision = decide(
        pool(*utilizations),
        [a, b],
        num_groups=2,
        groups_settled=True,
        state=TargetScalingState(),
        now_s=0.0,
        settings=SETTINGS,
    )
    assert (decision.num_draft_workers, decision.num_target_groups) == (5, 2)  # ceil(3.71 + 1)
    starved_a = group(alpha=0.8, running=8, queue=6, busy=0.3)
    assert drafts(pool(*utilizations), [starved_a, b]) == 6  # max(3.71, 4 + 1) + 1


@pytest.mark.parametrize(
    "low_group",
    [group(alpha=0.29), group(speculating=0.0), group(running=0)],
    ids=["acceptance-below-threshold", "not-speculating", "no-requests"],
)
def test_groups_not_worth_drafting_for_get_their_minimum(low_group):
    assert drafts(pool(0.95, 0.95, 0.95, 0.95), [low_group, low_group]) == 2
    # The same busy pool serving a group that is worth it keeps growing.
    assert drafts(pool(0.95, 0.95, 0.95, 0.95), [low_group, group()]) == 7  # 1 + ceil(5.43)


@pytest.mark.parametrize(
    ("utilization", "expected"),
    [(0.95, 6), (0.7, 4), (0.5, 3), (0.2, 2)],  # ceil(4 * u / 0.7), at least 1 per group
)
def test_pool_follows_utilization_in_proportion(utilization, expected):
    assert drafts(pool(*[utilization] * 4), [group(), group()]) == expected


def test_exact_need_is_not_rounded_up():
    assert drafts(pool(*[0.7] * 6), [group(), group()]) == 6  # 6.000000000000001 in floats


def test_busy_work_is_shared_by_speculating_requests():
    # 3.5 drafts busy -> 5 drafts at 0.7; A has 3x the speculating requests of B (12 vs 4).
    a, b = group(running=12), group(running=8, speculating=0.5)
    assert group_draft_needs([a, b], 3.5, 4, SETTINGS) == pytest.approx([3.75, 1.25])
    assert drafts(pool(0.875, 0.875, 0.875, 0.875), [a, b]) == 5


def test_idle_pool_shrinks_by_the_step_then_to_the_floor():
    idle = [group(), group()]
    assert drafts(pool(*[0.1] * 6), idle) == 4  # wants 2, may drop 2 per decision
    assert drafts(pool(*[0.1] * 4), idle) == 2  # min 1 per group
    assert drafts(pool(*[0.0] * 2), idle) == 2


def test_queue_while_target_waits_adds_drafts():
    calm, waiting = group(), group(queue=6, busy=0.3)
    assert drafts(pool(0.7, 0.7, 0.7, 0.7), [calm, calm]) == 4
    assert drafts(pool(0.7, 0.7, 0.7, 0.7), [calm, waiting]) == 5  # 2 + (2 + 1)
    # A short queue or a target already busy is not a draft shortage.
    assert drafts(pool(0.7, 0.7, 0.7, 0.7), [calm, group(queue=3, busy=0.3)]) == 4
    assert drafts(pool(0.7, 0.7, 0.7, 0.7), [calm, group(queue=6, busy=0.6)]) == 4


def test_busy_targets_with_queue_add_groups_and_drafts_only_in_proportion():
    saturated = [group(queue=6, busy=0.95), group(queue=9, busy=0.93)]
    now = {"state": TargetScalingState(), "now_s": 0.0, "groups_settled": True}
    fast = AutoscalingSettings(max_target_groups=4, target_scale_up_hold_s=0)
    decision = decide(pool(0.7, 0.7, 0.7, 0.7), saturated, num_groups=2, settings=fast, **now)
    assert (decision.num_target_groups, decision.num_draft_workers) == (3, 6)  # 4 * 3 / 2
    frozen = AutoscalingSettings(max_target_groups=4, scale_target_groups=False)
    decision = decide(pool(0.7, 0.7, 0.7, 0.7), saturated, num_groups=2, settings=frozen, **now)
    assert (decision.num_target_groups, decision.num_draft_workers) == (2, 4)


def test_clamps_per_group_step_and_floor():
    hot = [group()]
    assert drafts(pool(*[1.0] * 7), hot) == 8  # needs 10, at most 8 per group
    one_step = AutoscalingSettings(max_target_groups=4, max_draft_step_up=1)
    assert drafts(pool(1.0, 1.0, 1.0, 1.0), hot * 2, settings=one_step) == 5  # needs 6
    # Three groups need three drafts even against the step.
    assert drafts(pool(1.0), hot, num_groups_next=3, settings=one_step) == 3
    # Without group signals only the step (and Serve's min / max) bound the pool.
    assert drafts(pool(*[1.0] * 7), None) == 10


def test_no_utilization_reported_keeps_the_target():
    assert drafts(pool(running=3, target=5), [group(), group()]) == 5
    # A replica that has not reported is counted at the mean of those that have.
    assert drafts(pool(0.95, 0.95, running=4), [group(), group()]) == 6


# ---- target groups --------------------------------------------------------------------------
def targets(groups, num_groups, state=None, now_s=0.0, settled=True, **settings):
    return decide_target_groups(
        groups,
        num_groups=num_groups,
        settled=settled,
        state=state or TargetScalingState(),
        now_s=now_s,
        settings=AutoscalingSettings(**{"max_target_groups": 4, **settings}),
    )


SATURATED = group(queue=6, busy=0.95)


def test_scale_up_needs_busy_targets_and_a_queue():
    assert targets([SATURATED] * 2, 2, target_scale_up_hold_s=0)[0] == 3
    assert targets([group(queue=6, busy=0.85)] * 2, 2, target_scale_up_hold_s=0)[0] == 2
    assert targets([group(queue=3, busy=0.95)] * 2, 2, target_scale_up_hold_s=0)[0] == 2
    assert targets([SATURATED] * 4, 4, target_scale_up_hold_s=0)[0] == 4  # max_target_groups
    assert targets([SATURATED] * 2, 2, target_scale_up_hold_s=0, scale_target_groups=False)[0] == 2


def test_scale_down_only_when_the_rest_stay_under_used():
    fast = {"target_scale_down_hold_s": 0}
    assert targets([group(busy=0.2)] * 3, 3, **fast)[0] == 2  # 0.2 * 3 / 2 = 0.3 <= 0.5
    assert targets([group(busy=0.3)] * 2, 2, **fast)[0] == 2  # 0.3 * 2 / 1 = 0.6: dead band
    assert targets([group(busy=0.2), group(busy=0.2, queue=1)], 2, **fast)[0] == 2
    assert targets([group(busy=0.0)], 1, **fast)[0] == 1  # min_target_groups


def test_hysteresis_hold_then_cooldown():
    up = [SATURATED] * 2
    settings = {"target_scale_up_hold_s": 30, "target_cooldown_s": 60}
    count, state = targets(up, 2, now_s=0, **settings)
    assert (count, state.pending_direction, state.pending_since_s) == (2, 1, 0)
    count, state = targets(up, 2, state, now_s=29, **settings)
    assert count == 2
    count, state = targets(up, 2, state, now_s=30, **settings)
    assert (count, state) == (3, TargetScalingState(last_change_s=30))
    # The third group is starting: hold, and the cooldown restarts from now.
    count, state = targets(up, 3, state, now_s=45, settled=False, **settings)
    assert (count, state.last_change_s) == (3, 45)
    count, state = targets([SATURATED] * 3, 3, state, now_s=104, **settings)
    assert (count, state.pending_direction) == (3, 0)  # cooling until 105
    count, state = targets([SATURATED] * 3, 3, state, now_s=105, **settings)
    assert (count, state.pending_since_s) == (3, 105)
    assert targets([SATURATED] * 3, 3, state, now_s=135, **settings)[0] == 4


def test_interrupted_pressure_restarts_the_hold():
    settings = {"target_scale_up_hold_s": 30}
    _, state = targets([SATURATED] * 2, 2, now_s=0, **settings)
    _, state = targets([group()] * 2, 2, state, now_s=20, **settings)
    _, state = targets([SATURATED] * 2, 2, state, now_s=40, **settings)
    assert targets([SATURATED] * 2, 2, state, now_s=69, **settings)[0] == 2
    assert targets([SATURATED] * 2, 2, state, now_s=70, **settings)[0] == 3


def test_missing_group_metrics_hold_the_count():
    count, state = targets(None, 2, now_s=7.0, target_scale_up_hold_s=0)
    assert (count, state.last_change_s) == (2, 7.0)


def test_state_round_trips_beside_serves_own_keys():
    state = TargetScalingState(pending_direction=-1, pending_since_s=3.0, last_change_s=1.0)
    stored = {**state.to_state_dict(), "__decision_counters": 2, "__decision_timestamp": 5.0}
    assert TargetScalingState.from_state_dict(stored) == state
    assert TargetScalingState.from_state_dict({}) == TargetScalingState()


# ---- settings and metric helpers ------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_drafts_per_group": 0}, "min_drafts_per_group"),
        ({"min_drafts_per_group": 3, "max_drafts_per_group": 2}, "max_drafts_per_group"),
        ({"target_draft_utilization": 0.0}, "target_draft_utilization"),
        ({"target_draft_utilization": 1.5}, "target_draft_utilization"),
        ({"min_acceptance_rate": math.nan}, "min_acceptance_rate"),
        ({"queue_depth_high": 0}, "queue_depth_high"),
        ({"target_busy_low": 0.9}, "target_busy_low"),
        ({"max_draft_step_up": 1.5}, "max_draft_step_up"),
        ({"max_target_step": True}, "max_target_step"),
        ({"scale_target_groups": "yes"}, "scale_target_groups"),
        ({"min_target_groups": 3, "max_target_groups": 2}, "max_target_groups"),
        ({"target_cooldown_s": -1}, "target_cooldown_s"),
    ],
)
def test_settings_errors_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        AutoscalingSettings(**kwargs)


def test_settings_from_policy_kwargs():
    settings = AutoscalingSettings(max_target_groups=3, target_draft_utilization=0.6)
    assert AutoscalingSettings.from_dict(settings.to_dict()) == settings
    with pytest.raises(ValueError, match="target_utilisation"):
        AutoscalingSettings.from_dict({"target_utilisation": 0.6})


def test_stats_helpers_build_plain_float_dicts():
    stats = coordinator_stats(
        queue_depth=3,
        running=8,
        acceptance_rate=0.75,
        target_busy_fraction=0.5,
        speculating_fraction=1,
    )
    assert stats == {
        QUEUE_DEPTH: 3.0,
        RUNNING: 8.0,
        ACCEPTANCE_RATE: 0.75,
        TARGET_BUSY_FRACTION: 0.5,
        SPECULATING_FRACTION: 1.0,
    }
    assert tuple(stats) == COORDINATOR_METRICS
    assert all(type(v) is float for v in stats.values())  # what Serve's first check accepts
    assert draft_worker_stats(draft_utilization=1) == {DRAFT_UTILIZATION: 1.0}
    assert type(draft_worker_stats(draft_utilization=1)[DRAFT_UTILIZATION]) is float
    with pytest.raises(ValueError, match=ACCEPTANCE_RATE):
        coordinator_stats(**{**stats, ACCEPTANCE_RATE: 1.2})
    with pytest.raises(ValueError, match=DRAFT_UTILIZATION):
        draft_worker_stats(draft_utilization=-0.1)


# ---- adapters on real AutoscalingContext objects --------------------------------------------
def context(name, values=None, *, running, target=None, state=None, now=1000.0, requests=0.0):
    """A Serve context as the controller builds it; values: {metric: [one per replica, None:
    not reported]}."""
    dep_id = DeploymentID(name=name, app_name=APP)
    replicas = [ReplicaID(unique_id=f"{name}-{i}", deployment_id=dep_id) for i in range(running)]
    aggregated = {
        metric: {r: v for r, v in zip(replicas, per_replica, strict=True) if v is not None}
        for metric, per_replica in (values or {}).items()
    }
    config = AutoscalingConfig(**autoscaling_config(name, SETTINGS, initial_target_groups=2))
    return AutoscalingContext(
        deployment_id=dep_id,
        deployment_name=name,
        app_name=APP,
        current_num_replicas=running,
        target_num_replicas=running if target is None else target,
        running_replicas=replicas,
        total_num_requests=requests,
        total_queued_requests=0.0,
        aggregated_metrics=aggregated,
        raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def coordinator_values(n, *, queue=6.0, busy=0.95, alpha=0.8):
    one = coordinator_stats(
        queue_depth=queue,
        running=8,
        acceptance_rate=alpha,
        target_busy_fraction=busy,
        speculating_fraction=1.0,
    )
    return {name: [value] * n for name, value in one.items()}


def contexts(coordinator, target, draft, *extra):
    return {ctx.deployment_id: ctx for ctx in (coordinator, target, draft, *extra)}


def test_application_policy_on_serve_contexts():
    settings = AutoscalingSettings(max_target_groups=4, target_scale_up_hold_s=0)
    coordinator = context(COORDINATOR, coordinator_values(2), running=2)
    target = context(TARGET_WORKER, running=2)
    draft = context(DRAFT_WORKER, {DRAFT_UTILIZATION: [0.7] * 4}, running=4)
    decisions, states = application_policy(contexts(coordinator, target, draft), settings)
    assert decisions == {
        DeploymentID(COORDINATOR, APP): 3,
        DeploymentID(TARGET_WORKER, APP): 3,
        DeploymentID(DRAFT_WORKER, APP): 6,
    }
    assert states == {
        coordinator.deployment_id: TargetScalingState(last_change_s=1000.0).to_state_dict()
    }


def test_application_policy_holds_without_metrics():
    # A new Coordinator has not pushed yet; no draft worker has either.
    values = coordinator_values(2)
    values[RUNNING][1] = None
    coordinator = context(COORDINATOR, values, running=2)
    target = context(TARGET_WORKER, running=2)
    draft = context(DRAFT_WORKER, running=3, target=4)
    settings = AutoscalingSettings(max_target_groups=4, target_scale_up_hold_s=0)
    decisions, states = application_policy(contexts(coordinator, target, draft), settings)
    assert list(decisions.values()) == [2, 2, 4]
    assert (
        TargetScalingState.from_state_dict(states[coordinator.deployment_id]).last_change_s
        == 1000.0
    )


def test_application_policy_keeps_groups_equal_while_one_side_starts():
    coordinator = context(COORDINATOR, coordinator_values(2), running=2, target=3)
    target = context(TARGET_WORKER, running=3)
    draft = context(DRAFT_WORKER, {DRAFT_UTILIZATION: [0.7] * 4}, running=4)
    settings = AutoscalingSettings(max_target_groups=4, target_scale_up_hold_s=0)
    decisions, _ = application_policy(contexts(coordinator, target, draft), settings)
    # Held at 3 for both; the two measured groups' drafts scaled to three groups.
    assert list(decisions.values()) == [3, 3, 6]


def test_application_policy_gives_ingress_serves_default_rule():
    ingress = context(INGRESS, running=1, requests=256.0)
    coordinator = context(COORDINATOR, coordinator_values(2, queue=0, busy=0.6), running=2)
    target = context(TARGET_WORKER, running=2)
    draft = context(DRAFT_WORKER, {DRAFT_UTILIZATION: [0.7] * 4}, running=4)
    decisions, _ = application_policy(contexts(coordinator, target, draft, ingress))
    assert decisions[ingress.deployment_id] == 4  # 256 streams / 64 per replica


def test_application_policy_through_serves_config_and_wrapper():
    """What the controller does with the app config entry: build the policy from
    ``autoscaling_policy``, wrap it with Serve's delays and bounds, call it every tick."""
    settings = AutoscalingSettings(max_target_groups=4, target_scale_up_hold_s=0)
    app = ServeApplicationSchema(
        name=APP,
        import_path="specray.serve.app:app",
        autoscaling_policy=application_autoscaling_policy(settings),
        deployments=[
            {"name": name, "autoscaling_config": autoscaling_config(name, settings)} for name in ALL
        ],
    )
    policy = _resolve_policy_callable(AutoscalingPolicy(**app.autoscaling_policy))
    assert isinstance(policy, ApplicationPolicy) and policy.settings == settings
    coordinator = context(COORDINATOR, coordinator_values(2), running=2)
    target = context(TARGET_WORKER, running=2)
    draft = context(DRAFT_WORKER, {DRAFT_UTILIZATION: [0.7] * 4}, running=4)
    decisions, states = _apply_app_level_autoscaling_config(policy)(
        contexts(coordinator, target, draft)
    )
    # Serve's delays: 0 for the groups (the policy holds), 5 s for drafts, so drafts wait.
    assert list(decisions.values()) == [3, 3, 4]
    assert states[draft.deployment_id]["__decision_counters"] == 1
    assert states[coordinator.deployment_id]["specray_last_change_s"] == 1000.0


def test_draft_pool_policy_from_a_deployment_config():
    settings = AutoscalingSettings(target_draft_utilization=0.5)
    config = AutoscalingConfig(**autoscaling_config(DRAFT_WORKER, settings, scope="deployment"))
    policy = _resolve_policy_callable(config.policy)
    assert isinstance(policy, DraftPoolPolicy) and policy.settings == settings
    ctx = context(DRAFT_WORKER, {DRAFT_UTILIZATION: [0.95, 0.95, 0.95, None]}, running=4)
    assert policy(ctx) == (8, {})  # ceil(4 * 0.95 / 0.5) = 8 = 4 + step 4
    assert policy(context(DRAFT_WORKER, running=4, target=5)) == (5, {})  # nothing reported


# ---- autoscaling_config ---------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["application", "deployment", "plain"])
def test_configs_parse_in_serve(scope):
    for name in ALL:
        config = AutoscalingConfig(**autoscaling_config(name, SETTINGS, scope=scope))
        assert config.min_replicas <= config.initial_replicas <= config.max_replicas
        assert config.look_back_period_s > config.metrics_interval_s
        custom = scope == "deployment" and name == DRAFT_WORKER
        assert config.policy.is_default_policy_function() is not custom


def test_application_scope_bounds():
    settings = AutoscalingSettings(min_target_groups=1, max_target_groups=3, max_drafts_per_group=5)
    config = {name: autoscaling_config(name, settings, initial_target_groups=2) for name in ALL}
    assert config[COORDINATOR] == config[TARGET_WORKER]
    assert [
        config[COORDINATOR][k] for k in ("min_replicas", "max_replicas", "initial_replicas")
    ] == [1, 3, 2]
    assert [
        config[DRAFT_WORKER][k] for k in ("min_replicas", "max_replicas", "initial_replicas")
    ] == [1, 15, 2]
    assert config[COORDINATOR]["upscale_delay_s"] == config[COORDINATOR]["downscale_delay_s"] == 0
    assert "policy" not in config[DRAFT_WORKER]  # the application policy decides
    with pytest.raises(ValueError, match="initial_target_groups"):
        autoscaling_config(COORDINATOR, settings, initial_target_groups=4)
    with pytest.raises(ValueError, match="deployment_name"):
        autoscaling_config("Drafter", settings)


def test_plain_fallback_config():
    draft = plain_autoscaling_config(DRAFT_WORKER, SETTINGS, initial_target_groups=2)
    assert draft["target_ongoing_requests"] == SETTINGS.target_draft_utilization
    assert (draft["min_replicas"], draft["max_replicas"]) == (2, 16)
    coordinator = plain_autoscaling_config(COORDINATOR, SETTINGS, initial_target_groups=2)
    assert coordinator["min_replicas"] == coordinator["max_replicas"] == 2  # fixed
    assert AutoscalingConfig(**draft).policy.is_default_policy_function()
    # Serve's default rule on one draft call per busy replica sizes the pool like ours:
    # 4 replicas at 0.95 -> 3.8 ongoing / 0.7 = 5.43 replicas.
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    ctx = context(DRAFT_WORKER, running=4, requests=3.8)
    ctx.config = AutoscalingConfig(**draft)
    desired, _ = replica_queue_length_autoscaling_policy(ctx)
    assert math.ceil(desired) == drafts(pool(0.95, 0.95, 0.95, 0.95), None) == 6


def test_scope_follows_feature_detection(monkeypatch, caplog):
    assert supports_custom_policies()  # ray 2.60 has AutoscalingPolicy.policy_kwargs
    assert autoscaling_config(DRAFT_WORKER) == autoscaling_config(DRAFT_WORKER, scope="application")
    monkeypatch.setattr(autoscaling, "supports_custom_policies", lambda: False)
    with caplog.at_level(logging.WARNING, logger=autoscaling.__name__):
        assert autoscaling_config(DRAFT_WORKER) == plain_autoscaling_config(DRAFT_WORKER)
    assert "request-based autoscaling only" in caplog.text
    with pytest.raises(RuntimeError, match="application"):
        autoscaling_config(DRAFT_WORKER, scope="application")
    with pytest.raises(ValueError, match="scope"):
        autoscaling_config(DRAFT_WORKER, scope="app")
