"""How many draft workers and target groups specray runs: the decision rule, pure functions
of the signals (no Ray). :mod:`specray.cluster.autoscaling` plugs it into Ray Serve.

The application has four deployments: ``Ingress`` (front end), ``Coordinator`` and
``TargetWorker`` (one replica each per target group, so their counts are always equal) and
``DraftWorker`` (a pool; each draft replica serves one target group). Replicas publish the
signals below from ``record_autoscaling_stats`` (build them with ``coordinator_stats`` /
``draft_worker_stats``); Serve averages each over ``look_back_period_s`` per replica.

Decision rule (``decide_target_groups`` then ``decide_draft_pool``):

- Target groups: +1 when the mean target busy fraction is >= ``target_busy_high`` and the mean
  admission queue is >= ``queue_depth_high`` (the target is the bottleneck; drafts cannot help);
  -1 when nothing queues and the remaining groups would stay at or below ``target_busy_low``
  (mean busy * G / (G - 1)). The condition must hold for ``target_scale_up_hold_s`` /
  ``target_scale_down_hold_s``, and no change within ``target_cooldown_s`` of the last one.
- Draft pool: busy = running drafts * mean draft utilization (drafts' worth of drafting work).
  It is shared among the groups worth drafting for (acceptance >= ``min_acceptance_rate`` and
  some requests speculating) in proportion to running * speculating_fraction; each such group
  needs its share / ``target_draft_utilization`` drafts, or at least one more than its current
  share when requests queue while its target is under-used (< ``target_busy_low``: the target
  waits for drafts). Other groups need ``min_drafts_per_group``. Each group's need is clamped to
  [min, max] drafts per group, the sum is scaled by (decided groups / measured groups), rounded
  up, limited to ``max_draft_step_up/down`` from the running count, then clamped to the per-group
  bounds times the decided number of groups.

Worked example (default settings: target utilization 0.7, min acceptance 0.3, 1..8 drafts per
group, queue threshold 4, busy thresholds 0.5 / 0.9). Two groups, four drafts with
utilizations (0.9, 0.9, 0.8, 0.0): busy = 4 * 0.65 = 2.6 drafts. Group A: acceptance 0.8,
8 running, all speculating, target busy 0.6, no queue. Group B: acceptance 0.2. A needs
2.6 / 0.7 = 3.71 drafts, B its minimum 1: ceil(4.71) = 5 drafts, two groups kept. Had A had 6
requests queued with its target busy 0.3, it would need max(3.71, 4 * 1 + 1) = 5 -> 6 drafts.

No data, no change: target groups hold at Serve's current target until every Coordinator has
reported (and while any replica of either side is starting); the pool holds until a DraftWorker
has reported (one not yet reported counts at the mean of the others) and is sized by utilization
alone while a Coordinator has not. Serve still applies its delays and min/max to each answer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

log = logging.getLogger(__name__)

# Deployment names (stable: the app config and the policy look them up by name).
INGRESS, COORDINATOR, TARGET_WORKER, DRAFT_WORKER = (
    "Ingress",
    "Coordinator",
    "TargetWorker",
    "DraftWorker",
)

# Metric names published through record_autoscaling_stats.
QUEUE_DEPTH = "queue_depth"  # Coordinator: requests waiting for admission
RUNNING = "running"  # Coordinator: requests decoding
ACCEPTANCE_RATE = "acceptance_rate"  # Coordinator: recent per-token draft acceptance, [0, 1]
TARGET_BUSY_FRACTION = "target_busy_fraction"  # Coordinator: target compute / wall time, [0, 1]
SPECULATING_FRACTION = "speculating_fraction"  # Coordinator: running requests with k > 0, [0, 1]
DRAFT_UTILIZATION = "draft_utilization"  # DraftWorker: drafting time / wall time, [0, 1]
COORDINATOR_METRICS = (
    QUEUE_DEPTH,
    RUNNING,
    ACCEPTANCE_RATE,
    TARGET_BUSY_FRACTION,
    SPECULATING_FRACTION,
)

# Metrics are pushed every METRICS_INTERVAL_S (recorded every min(0.2 * look-back, interval))
# and averaged over LOOK_BACK_PERIOD_S: five samples per window, a decision within ~2 s of a
# change. Serve's default interval is 10 s; the look-back must stay above it.
METRICS_INTERVAL_S = 2.0
LOOK_BACK_PERIOD_S = 10.0
DRAFT_UPSCALE_DELAY_S = 5.0  # a draft replica is a small model: add it quickly
DRAFT_DOWNSCALE_DELAY_S = 60.0  # ...and keep it through a short lull
_ROUND_TOL = 1e-9  # 5.0000000001 drafts needed is 5, not 6


def _number(name, value, low, high=None, *, integer=False, low_open=False):
    """Validated value: a finite number (an int if `integer`) in [low, high] ((low, high] if
    `low_open`). Bools are rejected: True is not a count."""
    kind = "an integer" if integer else "a finite number"
    wrong_type = isinstance(value, bool) or not isinstance(value, int if integer else int | float)
    if wrong_type or not math.isfinite(value):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        opening = "(" if low_open else "["
        bounds = f"in {opening}{low}, {high}]" if high is not None else f">= {low}"
        bounds = f"> {low}" if low_open and high is None else bounds
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return value


def _ordered(settings, low_name, high_name, *, strict=False):
    low, high = getattr(settings, low_name), getattr(settings, high_name)
    if high < low or (strict and high == low):
        relation = ">" if strict else ">="
        raise ValueError(f"{high_name} must be {relation} {low_name} ({low}), got {high}")


@dataclass(frozen=True)
class AutoscalingSettings:
    """Every knob of the policy; JSON-serializable so Serve can pass it as ``policy_kwargs``."""

    min_drafts_per_group: int = 1  # >= 1: without a drafter a group can never measure acceptance
    max_drafts_per_group: int = 8
    target_draft_utilization: float = 0.7  # headroom so a burst does not stall the targets
    min_acceptance_rate: float = 0.3  # below this a group gets only its minimum drafts
    queue_depth_high: float = 4.0  # requests waiting per group that count as "queueing"
    target_busy_high: float = 0.9  # at or above: the target is the bottleneck
    target_busy_low: float = 0.5  # below: the target is under-used
    max_draft_step_up: int = 4  # drafts added per decision
    max_draft_step_down: int = 2  # drafts removed per decision
    scale_target_groups: bool = True
    min_target_groups: int = 1
    max_target_groups: int = 1
    max_target_step: int = 1  # groups added or removed per decision
    target_scale_up_hold_s: float = 30.0  # pressure must last this long before a group is added
    target_scale_down_hold_s: float = 300.0  # ...or removed (a big model is slow to bring back)
    target_cooldown_s: float = 60.0  # after a change settles: a window of fresh metrics first
    max_ingress_replicas: int = 2
    ingress_target_ongoing_requests: float = 64.0  # streams per front-end replica (see below)

    def __post_init__(self):
        for name in ("min_drafts_per_group", "max_drafts_per_group", "max_draft_step_up"):
            _number(name, getattr(self, name), 1, integer=True)
        for name in ("max_draft_step_down", "min_target_groups", "max_target_groups"):
            _number(name, getattr(self, name), 1, integer=True)
        _number("max_target_step", self.max_target_step, 1, integer=True)
        _number("max_ingress_replicas", self.max_ingress_replicas, 1, integer=True)
        for name in ("target_draft_utilization", "target_busy_high"):
            _number(name, getattr(self, name), 0, 1, low_open=True)
        for name in ("min_acceptance_rate", "target_busy_low"):
            _number(name, getattr(self, name), 0, 1)
        for name in ("queue_depth_high", "ingress_target_ongoing_requests"):
            _number(name, getattr(self, name), 0, low_open=True)
        for name in ("target_scale_up_hold_s", "target_scale_down_hold_s", "target_cooldown_s"):
            _number(name, getattr(self, name), 0)
        if not isinstance(self.scale_target_groups, bool):
            raise ValueError(
                f"scale_target_groups must be a bool, got {self.scale_target_groups!r}"
            )
        _ordered(self, "min_drafts_per_group", "max_drafts_per_group")
        _ordered(self, "min_target_groups", "max_target_groups")
        _ordered(self, "target_busy_low", "target_busy_high", strict=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AutoscalingSettings:
        """Settings from ``policy_kwargs``; an unknown key is an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown autoscaling settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GroupSignals:
    """One Coordinator replica's metrics: one target group. Field names are the metric names."""

    queue_depth: float
    running: float
    acceptance_rate: float
    target_busy_fraction: float
    speculating_fraction: float

    def __post_init__(self):
        _number(QUEUE_DEPTH, self.queue_depth, 0)
        _number(RUNNING, self.running, 0)
        for name in (ACCEPTANCE_RATE, TARGET_BUSY_FRACTION, SPECULATING_FRACTION):
            _number(name, getattr(self, name), 0, 1)


