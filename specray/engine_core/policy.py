"""Speculation-length policy: choose the draft length k that maximises predicted tokens/s.

Pure stdlib so the coordinator can run it every round. Model (docs/design.md): with per-position
acceptance α_j, one target call commits E(k) = 1 + Σ_{j<=k} Π_{i<=j} α_i tokens per request.
A round costs k·draft_step(b) + rtt_s + verify(b, k+1) unpipelined, or
max(verify(b, k+1) + rtt_s, k·draft_step(b)) when the draft works on one micro-batch while the
target verifies another; k = 0 is target-only: verify(b, 1), no draft and no network hop.
Between the two, a lone micro-batch that drafts ahead hides its next block's draft only when
the drafts made ahead are kept (probability h, see draft_ahead_hit):
max(verify(b, k+1) + rtt_s + (1 - h)·k·draft_step(b), k·draft_step(b)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

MAX_K_LIMIT = 32


def _check(name: str, value: object, low: float, high: float | None = None, *, integer=False):
    """Validated value: a finite number (an int if `integer`) in [low, high]."""
    kind = "an integer" if integer else "a finite number"
    wrong_type = isinstance(value, bool) or not isinstance(value, int if integer else int | float)
    if wrong_type or not math.isfinite(value):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return value


def _acceptance(values: Sequence[float]) -> list[float]:
    """Validated acceptance list as floats. Fast path: every value a plain float in [0, 1]
    (NaN fails the comparison); otherwise _check converts ints and names the first bad index."""
    values = list(values)
    fast = [v for v in values if type(v) is float and 0.0 <= v <= 1.0]
    if len(fast) == len(values):
        return fast
    return [float(_check(f"acceptance[{i}]", v, 0, 1)) for i, v in enumerate(values)]


def _table(name: str, points) -> tuple[tuple[float, float], ...]:
    """Validated measured (tokens in the forward, seconds) points, strictly increasing."""
    out = tuple((float(x), float(_check(f"{name} seconds", y, 0))) for x, y in points)
    for (x0, _), (x1, _) in pairwise(out):
        if not x1 > x0:
            raise ValueError(f"{name} points must have increasing token counts, got {points!r}")
    if out and out[0][0] < 1:
        raise ValueError(f"{name} token counts must be >= 1, got {points!r}")
    return out


def _interpolate(table: tuple[tuple[float, float], ...], tokens: float) -> float:
    """Piecewise linear through the points; flat below the first, linear past the last."""
    if len(table) == 1 or tokens <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in pairwise(table):
        if tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = table[-2], table[-1]
    return max(y1 + (y1 - y0) / (x1 - x0) * (tokens - x1), 0.0)


def tabulate(samples: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(tokens in the forward, seconds) samples -> a table, averaging equal token counts, then
    non-decreasing: a forward can always be padded to more tokens, so a dip is noise (measured
    here: 62 ms for 3 tokens, 45 ms for 4), and a dip would make the policy prefer odd splits.
    E.g. [(1, 0.046), (3, 0.062), (4, 0.045), (8, 0.060)] -> 1: 0.045, 3: 0.045, 4: 0.045,
    8: 0.060 (each point is the cheapest at or above its token count)."""
    grouped: dict[float, list[float]] = {}
    for tokens, seconds in samples:
        grouped.setdefault(float(tokens), []).append(float(seconds))
    table = [(tokens, sum(v) / len(v)) for tokens, v in sorted(grouped.items())]
    cheapest = math.inf
    for index in reversed(range(len(table))):
        cheapest = min(cheapest, table[index][1])
        table[index] = (table[index][0], cheapest)
    return tuple(table)


