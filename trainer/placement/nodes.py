"""Which Ray node hosts each device when the cluster has more than one (issue 9 item 5).

A plan numbers devices 0..n-1 without saying where they are. On one node that is all there is
to it (the placement group packs the bundles). With two or more nodes, a disaggregated plan keeps
its training pool on one node (the gradient all-reduce stays inside it) and its rollout pool on
the others, so the only traffic between nodes is the weight broadcast of trainer/weight_sync.py —
one copy of the policy per step. Pure functions: the node list comes from `ray.nodes()`.
"""

from __future__ import annotations

from trainer.placement.plan import PlacementPlan

__all__ = ["device_nodes"]


def device_nodes(plan: PlacementPlan, capacity: dict[str, int]) -> list[str] | None:
    """The node id for each device of `plan` (index = device), or None to let Ray pack them.

    `capacity` maps each alive node id to the devices it can host, in the cluster's order.
    Only a disaggregated plan on two or more nodes gets an assignment: its training pool on the
    node with the most devices that can hold it, its rollout pool on the other nodes (the
    largest first). When the pools cannot be kept apart, None: packing is as good as any split.
    """
    nodes = {n: c for n, c in capacity.items() if c > 0}
    if plan.mode != "disaggregated" or len(nodes) < 2 or not plan.rollout_devices:
        return None
    by_size = sorted(nodes, key=lambda n: -nodes[n])  # stable: ties keep the cluster's order
    train_node = next((n for n in by_size if nodes[n] >= len(plan.train_devices)), None)
    if train_node is None:
        return None
    free = {n: nodes[n] for n in by_size if n != train_node}
    if sum(free.values()) < len(plan.rollout_devices):
        return None
    out: dict[int, str] = {d: train_node for d in plan.train_devices}
    pool = iter(sorted(plan.rollout_devices))
    for node, slots in free.items():
        for _ in range(slots):
            d = next(pool, None)
            if d is None:
                break
            out[d] = node
    return [out[d] for d in range(plan.devices)]