@dataclass(frozen=True)
class DraftPoolSignals:
    """The DraftWorker pool as Serve sees it."""

    num_running: int  # replicas running now
    num_target: int  # Serve's current target: kept when no replica has reported
    utilizations: tuple[float, ...] = ()  # one per running replica that has reported

    def __post_init__(self):
        _number("num_running", self.num_running, 0, integer=True)
        _number("num_target", self.num_target, 0, integer=True)
        if len(self.utilizations) > self.num_running:
            raise ValueError(
                f"utilizations has {len(self.utilizations)} values for "
                f"{self.num_running} running replicas"
            )
        for i, value in enumerate(self.utilizations):
            _number(f"utilizations[{i}]", value, 0, 1)


@dataclass(frozen=True)
class TargetScalingState:
    """Hysteresis for the target groups, carried between decisions in Serve's policy state."""

    pending_direction: int = 0  # +1 wants more groups, -1 fewer, 0 neither
    pending_since_s: float | None = None  # when that wish started
    last_change_s: float | None = None  # last time the groups changed or were changing

    _PREFIX = "specray_"  # Serve keeps its own "__decision_*" keys in the same dict

    def to_state_dict(self) -> dict[str, Any]:
        return {self._PREFIX + k: v for k, v in asdict(self).items()}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any] | None) -> TargetScalingState:
        state = state or {}
        return cls(
            **{
                f.name: state[cls._PREFIX + f.name]
                for f in fields(cls)
                if cls._PREFIX + f.name in state
            }
        )