@dataclass(frozen=True)
class VerifyCost:
    """Target forward time: fixed_s + per_request_s * batch
    + per_token_s * batch * tokens_per_request (tokens_per_request = k + 1 when verifying);
    or, with ``table``, interpolated from measured (batch * tokens_per_request, seconds) points.
    A table captures what a line cannot on a CPU: one row runs as a fast matrix-vector product,
    two to four rows cost nearly as much as eight (measured here: 75, 126, 180, 177 ms for 1, 2,
    3, 5 tokens). ``draft_round_scale`` multiplies rounds that verify drafts (more than one token
    per request): what such a round costs beyond its forward, measured in service (the
    verification rules; on a host shared with the draft, the draft computing beside it)."""

    fixed_s: float
    per_request_s: float
    per_token_s: float
    table: tuple = ()  # ((tokens in the forward, seconds), ...) measured; overrides the line
    draft_round_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_request_s", "per_token_s"):
            _check(name, getattr(self, name), 0)
        object.__setattr__(self, "table", _table("table", self.table))
        if not _check("draft_round_scale", self.draft_round_scale, 0) > 0:
            raise ValueError(f"draft_round_scale must be > 0, got {self.draft_round_scale!r}")

    def seconds(self, batch: int, tokens_per_request: int) -> float:
        batch = _check("batch", batch, 1, integer=True)
        tokens = _check("tokens_per_request", tokens_per_request, 1, integer=True)
        return self._seconds(batch, tokens)

    def _seconds(self, batch: int, tokens: int) -> float:
        if self.table:
            seconds = _interpolate(self.table, batch * tokens)
        else:
            seconds = self.fixed_s + self.per_request_s * batch + self.per_token_s * batch * tokens
        return seconds * self.draft_round_scale if tokens > 1 else seconds


@dataclass(frozen=True)
class DraftCost:
    """One draft step (one token for each request of the batch): fixed_s + per_request_s * batch."""

    fixed_s: float
    per_request_s: float
    table: tuple = ()  # ((batch, seconds per step), ...) measured; overrides the line

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_request_s"):
            _check(name, getattr(self, name), 0)
        object.__setattr__(self, "table", _table("table", self.table))

    def seconds(self, batch: int) -> float:
        return self._seconds(_check("batch", batch, 1, integer=True))

    def _seconds(self, batch: int) -> float:
        if self.table:
            return _interpolate(self.table, batch)
        return self.fixed_s + self.per_request_s * batch


def _committed_prefix(values: list[float], max_k: int) -> list[float]:
    """[E(0), ..., E(max_k)] in one prefix-product pass over validated acceptance values."""
    padded = values[:max_k] + [values[-1] if values else 0.0] * (max_k - len(values))
    total = reach = 1.0
    committed = [total]
    for alpha in padded:
        reach *= alpha
        total += reach
        committed.append(total)
    return committed


def expected_committed(acceptance: Sequence[float], k: int) -> float:
    """E(k) with per-position acceptance; positions beyond len(acceptance) reuse the last value
    (or 0 if empty). E.g. acceptance [0.8, 0.5], k = 3: 1 + 0.8 + 0.4 + 0.2 = 2.4."""
    values = _acceptance(acceptance)
    k = _check("k", k, 0, integer=True)
    return _committed_prefix(values, k)[k]


def _round_s(verify_s: float, rtt_s: float, draft_total_s: float, hidden: float, fold: bool):
    """One speculative round: the verification, the network hop, and the part of the draft
    that is not hidden behind target work (never less than the draft itself). With ``fold``
    (draft-ahead) the verdict reaches the draft worker directly and it starts the next block
    at once, so the exposed draft overlaps the hop back to the coordinator and its next call."""
    exposed_draft_s = (1.0 - hidden) * draft_total_s
    if fold:
        exposed_s = verify_s + (exposed_draft_s if exposed_draft_s > rtt_s else rtt_s)
    else:
        exposed_s = verify_s + rtt_s + exposed_draft_s
    return draft_total_s if draft_total_s > exposed_s else exposed_s  # max()


