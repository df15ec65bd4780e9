"""Placement on Ray: a placement group with one bundle per device, and the actor options that pin
a role to its device.

A device is a GPU (Ray's `GPU` resource) or, on a CPU machine, a slice of cores declared to Ray
as the logical resource `yatt_device` (a local head gets it from `ray.init(resources=...)`; on a
cluster start the nodes with `--resources='{"yatt_device": N}'`). A cluster that declares no
`yatt_device` falls back to plain CPU bundles, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config import ConfigError, TrainerConfig
from trainer.placement.plan import PlacementPlan, plan_placement, resolve_device_type

__all__ = ["DEVICE_RESOURCE", "Placement", "PlacementPlan", "build_placement", "plan_placement"]

DEVICE_RESOURCE = "yatt_device"


@dataclass
class Placement:
    plan: PlacementPlan
    group: Any  # ray.util.placement_group.PlacementGroup
    device_resource: str | None
    warnings: list[str] = field(default_factory=list)
    # the Ray node of each device when the cluster has several (trainer/placement/nodes.py)
    nodes: list[str] | None = None

    def to_event(self) -> dict[str, Any]:
        """The plan, and on a multi-node cluster the node of each device."""
        data = self.plan.to_event()
        if self.nodes is not None:
            data["nodes"] = self.nodes
        return data

    def actor_options(self, device: int, env: dict[str, str] | None = None, *,
                      share: float = 1.0) -> dict[str, Any]:
        """Options for `ActorClass.options(...)` that pin an actor to `device`, reserving `share`
        of it (two actors that share a device, a controller and a reward scorer, take half each)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {
            "num_cpus": self.plan.cpus_per_device * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=device),
            "runtime_env": {"env_vars": {**self.device_env(), **(env or {})}},
        }
        if self.plan.device_type == "gpu":
            opts["num_gpus"] = share
        elif self.device_resource:
            opts["resources"] = {self.device_resource: share}
        return opts

    def device_env(self) -> dict[str, str]:
        threads = str(max(1, int(self.plan.cpus_per_device)))
        return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}

    def remove(self) -> None:
        import ray

        try:
            ray.util.remove_placement_group(self.group)
        except Exception:
            pass


def build_placement(cfg: TrainerConfig, *, timeout_s: float = 120.0) -> Placement:
    """Reserve one bundle per device on the connected Ray cluster and return the placement."""
    import ray
    from ray.util.placement_group import placement_group

    resources = ray.cluster_resources()
    device_type = resolve_device_type(cfg.placement.device_type, resources.get("GPU", 0.0))
    plan = plan_placement(cfg, device_type=device_type)
    warnings: list[str] = []
    c = cfg.placement.cpus_per_device
    if device_type == "gpu":
        if resources.get("GPU", 0.0) < plan.devices:
            raise ConfigError([("placement.devices", f"{plan.devices} GPUs requested, the Ray "
                                f"cluster has {resources.get('GPU', 0.0):g}")])
        bundles = [{"GPU": 1.0, "CPU": c} for _ in range(plan.devices)]
        device_resource = None
    else:
        have = resources.get(DEVICE_RESOURCE, 0.0)
        if have >= plan.devices:
            device_resource = DEVICE_RESOURCE
            bundles = [{DEVICE_RESOURCE: 1.0, "CPU": c} for _ in range(plan.devices)]
        else:
            device_resource = None
            bundles = [{"CPU": c} for _ in range(plan.devices)]
            warnings.append(f"the Ray cluster declares {have:g} '{DEVICE_RESOURCE}' resources for "
                            f"{plan.devices} devices; placing on plain CPU bundles instead")
        if resources.get("CPU", 0.0) < plan.devices * c:
            raise ConfigError([("placement.devices", f"{plan.devices} devices × {c:g} CPUs need "
                                f"{plan.devices * c:g} CPUs, the Ray cluster has "
                                f"{resources.get('CPU', 0.0):g}")])
    nodes = _device_nodes(plan, device_type, device_resource)
    if nodes is not None:
        from ray.util.placement_group import NODE_ID_LABEL_KEY

        group = placement_group(bundles, strategy="PACK", name="",
                                bundle_label_selector=[{NODE_ID_LABEL_KEY: n} for n in nodes])
    else:
        group = placement_group(bundles, strategy="PACK", name="")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception as exc:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"could not reserve {plan.devices} devices within {timeout_s:.0f}s "
                           f"(bundles {bundles}): {exc}") from exc
    return Placement(plan=plan, group=group, device_resource=device_resource, warnings=warnings,
                     nodes=nodes)


def _device_nodes(plan: PlacementPlan, device_type: str, device_resource: str | None) -> list[str] | None:
    """Node per device on a cluster of several nodes (trainer/placement/nodes.py), else None."""
    import ray

    from trainer.placement.nodes import device_nodes

    key = "GPU" if device_type == "gpu" else device_resource
    if key is None:
        return None
    capacity = {n["NodeID"]: int(n["Resources"].get(key, 0)) for n in ray.nodes() if n["Alive"]}
    return device_nodes(plan, capacity)
