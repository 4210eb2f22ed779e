"""Do a cluster's node types satisfy the placement rules the application asks for?

The application asks for (see ``specray.serve.app`` and ``specray.cluster.placement``):

- per target group, one STRICT_PACK placement group on ONE node: a bundle for the TargetWorker
  replica (``REPLICA_CPUS_DEFAULT`` CPU) plus ``tp_size`` bundles of
  ``{CPU: target_num_cpus, <target_resource>: 1, GPU: target_num_gpus}``;
- per draft worker, an actor with ``{CPU: draft_num_cpus, <draft_resource>: 1,
  GPU: draft_num_gpus}`` and its Serve replica (``REPLICA_CPUS_DEFAULT`` CPU and a sliver of
  the draft resource, so it lands on a draft node too);
- the Coordinator and Ingress replicas need only a little CPU anywhere.

Cluster configs (``ray up`` YAMLs, the Helm chart's worker groups) declare node types with
their resources and worker counts; :func:`placement_problems` says, in words, what would not
fit — an empty list means every replica the app starts at its largest size can be placed.
Pure functions: the tests run them on the shipped configs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: Mapping[str, float]  # what one node advertises to Ray: CPU, GPU, custom
    max_nodes: int  # how many nodes of this type the cluster may have
    is_head: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes of node type {self.name!r} must be >= 0")


@dataclass(frozen=True)
class PlacementAsk:
    """What the application asks, taken from its arguments (``AppArgs``)."""

    tp_size: int
    num_target_groups: int
    max_drafts: int  # draft workers at the autoscaling ceiling, all groups together
    draft_resource: str
    target_resource: str
    draft_num_cpus: float
    target_num_cpus: float
    draft_num_gpus: float
    target_num_gpus: float
    replica_cpus: float

    @classmethod
    def from_app_args(cls, args) -> PlacementAsk:
        """``args``: ``specray.serve.config.AppArgs`` (or a mapping of its fields)."""
        from specray.serve.config import REPLICA_CPUS_DEFAULT, AppArgs

        if not isinstance(args, AppArgs):
            args = AppArgs(**dict(args))
        per_group = args.max_draft_workers or args.num_draft_workers
        return cls(
            tp_size=args.tp_size,
            num_target_groups=args.num_target_groups,
            max_drafts=0 if not args.draft_pool else per_group * args.num_target_groups,
            draft_resource=args.draft_resource,
            target_resource=args.target_resource,
            draft_num_cpus=args.draft_num_cpus,
            target_num_cpus=args.target_num_cpus,
            draft_num_gpus=args.draft_num_gpus,
            target_num_gpus=args.target_num_gpus,
            replica_cpus=REPLICA_CPUS_DEFAULT,
        )

    def _placement(self):
        from specray.cluster.placement import PlacementConfig

        return PlacementConfig(
            draft_resource=self.draft_resource,
            target_resource=self.target_resource,
            draft_num_cpus=self.draft_num_cpus,
            target_num_cpus=self.target_num_cpus,
            draft_num_gpus=self.draft_num_gpus,
            target_num_gpus=self.target_num_gpus,
        )

    def target_group_needs(self) -> dict[str, float]:
        """One target group's placement group, summed (it must fit on one node): the same
        bundles the app asks for (``PlacementConfig.target_bundles``) plus the replica's."""
        return _summed(
            [{"CPU": self.replica_cpus}, *self._placement().target_bundles(self.tp_size)]
        )

    def draft_worker_needs(self) -> dict[str, float]:
        """One draft worker: its actor (``PlacementConfig.draft_options``) and its replica,
        both on a draft node."""
        from specray.serve.config import REPLICA_SLIVER

        options = self._placement().draft_options()
        actor = {"CPU": options["num_cpus"], **options["resources"]}
        if "num_gpus" in options:
            actor["GPU"] = options["num_gpus"]
        replica = {"CPU": self.replica_cpus, self.draft_resource: REPLICA_SLIVER}
        return _summed([actor, replica])


def _summed(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + float(amount)
    return total


def fits(node: Mapping[str, float], needs: Mapping[str, float]) -> int:
    """How many copies of ``needs`` one node holds (0 if a resource is missing)."""
    counts = []
    for name, amount in needs.items():
        if amount <= 0:
            continue
        have = float(node.get(name, 0.0))
        counts.append(math.floor(have / amount + 1e-9))
    return min(counts) if counts else 0


def placement_problems(ask: PlacementAsk, node_types: Sequence[NodeType]) -> list[str]:
    """Everything that keeps the app (at its largest size) from being placed; [] if none."""
    problems: list[str] = []
    heads = [t for t in node_types if t.is_head]
    if len(heads) != 1:
        problems.append(f"expected exactly one head node type, found {len(heads)}")
    for head in heads:
        for name in (ask.draft_resource, ask.target_resource, "GPU"):
            if head.resources.get(name, 0):
                problems.append(
                    f"head node type {head.name!r} advertises {name!r}: GPU work must stay "
                    "off the head (it runs the GCS, the dashboard and Serve's controller)"
                )

    group = ask.target_group_needs()
    workers = [t for t in node_types if not t.is_head]  # the head's own problem is above
    target_types = [t for t in workers if t.resources.get(ask.target_resource, 0)]
    if not target_types:
        problems.append(f"no node type advertises the target resource {ask.target_resource!r}")
    groups_capacity = sum(fits(t.resources, group) * t.max_nodes for t in target_types)
    for t in target_types:
        if fits(t.resources, group) == 0:
            problems.append(
                f"node type {t.name!r} advertises {ask.target_resource!r} but cannot hold one "
                f"target group (tp_size={ask.tp_size}): needs {_show(group)}, "
                f"has {_show(t.resources)}"
            )
    if target_types and groups_capacity < ask.num_target_groups:
        problems.append(
            f"room for {groups_capacity} target group(s), the app asks for "
            f"num_target_groups={ask.num_target_groups}"
        )

    if ask.max_drafts:
        draft = ask.draft_worker_needs()
        draft_types = [t for t in workers if t.resources.get(ask.draft_resource, 0)]
        if not draft_types:
            problems.append(f"no node type advertises the draft resource {ask.draft_resource!r}")
        for t in draft_types:
            if fits(t.resources, draft) == 0:
                problems.append(
                    f"node type {t.name!r} advertises {ask.draft_resource!r} but cannot hold "
                    f"one draft worker: needs {_show(draft)}, has {_show(t.resources)}"
                )
        drafts_capacity = sum(fits(t.resources, draft) * t.max_nodes for t in draft_types)
        if draft_types and drafts_capacity < ask.max_drafts:
            problems.append(
                f"room for {drafts_capacity} draft worker(s), the app may scale to "
                f"{ask.max_drafts} (max_draft_workers x num_target_groups)"
            )
    return problems


def _show(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def from_ray_up(config: Mapping) -> list[NodeType]:
    """Node types of a ``ray up`` cluster config (``available_node_types``); a worker type
    without its own ``max_workers`` is bounded by the cluster's (Ray's default: 2)."""
    head = config.get("head_node_type")
    cluster_max = int(config.get("max_workers", 2))
    types = []
    for name, spec in (config.get("available_node_types") or {}).items():
        is_head = name == head
        types.append(
            NodeType(
                name=name,
                resources={k: float(v) for k, v in (spec.get("resources") or {}).items()},
                max_nodes=1 if is_head else int(spec.get("max_workers", cluster_max)),
                is_head=is_head,
                labels=dict(spec.get("labels") or {}),
            )
        )
    return types