def _rates(
    committed: list[float],
    first: int,
    batch: int,
    verify: VerifyCost,
    draft: DraftCost,
    rtt_s: float,
    hidden: list[float],
    fold: bool = False,
) -> list[float]:
    """Predicted tokens/s for k = first .. len(committed) - 1 from validated inputs, committed[k]
    being E(k) and hidden[k] the fraction of the k-step draft that overlaps target work (1:
    pipelined, 0: the target waits for it); ``fold`` as for _round_s. VerifyCost.seconds /
    DraftCost.seconds are split into per-batch terms with the same floating-point operations,
    so the rates are bit-identical to evaluating them per k."""
    draft_s = draft._seconds(batch)
    rates = []
    for k in range(first, len(committed)):
        if k == 0:  # target-only: verify(batch, 1), no draft and no network hop
            round_s = verify._seconds(batch, 1)
        else:
            round_s = _round_s(verify._seconds(batch, k + 1), rtt_s, k * draft_s, hidden[k], fold)
        rates.append(batch * committed[k] / round_s if round_s > 0 else math.inf)
    return rates


def _hidden(
    values: list[float], max_k: int, pipelined: bool, ahead_min_hit: float | None
) -> list[float]:
    """[h(0), ..., h(max_k)]: the fraction of a k-token block's draft that hides behind the
    target's work. Pipelined: all of it. A lone micro-batch drafting ahead: the probability
    that the drafts made ahead are kept, draft_ahead_hit(values, k), when they are made at all
    (hit >= ahead_min_hit); none without draft-ahead (ahead_min_hit None)."""
    if pipelined or ahead_min_hit is None:
        return [1.0 if pipelined else 0.0] * (max_k + 1)
    hits = _hit_prefix(values, max_k)
    return [hit if k and hit >= ahead_min_hit else 0.0 for k, hit in enumerate(hits)]


def _hit_prefix(values: list[float], max_k: int) -> list[float]:
    """[draft_ahead_hit(values, k) for k in 0..max_k] from validated values, in one pass."""
    padded = values[: max_k + 1] + [values[-1] if values else 0.0] * (max_k + 1 - len(values))
    hits, hit = [], 1.0
    for alpha in padded:
        hit *= alpha  # positions 1 .. k + 1
        hits.append(hit)
    return hits


def predicted_tokens_per_s(
    acceptance: Sequence[float],
    k: int,
    *,
    batch: int,
    verify: VerifyCost,
    draft: DraftCost,
    rtt_s: float,
    pipelined: bool,
    draft_ahead_min_hit: float | None = None,
) -> float:
    """batch * E(k) / round_time(k); inf if the cost model predicts a free round.
    ``draft_ahead_min_hit``: unpipelined, the request drafts ahead when its drafts made ahead
    are kept with at least this probability (None: it never drafts ahead)."""
    batch = _check("batch", batch, 1, integer=True)
    values = _acceptance(acceptance)
    k = _check("k", k, 0, integer=True)
    rtt_s = _check("rtt_s", rtt_s, 0)
    min_hit = _min_hit(draft_ahead_min_hit)
    hidden = _hidden(values, k, pipelined, min_hit)
    committed = _committed_prefix(values, k)
    return _rates(committed, k, batch, verify, draft, rtt_s, hidden, min_hit is not None)[0]


def _min_hit(value: float | None) -> float | None:
    return None if value is None else float(_check("draft_ahead_min_hit", value, 0, 1))


@dataclass(frozen=True)
class PolicyConfig:
    max_k: int = 8  # longest draft block considered; 0 disables speculation
    probe_k: int = 2  # k used to re-measure acceptance for a request whose speculation is off
    probe_every_rounds: int = 16  # a request at k=0 is probed again after this many rounds
    # ... doubled after each probe that did not bring speculation back, at most this many
    # times (a probe in a large batch pads every request to the probe's width: at batch 16
    # here, probing every 16 rounds cost 12-15% of throughput)
    max_probe_backoff: int = 4
    min_gain: float = 1.02  # speculate only when predicted tokens/s beats target-only by this
    # ... and, once speculating, go on until it falls below this fraction of target-only: a
    # request's acceptance comes in runs (copied passages, then none), so its estimate swings,
    # and a batch that stops speculating stops measuring it
    stop_gain: float = 0.95

    def __post_init__(self) -> None:
        _check("max_k", self.max_k, 0, MAX_K_LIMIT, integer=True)
        _check("probe_k", self.probe_k, 1, MAX_K_LIMIT, integer=True)
        _check("probe_every_rounds", self.probe_every_rounds, 1, integer=True)
        _check("max_probe_backoff", self.max_probe_backoff, 0, 16, integer=True)
        _check("min_gain", self.min_gain, 1)
        _check("stop_gain", self.stop_gain, 0, self.min_gain)


