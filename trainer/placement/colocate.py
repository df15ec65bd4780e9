"""colocate: every device holds the policy, its sampler and (when used) the reference and critic.

Phases take turns on the device; the sampler frees its KV cache while the policy trains. With
`controller.mode: single` one controller trains on device 0 and its own sampler there, and sends
prompts to rollout workers on the other devices: every sample passes through it (verl-style)."""

from __future__ import annotations

from trainer.config import TrainerConfig
from trainer.placement.plan import PlacementPlan


def plan_colocate(cfg: TrainerConfig, devices: list[int], device_type: str,
                  single: bool) -> PlacementPlan:
    if single:
        return PlacementPlan(
            mode="colocate", device_type=device_type, devices=len(devices),
            cpus_per_device=cfg.placement.cpus_per_device,
            train_devices=[devices[0]], local_sampler_devices=[devices[0]],
            rollout_devices=devices[1:], rollout_assignment=[devices[1:]],
            notes=["single controller: all samples pass through controller 0"],
        )
    return PlacementPlan(
        mode="colocate", device_type=device_type, devices=len(devices),
        cpus_per_device=cfg.placement.cpus_per_device,
        train_devices=list(devices), local_sampler_devices=list(devices),
        rollout_devices=[], rollout_assignment=[[] for _ in devices],
    )
