"""specray.ops.node_types: does a cluster's set of node types hold the app at its largest?
Pure functions on hand-made node types; every "does not fit" case sits one unit short of a
case that fits."""

from __future__ import annotations

import pytest

from specray.ops.node_types import (
    NodeType,
    PlacementAsk,
    fits,
    from_ray_up,
    placement_problems,
)
from specray.serve.config import REPLICA_CPUS_DEFAULT, REPLICA_SLIVER, AppArgs

HEAD = NodeType("head", {"CPU": 0}, max_nodes=1, is_head=True)


def ask(**overrides) -> PlacementAsk:
    """One TP-8 group on H100s, a draft pool of up to 4 workers with one GPU each."""
    values = dict(
        tp_size=8,
        num_target_groups=1,
        max_drafts=4,
        draft_resource="draft",
        target_resource="target",
        draft_num_cpus=1.0,
        target_num_cpus=2.0,
        draft_num_gpus=1.0,
        target_num_gpus=1.0,
        replica_cpus=REPLICA_CPUS_DEFAULT,
    )
    return PlacementAsk(**{**values, **overrides})


def target_node(gpus: int = 8, *, target: float | None = None, max_nodes: int = 1, cpus=64):
    resources = {"CPU": cpus, "GPU": gpus, "target": gpus if target is None else target}
    return NodeType(f"target{gpus}", resources, max_nodes=max_nodes)


def draft_node(*, draft=2, gpus=1, cpus=4, max_nodes=4, name="draft") -> NodeType:
    return NodeType(name, {"CPU": cpus, "GPU": gpus, "draft": draft}, max_nodes=max_nodes)


# ---- fits ---------------------------------------------------------------------------------------
def test_fits_counts_whole_copies_and_the_scarcest_resource_decides():
    assert fits({"CPU": 8, "GPU": 2}, {"CPU": 2, "GPU": 1}) == 2  # GPU-bound
    assert fits({"CPU": 3, "GPU": 8}, {"CPU": 2, "GPU": 1}) == 1  # CPU-bound
    assert fits({"CPU": 8}, {"CPU": 2, "GPU": 1}) == 0  # a missing resource holds none
    assert fits({"CPU": 0.3}, {"CPU": 0.1}) == 3  # 0.3 / 0.1 = 2.999...: rounding forgiven
    assert fits({"CPU": 8}, {"CPU": 2, "GPU": 0}) == 4  # zero asks are no asks
    assert fits({"CPU": 8}, {}) == 0  # nothing asked: nothing to count


# ---- what the app asks --------------------------------------------------------------------------
def test_ask_from_app_args_multiplies_the_draft_ceiling_by_the_groups():
    args = AppArgs(
        tp_size=8,
        num_target_groups=2,
        num_draft_workers=2,
        max_draft_workers=5,
        target_num_gpus=1,
        draft_num_gpus=0.5,
    )
    placement = PlacementAsk.from_app_args(args)
    assert (placement.tp_size, placement.num_target_groups, placement.max_drafts) == (8, 2, 10)
    assert (placement.target_num_gpus, placement.draft_num_gpus) == (1.0, 0.5)
    assert PlacementAsk.from_app_args(args.model_dump()) == placement  # a mapping works too
    fixed = PlacementAsk.from_app_args(AppArgs(num_draft_workers=3))  # no ceiling: the floor
    assert fixed.max_drafts == 3
    assert PlacementAsk.from_app_args(AppArgs(draft="none")).max_drafts == 0


def test_target_group_needs_sum_the_replica_bundle_and_the_tp_ranks():
    assert ask().target_group_needs() == {
        "CPU": REPLICA_CPUS_DEFAULT + 8 * 2.0,
        "target": 8.0,
        "GPU": 8.0,
    }
    assert "GPU" not in ask(target_num_gpus=0.0).target_group_needs()  # CPU-only targets


def test_draft_worker_needs_hold_its_actor_and_its_replica():
    assert ask().draft_worker_needs() == {
        "CPU": 1.0 + REPLICA_CPUS_DEFAULT,
        "draft": 1.0 + REPLICA_SLIVER,
        "GPU": 1.0,
    }
    assert "GPU" not in ask(draft_num_gpus=0.0).draft_worker_needs()


# ---- placement_problems -------------------------------------------------------------------------
def test_a_cluster_that_holds_everything_has_no_problems():
    assert placement_problems(ask(), [HEAD, target_node(), draft_node()]) == []


def test_tp8_with_gpus_needs_eight_gpus_on_one_node_and_seven_is_one_short():
    eight, seven = target_node(8), target_node(7, target=8)
    assert placement_problems(ask(), [HEAD, eight, draft_node()]) == []
    problems = placement_problems(ask(), [HEAD, seven, draft_node()])
    assert any("cannot hold one target group (tp_size=8)" in p for p in problems)
    assert any("room for 0 target group(s)" in p for p in problems)
    # Two 4-GPU nodes have the GPUs, but a group is STRICT_PACK: one node.
    four = target_node(4, max_nodes=2)
    assert any("cannot hold one target group" in p for p in placement_problems(ask(), [HEAD, four]))


def test_the_target_resource_counts_like_the_gpus():
    problems = placement_problems(ask(), [HEAD, target_node(8, target=7), draft_node()])
    assert any("cannot hold one target group" in p for p in problems)