def choose_k(
    acceptance: Sequence[float],
    *,
    batch: int,
    verify: VerifyCost,
    draft: DraftCost,
    rtt_s: float,
    pipelined: bool,
    config: PolicyConfig,
    max_tokens_left: int | None = None,
    draft_ahead_min_hit: float | None = None,
) -> int:
    """argmax over k in 0..min(max_k, max_tokens_left - 1) of predicted tokens/s; 0 unless the
    best k > 0 beats target-only by more than config.min_gain. Ties go to the smaller k.

    A round commits at most k + 1 tokens, hence the max_tokens_left - 1 cap. Example (batch 1,
    verify 10 ms flat, draft 1 ms/step, rtt 0, unpipelined, α = 0.5): k = 1 gives
    1.5 / 11 ms = 136 tok/s against 100 tok/s target-only; k = 2 gives 1.75 / 12 ms = 146;
    k = 3 gives 1.875 / 13 ms = 144, so k = 2. ``draft_ahead_min_hit`` as for
    predicted_tokens_per_s.
    """
    cap = config.max_k
    if max_tokens_left is not None:
        cap = min(cap, _check("max_tokens_left", max_tokens_left, 1, integer=True) - 1)
    # Validate once (the checks, order and messages of predicted_tokens_per_s), then rate every
    # k in one pass with the same floating-point operations, hence the same rates.
    batch = _check("batch", batch, 1, integer=True)
    values = _acceptance(acceptance)
    committed = _committed_prefix(values, cap)
    rtt_s = _check("rtt_s", rtt_s, 0)
    min_hit = _min_hit(draft_ahead_min_hit)
    hidden = _hidden(values, cap, pipelined, min_hit)
    rates = _rates(committed, 0, batch, verify, draft, rtt_s, hidden, min_hit is not None)
    best = 0
    for k in range(1, cap + 1):
        if best == 0 or rates[k] > rates[best]:  # strict: ties go to the smaller k
            best = k
    return best if best and rates[best] > config.min_gain * rates[0] else 0


