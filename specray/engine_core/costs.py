"""The coordinator's measured costs: verification, draft step and network round trip.

Calibrated tables (``DistributedBackend.calibrate``) keep their shape while their level tracks
the times observed in service; line models are refitted to the observed samples.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specray.engine_core.cost_fit import fit_draft_cost, fit_verify_cost
from specray.engine_core.policy import DraftCost, VerifyCost

COST_SAMPLES = 256  # recent timing samples kept for the fits
REFIT_EVERY = 8  # refit every this many samples (a fit costs ~0.3 ms of CPU)
RTT_PROBE_INTERVAL_S = 0.5  # how often the coordinator times a no-op call to the target


def _level(level: float, observed_s: float, calibrated_s: float) -> float:
    """Running ratio of observed to calibrated time. Calibration measures one worker alone;
    in service the workers share hosts, networks and caches with the rest, so the level moves
    (measured here: both workers slow down ~1.5-2x when draft and target compute at once)."""
    if calibrated_s <= 0:
        return level
    ratio = min(max(observed_s / calibrated_s, 0.25), 4.0)
    return 0.8 * level + 0.2 * ratio


def _added(totals: tuple[float, float], observed_s: float, calibrated_s: float):
    return totals[0] + observed_s, totals[1] + calibrated_s


def _mean_level(totals: tuple[float, float]) -> float | None:
    """Observed / calibrated seconds summed over a run (None before any calibrated time)."""
    observed, calibrated = totals
    return observed / calibrated if calibrated > 0 else None


def scaled(cost, level: float):
    """The calibrated table with every time multiplied by ``level``."""
    return replace(cost, table=tuple((tokens, seconds * level) for tokens, seconds in cost.table))


@dataclass
class Costs:
    """Measured costs, refitted as samples arrive."""

    verify: VerifyCost
    draft: DraftCost
    rtt_s: float
    # the last COST_SAMPLES of each: (batch, tokens per request, seconds), (batch, s per step)
    verify_samples: deque = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))
    draft_samples: deque = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))
    num_verify: int = 0  # samples ever added
    num_draft: int = 0
    # Observed / calibrated time (running), for calibrated tables: of target-only rounds (one
    # token per request) and of rounds verifying drafts, apart, because the latter cost more
    # than their forward (verification rules; on a shared host, the draft computing beside).
    one_token_level: float | None = None  # None: not observed yet
    draft_round_level: float | None = None
    draft_level: float = 1.0
    # Totals of observed and calibrated seconds over all samples: the mean level of a run
    # (what a simulation of that run should be given; the running level follows its end).
    verify_totals: tuple[float, float] = (0.0, 0.0)
    one_token_totals: tuple[float, float] = (0.0, 0.0)
    draft_round_totals: tuple[float, float] = (0.0, 0.0)
    draft_totals: tuple[float, float] = (0.0, 0.0)

    @property
    def verify_level(self) -> float:
        """The level of target-only rounds (of any round until those are observed)."""
        for level in (self.one_token_level, self.draft_round_level):
            if level is not None:
                return level
        return 1.0

    @property
    def draft_round_scale(self) -> float:
        """How much more a round verifying drafts costs than its calibrated forward, relative
        to target-only rounds (1 until both kinds were observed)."""
        if self.one_token_level is None or self.draft_round_level is None:
            return 1.0
        return self.draft_round_level / self.one_token_level

    @property
    def mean_verify_level(self) -> float:
        level = _mean_level(self.verify_totals)
        return 1.0 if level is None else level

    @property
    def mean_levels(self) -> tuple[float, float]:
        """The run's mean (target-only level, draft-round scale), as ``verify_level`` and
        ``draft_round_scale`` are formed from the running levels."""
        one_token = _mean_level(self.one_token_totals)
        draft_round = _mean_level(self.draft_round_totals)
        if one_token is None or draft_round is None:
            only = one_token if one_token is not None else draft_round
            return (1.0 if only is None else only), 1.0
        return one_token, draft_round / one_token

    @property
    def mean_draft_level(self) -> float:
        level = _mean_level(self.draft_totals)
        return 1.0 if level is None else level

    def add_verify(self, batch: int, tokens: int, seconds: float, prior: VerifyCost) -> None:
        self.verify_samples.append((batch, tokens, seconds))
        self.num_verify += 1
        if prior.table:  # a calibrated shape, its levels tracked from the rounds (see _level)
            calibrated = replace(prior, draft_round_scale=1.0).seconds(batch, tokens)
            self.verify_totals = _added(self.verify_totals, seconds, calibrated)
            if tokens > 1:
                level = self.draft_round_level or self.verify_level
                self.draft_round_level = _level(level, seconds, calibrated)
                self.draft_round_totals = _added(self.draft_round_totals, seconds, calibrated)
            else:
                level = self.one_token_level or self.verify_level
                self.one_token_level = _level(level, seconds, calibrated)
                self.one_token_totals = _added(self.one_token_totals, seconds, calibrated)
            if self.num_verify % REFIT_EVERY == 0:
                self.verify = replace(
                    scaled(prior, self.verify_level), draft_round_scale=self.draft_round_scale
                )
        elif self.num_verify <= REFIT_EVERY or self.num_verify % REFIT_EVERY == 0:
            self.verify = fit_verify_cost(self.verify_samples, prior)

    def add_draft(self, batch: int, seconds_per_step: float, prior: DraftCost) -> None:
        self.draft_samples.append((batch, seconds_per_step))
        self.num_draft += 1
        if prior.table:
            calibrated = prior.seconds(batch)
            self.draft_level = _level(self.draft_level, seconds_per_step, calibrated)
            self.draft_totals = _added(self.draft_totals, seconds_per_step, calibrated)
            if self.num_draft % REFIT_EVERY == 0:
                self.draft = scaled(prior, self.draft_level)
        elif self.num_draft <= REFIT_EVERY or self.num_draft % REFIT_EVERY == 0:
            self.draft = fit_draft_cost(self.draft_samples, prior)

    def add_rtt(self, seconds: float) -> None:
        self.rtt_s = 0.9 * self.rtt_s + 0.1 * max(seconds, 0.0)


async def probe_rtt(target, costs: Costs, metrics, busy: Callable[[], bool]) -> None:
    """Time a no-op call to ``target`` while requests run (``busy()``), forever: the network
    term of the policy. (A verify call's own latency would include queueing behind other
    micro-batches.) Timed on the running loop's clock (virtual under the simulator)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(RTT_PROBE_INTERVAL_S)
        if not busy():
            continue
        started = loop.time()
        try:
            await target.ping()
        except Exception:  # a failing target shows up in the rounds; keep probing
            continue
        rtt_s = loop.time() - started
        costs.add_rtt(rtt_s)
        metrics.labels(metrics.network_latency).observe(rtt_s)
