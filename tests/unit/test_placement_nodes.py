"""Node-aware placement: a disaggregated plan on several Ray nodes keeps its training pool on
one node and its rollout pool on the others (trainer/placement/nodes.py)."""

from __future__ import annotations

from trainer.config import parse_config
from trainer.placement import plan_placement
from trainer.placement.nodes import device_nodes


def _plan(mode: str, devices: int, rollout: int | None = None):
    placement = {"mode": mode, "devices": devices}
    if rollout is not None:
        placement["rollout_devices"] = rollout
    return plan_placement(parse_config({"placement": placement, "train": {"batch_size": 12}}),
                          device_type="cpu")


def test_disaggregated_pools_go_to_different_nodes():
    plan = _plan("disaggregated", 4)  # rollout 0,1; train 2,3
    nodes = device_nodes(plan, {"head": 2, "second": 2})
    assert nodes is not None
    assert {nodes[d] for d in plan.train_devices} == {"head"}
    assert {nodes[d] for d in plan.rollout_devices} == {"second"}


def test_training_takes_the_node_that_holds_it_and_rollout_spills_over_the_rest():
    plan = _plan("disaggregated", 6, rollout=3)  # rollout 0-2; train 3-5
    nodes = device_nodes(plan, {"a": 1, "b": 3, "c": 2})
    assert nodes is not None
    assert {nodes[d] for d in plan.train_devices} == {"b"}
    assert sorted(nodes[d] for d in plan.rollout_devices) == ["a", "c", "c"]


def test_one_node_colocate_or_no_room_to_split_leaves_packing_to_ray():
    assert device_nodes(_plan("disaggregated", 2), {"head": 2}) is None
    assert device_nodes(_plan("colocate", 2), {"head": 1, "second": 1}) is None
    # the training pool fits nowhere whole, or the others cannot hold the rollout pool
    assert device_nodes(_plan("disaggregated", 4), {"a": 1, "b": 1, "c": 1, "d": 1}) is None
    assert device_nodes(_plan("disaggregated", 4, rollout=3), {"a": 3, "b": 1}) is None
    assert device_nodes(_plan("disaggregated", 2), {"a": 1, "b": 0}) is None
