"""partial_colocate: every device generates; a reward scorer on `placement.reward_devices` of them
scores finished samples as they stream in; then every device trains.

Each controller keeps its colocated sampler (as in colocate) and streams each chunk of finished
samples to a scorer while its engine is still decoding the rest, so scoring hides in the
generation tail instead of following it. The scorer is a second actor on its device: the two
share the device's resources (half each in Ray's accounting), as a reward model shares a GPU
with a sampler."""

from __future__ import annotations

from trainer.config import ConfigError, TrainerConfig
from trainer.placement.plan import PlacementPlan

# Ray's share of a scoring device each of its two actors (controller, scorer) reserves.
SCORER_SHARE = 0.5


def plan_partial_colocate(cfg: TrainerConfig, devices: list[int], device_type: str,
                          single: bool) -> PlacementPlan:
    if single:
        raise ConfigError([("controller.mode", "placement.mode=partial_colocate streams samples "
                            "from each parallel controller to its scorer; use controller.mode="
                            "parallel")])
    k = cfg.placement.reward_devices
    if k > len(devices):
        raise ConfigError([("placement.reward_devices", f"{k} scoring devices requested, the "
                            f"placement has {len(devices)} devices")])
    return PlacementPlan(
        mode="partial_colocate", device_type=device_type, devices=len(devices),
        cpus_per_device=cfg.placement.cpus_per_device,
        train_devices=list(devices), local_sampler_devices=list(devices),
        rollout_devices=[], rollout_assignment=[[] for _ in devices],
        reward_devices=list(devices[:k]),
        notes=[f"reward scorer on device(s) {devices[:k]}, scoring while every device generates"],
    )
