"""Placement by node type: draft workers on draft nodes, each target TP group packed on one
target node. Node types are Ray custom resources whose names are configurable."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from specray.data import measured_drafts_file
from specray.distill import is_distilled_draft
from specray.models.device import check_device_spec


@dataclass(frozen=True)
class PlacementConfig:
    draft_resource: str = "draft"  # custom resource advertised by draft (cheap GPU) nodes
    target_resource: str = "target"  # custom resource advertised by target (large GPU) nodes
    draft_num_cpus: float = 0.5  # per draft worker
    target_num_cpus: float = 0.5  # per TP rank
    # GPUs per draft worker / per TP rank: 0 on CPU-only clusters; on GPU node types 1 per TP
    # rank (a fraction lets several small drafts share one GPU).
    draft_num_gpus: float = 0.0
    target_num_gpus: float = 0.0
    num_threads: int = 1  # torch threads per worker
    # Where workers run their models (specray/models/device.py): "auto" takes the GPUs Ray
    # gives a worker (the *_num_gpus above), else the CPU; "cuda" requires them.
    device: str = "auto"
    # Targets compute each token's logits bitwise the same whatever else a forward holds
    # (specray/models/batch_invariant.py): the same log-probabilities with and without
    # speculation and in any batch; costs time.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        if self.device.startswith("cuda") and not (self.target_num_gpus and self.draft_num_gpus):
            raise ValueError(
                f"device={self.device!r} needs GPUs for every worker: target_num_gpus and "
                f"draft_num_gpus must be > 0, got {self.target_num_gpus!r} and "
                f"{self.draft_num_gpus!r}"
            )
        for name in ("draft_resource", "target_resource"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("draft_num_cpus", "target_num_cpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name in ("draft_num_gpus", "target_num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.target_num_gpus > 1 and self.target_num_gpus != int(self.target_num_gpus):
            raise ValueError(
                f"target_num_gpus above 1 must be a whole number, got {self.target_num_gpus!r}"
            )
        if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int):
            raise ValueError(f"num_threads must be an integer, got {self.num_threads!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be true or false, got {self.batch_invariant!r}")

    @classmethod
    def from_dict(cls, values: dict) -> PlacementConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown placement option {unknown[0]!r}")
        return cls(**values)

    def target_bundles(self, tp_size: int) -> list[dict[str, float]]:
        """One bundle per TP rank; STRICT_PACK keeps the group on one target node."""
        bundle = {"CPU": self.target_num_cpus, self.target_resource: 1.0}
        if self.target_num_gpus:
            bundle["GPU"] = self.target_num_gpus
        return [bundle] * tp_size

    def target_rank_options(self) -> dict:
        """Ray actor options of one TP rank (placed in its own bundle of target_bundles)."""
        options = {"num_cpus": self.target_num_cpus, "resources": {self.target_resource: 1.0}}
        if self.target_num_gpus:
            options["num_gpus"] = self.target_num_gpus
        return options

    def draft_options(self) -> dict:
        options = {"num_cpus": self.draft_num_cpus, "resources": {self.draft_resource: 1.0}}
        if self.draft_num_gpus:
            options["num_gpus"] = self.draft_num_gpus
        return options


# Where a draft runs (AppArgs.draft_placement, Engine's and DistributedBackend's):
# "workers": draft actors on draft nodes, each on its own stream to the engine core;
# "colocated": one draft inside the target group's rank 0 (TargetWorker.colocate_draft);
# "auto": colocated for a draft that is small beside its target, workers for the others.
DRAFT_PLACEMENTS = ("auto", "workers", "colocated")


def check_draft_placement(placement: str) -> None:
    """A ValueError naming the parameter unless ``placement`` is one of
    :data:`DRAFT_PLACEMENTS`."""
    if placement not in DRAFT_PLACEMENTS:
        raise ValueError(
            f"draft_placement must be one of {list(DRAFT_PLACEMENTS)}, got {placement!r}"
        )


def resolve_draft_placement(
    placement: str, draft: str | None, target: str, *, pool_sized: bool = False
) -> str:
    """``"workers"`` or ``"colocated"`` for ``placement`` (one of :data:`DRAFT_PLACEMENTS`).

    ``"auto"`` colocates a draft that costs the target's device little and has nothing to gain
    from a device of its own at one request: prompt lookup, the distilled draft shipped for the
    default target, a ``specray distill`` output, and ``ngram+`` any of these (``"default"``
    / ``"auto"`` drafts count as what they resolve to for ``target``). Every other draft (the
    target's own weights, another model) goes to workers, where drafting runs beside
    verification on other devices; so does any draft whose pool was sized (``pool_sized``:
    more than one worker, or an autoscaling ceiling). A colocated draft needs no network hop
    per round; docs/design.md, section 2."""
    check_draft_placement(placement)
    if placement != "auto":
        return placement
    if draft is None or pool_sized:
        return "workers"
    return "colocated" if all(map(_small_draft, _draft_parts(draft, target))) else "workers"


def _draft_parts(draft: str, target: str) -> list[str]:
    """A draft name's proposal sources, "default" / "auto" read as the winner recorded for the
    target (specray/data/drafters.json; the fallback, the target's own weights, for a target
    never measured: not small). Files and names only: the Serve controller builds the app
    without torch."""
    if draft in {"default", "auto"}:
        record = json.loads(measured_drafts_file().read_text())
        if target == record["target"]:
            draft = record["winner"]["draft"]
    return draft.split("+")


def _small_draft(part: str) -> bool:
    if part == "ngram" or part.split(":")[0] == "distilled":
        return True
    try:  # a `specray distill` output: a few layers by design
        return is_distilled_draft(part)
    except OSError:
        return False
