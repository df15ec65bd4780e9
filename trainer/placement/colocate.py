"""colocate: every device holds the policy, its sampler and (when used) the reference and critic.

Phases take turns on the device; the sampler frees its KV cache while the policy trains. The plan
is the same in both controller modes (`controller.mode: single` changes who drives the loop, not
where anything runs)."""

from __future__ import annotations

from trainer.config import TrainerConfig
from trainer.placement.plan import PlacementPlan


def plan_colocate(cfg: TrainerConfig, devices: list[int], device_type: str,
                  single: bool) -> PlacementPlan:
    return PlacementPlan(
        mode="colocate", device_type=device_type, devices=len(devices),
        cpus_per_device=cfg.placement.cpus_per_device,
        train_devices=list(devices), local_sampler_devices=list(devices),
        rollout_devices=[], rollout_assignment=[[] for _ in devices], notes=_notes(single),
    )


def _notes(single: bool) -> list[str]:
    return ["single controller: the driver moves every prompt, sample and batch"] if single else []