@dataclass(frozen=True)
class Decision:
    num_draft_workers: int | None  # None: DraftWorker not autoscaled
    num_target_groups: int | None  # Coordinator and TargetWorker alike; None: not autoscaled
    state: TargetScalingState


def coordinator_stats(
    *,
    queue_depth: float,
    running: float,
    acceptance_rate: float,
    target_busy_fraction: float,
    speculating_fraction: float,
) -> dict[str, float]:
    """What a Coordinator's ``record_autoscaling_stats`` returns (validated plain floats: Serve
    disables custom metrics for good if the first dict holds anything but int / float)."""
    signals = GroupSignals(
        queue_depth, running, acceptance_rate, target_busy_fraction, speculating_fraction
    )
    return {name: float(value) for name, value in asdict(signals).items()}


def draft_worker_stats(*, draft_utilization: float) -> dict[str, float]:
    """What a DraftWorker's ``record_autoscaling_stats`` returns."""
    return {DRAFT_UTILIZATION: float(_number(DRAFT_UTILIZATION, draft_utilization, 0, 1))}


# ---- decision core: pure functions of the signals ------------------------------------------
def _waits_for_drafts(group: GroupSignals, settings: AutoscalingSettings) -> bool:
    """Requests queue while the target is under-used: the rounds are waiting on drafts."""
    return (
        group.queue_depth >= settings.queue_depth_high
        and group.target_busy_fraction < settings.target_busy_low
    )


def group_draft_needs(
    groups: Sequence[GroupSignals],
    busy_drafts: float,
    num_drafts: int,
    settings: AutoscalingSettings,
) -> list[float]:
    """Drafts each group needs (fractional, clamped to the per-group bounds); see module doc.

    busy_drafts: drafting work in drafts' worth (running drafts * mean utilization); it is
    attributed to the groups worth drafting for, in proportion to their speculating requests.
    """
    low, high = settings.min_drafts_per_group, settings.max_drafts_per_group
    # Requests that draft; 0 for a group not speculating or below the acceptance threshold.
    weights = [
        g.running * g.speculating_fraction * (g.acceptance_rate >= settings.min_acceptance_rate)
        for g in groups
    ]
    total_weight = sum(weights)
    needs = []
    for group, weight in zip(groups, weights, strict=True):
        if weight == 0:
            needs.append(float(low))
            continue
        share = weight / total_weight
        need = busy_drafts * share / settings.target_draft_utilization
        if _waits_for_drafts(group, settings):
            need = max(need, num_drafts * share + 1)
        needs.append(min(max(need, low), high))
    return needs


