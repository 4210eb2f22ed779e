"""What a simulation is told: latency, acceptance, workload and coordinator settings.

All configs are frozen dataclasses validated on construction; :func:`load_sim_config` reads one
from YAML or JSON, rejecting unknown keys and naming the offending parameter (with its path,
e.g. ``latency.verify.fixed_s``) and value. Example file: ``specray/sim/configs/*.yaml``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specray.engine_core.coordinator import CoordinatorConfig
from specray.engine_core.policy import DraftCost, PolicyConfig, VerifyCost
from specray.sim.traces import acceptance_from_traces

DEFAULT_COORDINATOR_OVERHEAD_S = 0.0015  # one Ray actor call, measured at ≈1.4 ms on this host
DEFAULT_REQUESTS_PER_CLIENT = 4  # workload.num_requests default: this many per client
DEFAULT_BYTES_PER_TOKEN = 600  # one drafted token and its encoded q row on the wire (top-M)
SWEEP_FIELDS = (
    "concurrency",
    "rtt_s",
    "num_draft_workers",
    "num_speculative_tokens",
    "num_micro_batches",
    "draft_ahead",
    "max_running",
)
_COORDINATOR_SWEEP_FIELDS = {"num_speculative_tokens", "num_micro_batches", "draft_ahead"}
_COORDINATOR_SWEEP_FIELDS |= {"max_running"}


class SimConfigError(ValueError):
    """An invalid simulation config; the message names the parameter (with its path)."""


def _number(name: str, value: Any, low: float = 0.0, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SimConfigError(f"{name} must be a finite number, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise SimConfigError(f"{name} must be {bounds}, got {value!r}")
    return float(value)


def _integer(name: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SimConfigError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise SimConfigError(f"{name} must be >= {low}, got {value!r}")
    return value


def _cost(name: str, cls: type, value: Any):
    """A VerifyCost / DraftCost from itself or a mapping, errors prefixed with ``name``."""
    if isinstance(value, cls):
        return value
    data = _mapping(name, value, {f.name for f in fields(cls)})
    coefficients = [f.name for f in fields(cls) if f.default is MISSING]  # the line's
    if "table" not in data:  # a line needs every coefficient; a measured table needs none
        missing = [key for key in coefficients if key not in data]
        if missing:
            raise SimConfigError(f"{name} is missing {missing[0]!r}")
    data = dict.fromkeys(coefficients, 0.0) | data
    try:
        return cls(**data)
    except ValueError as error:
        raise SimConfigError(f"{name}.{error}") from None


def _mapping(name: str, value: Any, known: set[str], *, required: bool = False) -> dict:
    if not isinstance(value, Mapping):
        raise SimConfigError(f"{name} must be a mapping, got {value!r}")
    for key in value:
        if key not in known:
            raise SimConfigError(
                f"unknown key {key!r} in {name} (known: {', '.join(sorted(known))})"
            )
    if required:
        missing = sorted(known - set(value))
        if missing:
            raise SimConfigError(f"{name} is missing {', '.join(map(repr, missing))}")
    return dict(value)


@dataclass(frozen=True)
class LatencyModel:
    """Where simulated time goes.

    verify: one target-group forward + verification, ``verify.seconds(batch, tokens)`` with
        tokens = 1 + the longest draft block of the batch.
    draft_step: one draft worker's forward for ``batch`` requests (one token each).
    rtt_s: network round trip. A draft block reaches the target rtt_s / 2 after it is drafted,
        a verdict reaches the draft rtt_s / 2 after verification; every coordinator -> worker
        call takes rtt_s (half each way) plus coordinator_overhead_s on the way in.
    coordinator_overhead_s: per call and round: actor-call dispatch and serialisation.
    bytes_per_token: wire bytes per drafted token (the block with its q rows).
    prefill_per_token_s / draft_prefill_per_token_s: prompt processing when a worker first sees
        a request (0 = ignore prefill), charged inside that worker's call.
    """

    verify: VerifyCost
    draft_step: DraftCost
    rtt_s: float = 0.002
    coordinator_overhead_s: float = DEFAULT_COORDINATOR_OVERHEAD_S
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    prefill_per_token_s: float = 0.0
    draft_prefill_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify", _cost("latency.verify", VerifyCost, self.verify))
        draft = _cost("latency.draft_step", DraftCost, self.draft_step)
        object.__setattr__(self, "draft_step", draft)
        for name in (
            "rtt_s",
            "coordinator_overhead_s",
            "prefill_per_token_s",
            "draft_prefill_per_token_s",
        ):
            object.__setattr__(self, name, _number(f"latency.{name}", getattr(self, name)))
        _integer("latency.bytes_per_token", self.bytes_per_token)


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-position conditional acceptance: α_j = P(draft token j accepted | 1..j-1 accepted).

    Positions beyond ``per_position`` reuse its last value. ``bonus_match`` is the probability
    that the draft's own next token equals the target's bonus token after a fully accepted
    block (what decides whether drafts made ahead are kept); default: the last α.

    ``traces`` (see :mod:`specray.sim.traces`), when given, replace the draws: request i
    replays ``traces[i % len(traces)]``, a round at position t with k drafts accepting
    min(trace[t], k); ``per_position`` then only informs the coordinator's priors.
    """

    per_position: tuple[float, ...]
    bonus_match: float | None = None
    traces: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        values = self.per_position
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
            raise SimConfigError(
                f"acceptance.per_position must be a non-empty list of numbers, got {values!r}"
            )
        alphas = tuple(
            _number(f"acceptance.per_position[{i}]", v, 0, 1) for i, v in enumerate(values)
        )
        object.__setattr__(self, "per_position", alphas)
        bonus = alphas[-1] if self.bonus_match is None else self.bonus_match
        object.__setattr__(self, "bonus_match", _number("acceptance.bonus_match", bonus, 0, 1))
        object.__setattr__(self, "traces", _traces(self.traces))

    def trace(self, index: int) -> tuple[int, ...] | None:
        """Request ``index``'s trace (None without traces)."""
        return self.traces[index % len(self.traces)] if self.traces else None

    def alpha(self, position: int) -> float:
        """α at 1-based ``position``."""
        return self.per_position[min(position, len(self.per_position)) - 1]

    def sample_accepted(self, rng: random.Random, num_draft: int) -> int:
        """Accepted prefix length of a block of ``num_draft`` tokens."""
        accepted = 0
        while accepted < num_draft and rng.random() < self.alpha(accepted + 1):
            accepted += 1
        return accepted

    def expected_accepted(self, k: int) -> float:
        total, reach = 0.0, 1.0
        for j in range(1, k + 1):
            reach *= self.alpha(j)
            total += reach
        return total

    @staticmethod
    def from_metrics(metrics: Any, bonus_match: float | None = None) -> AcceptanceModel:
        """From a :class:`specray.outputs.SpecDecodeMetrics` or its ``to_dict()``."""
        if isinstance(metrics, Mapping):
            num_drafts, per_position = metrics["num_drafts"], metrics["accepted_per_position"]
        else:
            num_drafts, per_position = metrics.num_drafts, metrics.accepted_per_position
        return AcceptanceModel(
            tuple(acceptance_from_metrics(per_position, num_drafts)), bonus_match
        )