def choose_batch_k(
    acceptances: Sequence[Sequence[float]],
    caps: Sequence[int],
    *,
    verify: VerifyCost,
    draft: DraftCost,
    rtt_s: float,
    pipelined: bool,
    config: PolicyConfig,
    draft_ahead_min_hit: float | None = None,
    speculating: bool = False,
) -> int:
    """One block length K for a micro-batch: request i drafts min(K, caps[i]) tokens.

    A round's cost is set by its longest block (the draft runs K steps for the batch, the
    target verifies K + 1 tokens for every request), so a shorter block for one request saves
    almost nothing while its acceptance is lost: the batch maximises
    Σ_i E_i(min(K, cap_i)) / round_time(K) over K in 0..min(max_k, max cap), 0 unless that
    beats target-only by config.min_gain (by config.stop_gain if the batch is ``speculating``
    already: hysteresis). Drafts made ahead by a lone micro-batch hide its next
    draft only when every request's are kept: h = Π_i draft_ahead_hit(α_i, k_i), if each
    request drafts ahead at all (hit >= draft_ahead_min_hit); see _round_s for the rest.
    Example (2 requests, verify 10 ms flat, draft 1 ms/step, rtt 0, unpipelined, caps 8):
    acceptances [0.9] and [0.1]; K = 1 gives (1.9 + 1.1) / 11 ms = 273 tok/s, K = 4 gives
    (4.10 + 1.11) / 14 ms = 372, K = 8 (the most, max_k 8) gives (6.13 + 1.11) / 18 ms = 402:
    K = 8 for both, though [0.1] alone would stop at k = 1.
    """
    if len(acceptances) != len(caps) or not caps:
        raise ValueError(f"need one cap per acceptance list, got {len(acceptances)} and {caps!r}")
    caps = [_check(f"caps[{i}]", cap, 0, integer=True) for i, cap in enumerate(caps)]
    rtt_s = _check("rtt_s", rtt_s, 0)
    min_hit = _min_hit(draft_ahead_min_hit)
    fold = min_hit is not None
    batch, top = len(caps), min(config.max_k, max(caps))
    values = [_acceptance(acceptance) for acceptance in acceptances]
    committed = [_committed_prefix(v, top) for v in values]
    hit_prefixes = [_hit_prefix(v, top) for v in values] if fold and not pipelined else []
    draft_s = draft._seconds(batch)
    rates = []
    for K in range(top + 1):
        ks = [min(K, cap) for cap in caps]
        total = math.fsum(c[k] for c, k in zip(committed, ks, strict=True))
        if K == 0:
            round_s = verify._seconds(batch, 1)
        else:
            hidden = 1.0 if pipelined else 0.0
            if hit_prefixes:  # a lone micro-batch drafting ahead
                hits = [h[k] for h, k in zip(hit_prefixes, ks, strict=True) if k]
                hidden = math.prod(hits) if min(hits) >= min_hit else 0.0
            round_s = _round_s(verify._seconds(batch, K + 1), rtt_s, K * draft_s, hidden, fold)
        rates.append(total / round_s if round_s > 0 else math.inf)
    best = 0
    for K in range(1, top + 1):
        if best == 0 or rates[K] > rates[best]:
            best = K
    threshold = config.stop_gain if speculating else config.min_gain
    return best if best and rates[best] > threshold * rates[0] else 0


def draft_ahead_hit(acceptance: Sequence[float], k: int) -> float:
    """Probability that drafts made ahead of a k-token block, before its verdict, are kept: all
    k accepted and the bonus token equal to the draft's own next guess (estimated by the next
    position's acceptance). E.g. acceptance [0.8, 0.5], k = 2: 0.8 * 0.5 * 0.5 = 0.2."""
    values = _acceptance(acceptance)
    k = _check("k", k, 0, integer=True)
    return _hit_prefix(values, k)[k]


def should_draft_ahead(acceptance: Sequence[float], k: int, min_hit: float) -> bool:
    """Draft ahead before the verdict only when those drafts are likely to be kept: drafting
    beside a verification is not free when draft and target share a host (measured here, two
    cores: a target forward took 58 ms with the draft computing beside it, 50 ms without),
    and a draft worker busy on a branch that will be dropped delays the next block."""
    return draft_ahead_hit(acceptance, k) >= _check("min_hit", min_hit, 0, 1)


def should_probe(
    rounds_since_speculation: int, config: PolicyConfig, failed_probes: int = 0
) -> bool:
    """A request at k = 0 yields no acceptance data, so it is re-measured periodically: after
    probe_every_rounds rounds, doubled for each probe in a row that did not bring speculation
    back (at most max_probe_backoff times). E.g. every 16 rounds, then 32, 64, 128, 256."""
    rounds = _check("rounds_since_speculation", rounds_since_speculation, 0, integer=True)
    failed = _check("failed_probes", failed_probes, 0, integer=True)
    return rounds >= config.probe_every_rounds << min(failed, config.max_probe_backoff)


def prefill_chunks(missing: Sequence[int], budget: int) -> list[int]:
    """Context tokens each request still to be prefilled on the target may prefill this
    round, in arrival order: first come, first served from ``budget`` tokens per round (0: no
    limit, every prompt whole). A long prompt then takes several rounds instead of stalling
    every decoding request behind it; a request granted 0 (budget spent) waits a round.
    E.g. missing [300, 50, 200], budget 256 -> [256, 0, 0]; next round [44, 50, 162]."""
    budget = _check("budget", budget, 0, integer=True)
    left = math.inf if budget == 0 else budget
    grants = []
    for index, count in enumerate(missing):
        count = _check(f"missing[{index}]", count, 0, integer=True)
        grant = int(min(count, left))
        grants.append(grant)
        left -= grant
    return grants