def decide_draft_pool(
    pool: DraftPoolSignals,
    groups: Sequence[GroupSignals] | None,
    *,
    num_groups_next: int | None,
    settings: AutoscalingSettings,
) -> int:
    """Desired DraftWorker replicas. ``groups``: one per running Coordinator, or None when not
    all have reported (then only utilization counts); ``num_groups_next``: the target groups
    decided this round, or None when unknown (then Serve's min/max are the only bounds)."""
    if not pool.utilizations:
        return pool.num_target  # nothing measured yet
    busy = pool.num_running * sum(pool.utilizations) / len(pool.utilizations)
    if groups:
        need = sum(group_draft_needs(groups, busy, pool.num_running, settings))
        # New groups get the mean need of the measured ones; leaving groups take theirs away.
        need *= (num_groups_next or len(groups)) / len(groups)
    else:
        need = busy / settings.target_draft_utilization
    desired = math.ceil(need - _ROUND_TOL)
    desired = min(
        max(desired, pool.num_running - settings.max_draft_step_down),
        pool.num_running + settings.max_draft_step_up,
    )
    if num_groups_next is not None:  # each group keeps its minimum, even against the step
        desired = min(
            max(desired, settings.min_drafts_per_group * num_groups_next),
            settings.max_drafts_per_group * num_groups_next,
        )
    return desired


def target_pressure(groups: Sequence[GroupSignals], settings: AutoscalingSettings) -> int:
    """+1: targets saturated and requests queue; -1: one group fewer stays under-used; else 0."""
    n = len(groups)
    busy = sum(g.target_busy_fraction for g in groups) / n
    queued = sum(g.queue_depth for g in groups)
    if busy >= settings.target_busy_high and queued / n >= settings.queue_depth_high:
        return 1
    if n > 1 and queued == 0 and busy * n / (n - 1) <= settings.target_busy_low:
        return -1
    return 0


def decide_target_groups(
    groups: Sequence[GroupSignals] | None,
    *,
    num_groups: int,
    settled: bool,
    state: TargetScalingState,
    now_s: float,
    settings: AutoscalingSettings,
) -> tuple[int, TargetScalingState]:
    """Desired target groups and the new hysteresis state.

    num_groups: Serve's current target; settled: every replica of Coordinator and TargetWorker
    is running at that target; groups: one per Coordinator replica, None if any has not
    reported. Worked example (hold 30 s): pressure +1 first seen at t=100 -> (2, pending since
    100); still +1 at t=130 -> (3, last change 130); at t=150 the third group is still starting
    -> (3, last change 150); fresh pressure is ignored until t=150 + cooldown.
    """
    if not settings.scale_target_groups:
        return num_groups, TargetScalingState()
    if not settled or not groups:  # a change is under way: hold, and restart the cooldown
        return num_groups, TargetScalingState(last_change_s=now_s)
    pressure = target_pressure(groups, settings)
    if (pressure > 0 and num_groups >= settings.max_target_groups) or (
        pressure < 0 and num_groups <= settings.min_target_groups
    ):
        pressure = 0
    cooling = (
        state.last_change_s is not None and now_s - state.last_change_s < settings.target_cooldown_s
    )
    if pressure == 0 or cooling:
        return num_groups, replace(state, pending_direction=0, pending_since_s=None)
    since = state.pending_since_s
    if state.pending_direction != pressure or since is None:
        since = now_s
    hold_s = settings.target_scale_up_hold_s if pressure > 0 else settings.target_scale_down_hold_s
    if now_s - since < hold_s:
        return num_groups, replace(state, pending_direction=pressure, pending_since_s=since)
    desired = num_groups + pressure * settings.max_target_step
    desired = min(max(desired, settings.min_target_groups), settings.max_target_groups)
    return desired, TargetScalingState(last_change_s=now_s)


def decide(
    pool: DraftPoolSignals | None,
    groups: Sequence[GroupSignals] | None,
    *,
    num_groups: int | None,
    groups_settled: bool,
    state: TargetScalingState,
    now_s: float,
    settings: AutoscalingSettings,
) -> Decision:
    """Target groups first, then the draft pool sized for the groups just decided.

    pool None: DraftWorker is not autoscaled (no draft decision). num_groups None: Coordinator
    is not autoscaled (no group decision; the pool is sized by utilization alone).
    """
    num_groups_next = None
    if num_groups is not None:
        num_groups_next, state = decide_target_groups(
            groups,
            num_groups=num_groups,
            settled=groups_settled,
            state=state,
            now_s=now_s,
            settings=settings,
        )
    drafts = None
    if pool is not None:
        drafts = decide_draft_pool(pool, groups, num_groups_next=num_groups_next, settings=settings)
    return Decision(num_draft_workers=drafts, num_target_groups=num_groups_next, state=state)


DEFAULT_SETTINGS = AutoscalingSettings()