def _traces(value: Any) -> tuple[tuple[int, ...], ...]:
    """Validated traces: lists of accepted-run lengths, integers >= 0."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise SimConfigError(f"acceptance.traces must be a list of lists, got {value!r}")
    traces = []
    for i, trace in enumerate(value):
        if isinstance(trace, str | bytes) or not isinstance(trace, Sequence) or not trace:
            raise SimConfigError(
                f"acceptance.traces[{i}] must be a non-empty list of integers, got {trace!r}"
            )
        traces.append(
            tuple(_integer(f"acceptance.traces[{i}][{t}]", m) for t, m in enumerate(trace))
        )
    return tuple(traces)


def acceptance_from_metrics(
    accepted_per_position: Sequence[int],
    num_drafts: int,
    num_speculative_tokens: int | None = None,
) -> list[float]:
    """Conditional α_j from vLLM-style counters recorded by a real run
    (:class:`specray.outputs.SpecDecodeMetrics`: ``num_drafts`` rounds with drafts,
    ``accepted_per_position[j]`` = rounds whose draft token j+1 was accepted):
    α_1 = acc[0] / num_drafts, α_j = acc[j-1] / acc[j-2], each clamped to [0, 1].

    Assumption: every round drafted at least j tokens. Rounds with shorter blocks (adaptive k,
    the max_tokens cap) never reached position j but are still counted in the denominator, so
    the later α_j come out too low. Positions past the first one no round accepted are not
    identifiable and are left out (the model reuses the last value, 0 there). With
    ``num_speculative_tokens`` the list is cut or padded (last value) to that length.
    E.g. acc [80, 60, 30] over 100 drafts: [0.8, 0.75, 0.5].
    """
    num_drafts = _integer("num_drafts", num_drafts, 1)
    counts = [
        _integer(f"accepted_per_position[{i}]", c) for i, c in enumerate(accepted_per_position)
    ]
    alphas: list[float] = []
    previous = num_drafts
    for count in counts:
        alphas.append(min(max(count / previous, 0.0), 1.0))
        if count == 0:
            break
        previous = count
    alphas = alphas or [0.0]
    if num_speculative_tokens is not None:
        size = _integer("num_speculative_tokens", num_speculative_tokens, 1)
        alphas = (alphas + [alphas[-1]] * size)[:size]
    return alphas


@dataclass(frozen=True)
class Workload:
    """Closed loop: ``concurrency`` clients, each submitting its next request when its previous
    one finishes, until ``num_requests`` were submitted in all (default: 4 per client, so a
    concurrency sweep keeps the same shape; see :meth:`total_requests`)."""

    concurrency: int = 8
    num_requests: int | None = None
    prompt_tokens: int = 128
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (
            ("concurrency", 1),
            ("prompt_tokens", 1),
            ("max_tokens", 1),
            ("seed", 0),
        ):
            _integer(f"workload.{name}", getattr(self, name), low)
        if self.num_requests is not None:
            _integer("workload.num_requests", self.num_requests, 1)

    @property
    def total_requests(self) -> int:
        if self.num_requests is not None:
            return self.num_requests
        return DEFAULT_REQUESTS_PER_CLIENT * self.concurrency


def coordinator_config(overrides: Mapping[str, Any]) -> CoordinatorConfig:
    """A CoordinatorConfig from plain overrides (nested policy / priors as mappings)."""
    known = {f.name for f in fields(CoordinatorConfig)}
    data = _mapping("coordinator", overrides, known)
    if isinstance(data.get("policy"), Mapping):
        policy = _mapping(
            "coordinator.policy", data["policy"], {f.name for f in fields(PolicyConfig)}
        )
        data["policy"] = PolicyConfig(**policy)
    if "verify_prior" in data:
        data["verify_prior"] = _cost("coordinator.verify_prior", VerifyCost, data["verify_prior"])
    if "draft_prior" in data:
        data["draft_prior"] = _cost("coordinator.draft_prior", DraftCost, data["draft_prior"])
    try:
        return CoordinatorConfig(**data)
    except (ValueError, TypeError) as error:
        raise SimConfigError(f"coordinator.{error}") from None


@dataclass(frozen=True)
class SimConfig:
    """One simulation: a base point and an optional sweep (field -> values; the cartesian
    product over the fields, in the order given, is simulated).

    ``coordinator`` holds CoordinatorConfig overrides. Unless it sets ``max_queue`` the
    simulator admits the whole closed-loop population (max_queue = concurrency).
    """

    latency: LatencyModel
    acceptance: AcceptanceModel
    workload: Workload = field(default_factory=Workload)
    coordinator: Mapping[str, Any] = field(default_factory=dict)
    num_draft_workers: int = 1
    sweep: Mapping[str, tuple] = field(default_factory=dict)
    name: str = "sim"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SimConfigError(f"name must be a non-empty string, got {self.name!r}")
        for attr, cls in (
            ("latency", LatencyModel),
            ("acceptance", AcceptanceModel),
            ("workload", Workload),
        ):
            if not isinstance(getattr(self, attr), cls):
                raise SimConfigError(
                    f"{attr} must be a {cls.__name__}, got {getattr(self, attr)!r}"
                )
        _integer("num_draft_workers", self.num_draft_workers, 1)
        object.__setattr__(self, "coordinator", dict(self.coordinator))
        self.coordinator_config()  # validates the overrides
        sweep = _mapping("sweep", self.sweep, set(SWEEP_FIELDS))
        for key, values in sweep.items():
            if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
                raise SimConfigError(f"sweep.{key} must be a non-empty list, got {values!r}")
            sweep[key] = tuple(values)
        object.__setattr__(self, "sweep", sweep)
        if sweep:
            for point in self.points():  # every point must be a valid config
                self.at(point)

    def coordinator_config(self, **overrides: Any) -> CoordinatorConfig:
        return coordinator_config({**self.coordinator, **overrides})

    def points(self) -> list[dict[str, Any]]:
        """The sweep's points (one empty point without a sweep)."""
        keys = list(self.sweep)
        return [
            dict(zip(keys, values, strict=True))
            for values in itertools.product(*self.sweep.values())
        ]

    def at(self, point: Mapping[str, Any]) -> SimConfig:
        """This config with one sweep point's values applied, and no sweep."""
        coordinator = dict(self.coordinator)
        latency, workload, drafts = self.latency, self.workload, self.num_draft_workers
        for key, value in point.items():
            name = f"sweep.{key}"
            if key == "concurrency":
                workload = replace(workload, concurrency=_integer(name, value, 1))
            elif key == "rtt_s":
                latency = replace(latency, rtt_s=_number(name, value))
            elif key == "num_draft_workers":
                drafts = _integer(name, value, 1)
            elif key in _COORDINATOR_SWEEP_FIELDS:
                coordinator[key] = value
            else:
                raise SimConfigError(
                    f"unknown sweep field {key!r} (known: {', '.join(SWEEP_FIELDS)})"
                )
        try:
            coordinator_config(coordinator)
        except SimConfigError as error:
            raise SimConfigError(f"sweep point {dict(point)}: {error}") from None
        return replace(
            self,
            latency=latency,
            workload=workload,
            coordinator=coordinator,
            num_draft_workers=drafts,
            sweep={},
        )