class AcceptanceEstimator:
    """Running per-position acceptance for one request from decayed (reached, accepted) counts.

    Position j's Beta prior is centred on the request's pooled estimate (itself shrunk toward
    prior_alpha with prior_weight pseudo-observations): late positions are reached rarely, and
    the request's overall acceptance is a better guess for them than a fixed constant.
    Example, fresh estimator, update(4, 2): reached [1, 1, 1], accepted [1, 1, 0];
    pooled = (2 + 2*0.5) / (3 + 2) = 0.6; α_1 = α_2 = (1 + 2*0.6) / 3 = 0.733,
    α_3 = (0 + 1.2) / 3 = 0.4, α_4 (never reached) = pooled = 0.6.
    """

    def __init__(self, prior_alpha: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9):
        self.prior_alpha = float(_check("prior_alpha", prior_alpha, 0, 1))
        self.prior_weight = float(_check("prior_weight", prior_weight, -math.inf))
        self.decay = float(_check("decay", decay, -math.inf))
        if self.prior_weight <= 0:  # the prior is what answers before any data
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        if not 0 < self.decay <= 1:  # 0 would forget everything each round, > 1 amplify the past
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self._reached: list[float] = []
        self._accepted: list[float] = []
        # Estimates only change in update(); acceptance() is called every round, so cache them.
        self._alphas: list[float] | None = None  # one per tracked position
        self._pooled = self.prior_alpha
        self._last: tuple[int, list[float]] | None = None  # (max_k, answer) of the last call

    def update(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record a verified block; update(0, 0) is a no-op."""
        drafted = _check("num_draft_tokens", num_draft_tokens, 0, integer=True)
        accepted = _check("num_accepted", num_accepted, 0, drafted, integer=True)
        if drafted == 0:
            return
        reached = min(accepted + 1, drafted)  # the first rejected position was reached too
        grow = [0.0] * (reached - len(self._reached))
        self._reached = [c * self.decay + (j < reached) for j, c in enumerate(self._reached + grow)]
        self._accepted = [
            c * self.decay + (j < accepted) for j, c in enumerate(self._accepted + grow)
        ]
        self._alphas = self._last = None

    def acceptance(self, max_k: int) -> list[float]:
        """α_1..α_max_k (a new list each call)."""
        last = self._last
        if last is not None and type(max_k) is int and last[0] == max_k:
            return last[1][:]
        max_k = _check("max_k", max_k, 0, integer=True)
        if self._alphas is None:
            weight = self.prior_weight
            pooled = (sum(self._accepted) + weight * self.prior_alpha) / (
                sum(self._reached) + weight
            )
            self._alphas = [
                (accepted + weight * pooled) / (reached + weight)
                for accepted, reached in zip(self._accepted, self._reached, strict=True)
            ]
            self._pooled = pooled
        alphas = self._alphas[:max_k]
        alphas += [self._pooled] * (max_k - len(alphas))
        self._last = (max_k, alphas)
        return alphas[:]


NEUTRAL_PRIOR = 0.5  # a new request's acceptance prior when the group's is lower
REQUEST_PRIOR_WEIGHT = 4.0  # pseudo-observations of that prior in a request's own estimate


def new_request_estimator(group: AcceptanceEstimator) -> AcceptanceEstimator:
    """A new request starts from the ``group``'s recent acceptance when that beats a neutral
    guess, never below it: badly drafted requests must not talk a new one out of its chance
    (its first probe, :func:`~specray.engine_core.block_length.policy_ks`)."""
    group_alpha = group.acceptance(1)[0]
    return AcceptanceEstimator(
        prior_alpha=min(max(group_alpha, NEUTRAL_PRIOR), 0.95),
        prior_weight=REQUEST_PRIOR_WEIGHT,
    )