def test_target_group_capacity_sums_over_node_types_and_nodes():
    sixteen = target_node(16)  # two groups per node
    eights = target_node(8, max_nodes=2)
    nodes = [HEAD, sixteen, eights, draft_node()]
    assert placement_problems(ask(num_target_groups=4), nodes) == []
    problems = placement_problems(ask(num_target_groups=5), nodes)
    assert problems == ["room for 4 target group(s), the app asks for num_target_groups=5"]


def test_no_target_node_type_is_a_problem():
    problems = placement_problems(ask(), [HEAD, draft_node()])
    assert problems == ["no node type advertises the target resource 'target'"]


def test_draft_capacity_sums_over_node_types_and_one_worker_short_is_caught():
    small = draft_node(max_nodes=3, name="l4")
    large = draft_node(draft=5, gpus=4, cpus=16, max_nodes=1, name="l4x4")  # 4 workers a node
    assert placement_problems(ask(max_drafts=7), [HEAD, target_node(), small, large]) == []
    problems = placement_problems(ask(max_drafts=8), [HEAD, target_node(), small, large])
    assert problems == [
        "room for 7 draft worker(s), the app may scale to 8 (max_draft_workers x num_target_groups)"
    ]


def test_a_draft_node_needs_room_for_the_replica_sliver_too():
    # draft: 1 holds the worker's actor but not also its replica's 0.001: one sliver short.
    problems = placement_problems(ask(max_drafts=1), [HEAD, target_node(), draft_node(draft=1)])
    assert any("cannot hold one draft worker" in p for p in problems)
    assert placement_problems(ask(max_drafts=1), [HEAD, target_node(), draft_node(draft=2)]) == []


def test_fractional_draft_gpus_pack_several_workers_per_gpu():
    shared = [HEAD, target_node(), draft_node(draft=5, max_nodes=1)]  # 1 GPU, 4 CPUs
    assert placement_problems(ask(max_drafts=3, draft_num_gpus=0.25), shared) == []
    # The GPU has room for 4 quarter-GPU workers, but 4 x 1.05 CPU is 0.2 more than 4 CPUs.
    problems = placement_problems(ask(max_drafts=4, draft_num_gpus=0.25), shared)
    assert problems == [
        "room for 3 draft worker(s), the app may scale to 4 (max_draft_workers x num_target_groups)"
    ]


def test_missing_draft_resource_is_a_problem_unless_the_app_has_no_draft():
    gpu_only = NodeType("draft", {"CPU": 4, "GPU": 1}, max_nodes=4)
    problems = placement_problems(ask(), [HEAD, target_node(), gpu_only])
    assert problems == ["no node type advertises the draft resource 'draft'"]
    # A target-only app (draft=None) asks no draft workers: no draft node type needed.
    target_only = PlacementAsk.from_app_args(AppArgs(draft=None, tp_size=8, target_num_gpus=1))
    assert target_only.max_drafts == 0
    assert placement_problems(target_only, [HEAD, target_node()]) == []


@pytest.mark.parametrize("resource", ["GPU", "draft", "target"])
def test_the_head_must_not_advertise_model_resources(resource):
    head = NodeType("head", {"CPU": 0, resource: 1}, max_nodes=1, is_head=True)
    problems = placement_problems(ask(), [head, target_node(), draft_node()])
    assert problems[0] == (
        f"head node type 'head' advertises {resource!r}: GPU work must stay off the head "
        "(it runs the GCS, the dashboard and Serve's controller)"
    )
    # (A head advertising draft / target is also counted, and reported, as such a node type.)


def test_exactly_one_head_node_type():
    workers = [target_node(), draft_node()]
    assert "found 0" in placement_problems(ask(), workers)[0]
    other_head = NodeType("head2", {"CPU": 0}, max_nodes=1, is_head=True)
    assert "found 2" in placement_problems(ask(), [HEAD, other_head, *workers])[0]


def test_custom_resource_names_are_followed():
    renamed = ask(draft_resource="l4", target_resource="h100")
    nodes = [
        HEAD,
        NodeType("t", {"CPU": 64, "GPU": 8, "h100": 8}, max_nodes=1),
        NodeType("d", {"CPU": 4, "GPU": 1, "l4": 2}, max_nodes=4),
    ]
    assert placement_problems(renamed, nodes) == []
    assert placement_problems(ask(), nodes)[0].startswith("no node type advertises")


# ---- from_ray_up --------------------------------------------------------------------------------
def test_from_ray_up_reads_node_types_resources_and_counts():
    config = {
        "head_node_type": "head",
        "available_node_types": {
            "head": {"resources": {"CPU": 0, "GPU": 0}, "node_config": {}},
            "draft": {
                "resources": {"CPU": 4, "GPU": 1, "draft": 2},
                "min_workers": 2,
                "max_workers": 8,
                "labels": {"tier": "draft"},
                "node_config": {},
            },
        },
    }
    head, draft = from_ray_up(config)
    assert (head.name, head.is_head, head.max_nodes) == ("head", True, 1)
    assert (draft.name, draft.is_head, draft.max_nodes) == ("draft", False, 8)
    assert draft.resources == {"CPU": 4.0, "GPU": 1.0, "draft": 2.0}
    assert draft.labels == {"tier": "draft"}


def test_node_type_counts_must_not_be_negative():
    with pytest.raises(ValueError, match="max_nodes"):
        NodeType("draft", {"CPU": 1}, max_nodes=-1)