def sim_config_from_dict(data: Mapping[str, Any]) -> SimConfig:
    """Build a SimConfig from plain data (a parsed YAML / JSON document)."""
    top = _mapping(
        "config",
        data,
        {"name", "latency", "acceptance", "workload", "coordinator", "num_draft_workers", "sweep"},
    )
    for key in ("latency", "acceptance"):
        if key not in top:
            raise SimConfigError(f"config is missing {key!r}")
    latency_known = {f.name for f in fields(LatencyModel)}
    latency = _mapping("latency", top["latency"], latency_known)
    for key in ("verify", "draft_step"):
        if key not in latency:
            raise SimConfigError(f"latency is missing {key!r}")
    acceptance = _mapping(
        "acceptance", top["acceptance"], {"per_position", "bonus_match", "from_metrics", "traces"}
    )
    sources = [key for key in ("per_position", "from_metrics", "traces") if key in acceptance]
    if len(sources) != 1:
        raise SimConfigError(
            "acceptance needs exactly one of 'per_position', 'from_metrics' or 'traces', "
            f"got {sources or 'none'}"
        )
    if "traces" in acceptance:
        traces = _traces(acceptance["traces"])
        if not traces:
            raise SimConfigError("acceptance.traces must not be empty")
        acceptance["traces"] = traces
        acceptance["per_position"] = acceptance_from_traces(traces)
    if "from_metrics" in acceptance:
        metrics_keys = {
            "num_drafts",
            "accepted_per_position",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_target_steps",
            "acceptance_rate",
            "mean_acceptance_length",
        }
        metrics = _mapping("acceptance.from_metrics", acceptance.pop("from_metrics"), metrics_keys)
        for key in ("num_drafts", "accepted_per_position"):
            if key not in metrics:
                raise SimConfigError(f"acceptance.from_metrics is missing {key!r}")
        try:
            acceptance["per_position"] = acceptance_from_metrics(
                metrics["accepted_per_position"], metrics["num_drafts"]
            )
        except SimConfigError as error:
            raise SimConfigError(f"acceptance.from_metrics.{error}") from None
    workload = _mapping("workload", top.get("workload", {}), {f.name for f in fields(Workload)})
    return SimConfig(
        name=top.get("name", "sim"),
        latency=LatencyModel(**latency),
        acceptance=AcceptanceModel(**acceptance),
        workload=Workload(**workload),
        coordinator=_mapping(
            "coordinator", top.get("coordinator") or {}, {f.name for f in fields(CoordinatorConfig)}
        ),
        num_draft_workers=top.get("num_draft_workers", 1),
        sweep=top.get("sweep") or {},
    )


def load_sim_config(path: str | Path) -> SimConfig:
    """Read a SimConfig from a ``.yaml`` / ``.yml`` or ``.json`` file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise SimConfigError(f"cannot read simulation config {str(path)!r}: {error}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise SimConfigError(f"{path}: invalid JSON: {error}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise SimConfigError(f"{path}: invalid YAML: {error}") from None
    if data is None:
        raise SimConfigError(f"{path}: the config is empty")
    try:
        return sim_config_from_dict(data)
    except SimConfigError as error:
        raise SimConfigError(f"{path}: {error}") from None
