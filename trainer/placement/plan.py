"""Placement plans: which device runs which role. Pure functions, no Ray: easy to test and to
extend (`auto` will add plans of its own)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.config import ConfigError, TrainerConfig

__all__ = ["PlacementPlan", "plan_placement", "resolve_device_type"]


@dataclass
class PlacementPlan:
    """Devices are numbered 0..devices-1; each hosts exactly one actor.

    `train_devices[r]` is the device of data-parallel controller r. A controller whose device is
    also listed in `local_sampler_devices` holds its own sampler in-process (colocated: it sleeps
    while the policy trains); `rollout_devices` host remote rollout workers, and
    `rollout_assignment[r]` names the ones controller r sends its prompts to. `reward_devices`
    also host a reward scorer beside their controller (partial_colocate): the device's second
    actor, which scores the samples every controller streams to it while they still generate.
    """

    mode: str
    device_type: str
    devices: int
    cpus_per_device: float
    train_devices: list[int]
    local_sampler_devices: list[int]
    rollout_devices: list[int]
    rollout_assignment: list[list[int]]
    overlap: bool = False
    staleness: int = 0
    reward_devices: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_event(self) -> dict[str, Any]:
        data = asdict(self)
        data["pools"] = {"train": self.train_devices, "rollout": self.rollout_devices
                         or self.local_sampler_devices}
        return data


def resolve_device_type(requested: str, gpus_available: float) -> str:
    if requested == "auto":
        return "gpu" if gpus_available >= 1 else "cpu"
    return requested


def plan_placement(cfg: TrainerConfig, *, device_type: str) -> PlacementPlan:
    """The placement for `cfg` on `cfg.placement.devices` devices of `device_type`."""
    p = cfg.placement
    single = cfg.controller.mode == "single"
    if p.mode == "auto":
        if single:
            raise ConfigError([("placement.mode", "'auto' re-plans the parallel controllers; "
                                "use controller.mode=parallel")])
        if cfg.train.strategy == "fsdp2":
            # a re-plan may change the number of training ranks; fsdp2's optimizer shards
            # resume only with as many ranks as wrote them
            raise ConfigError([("placement.mode", "'auto' may change the number of training "
                                "ranks, which train.strategy=fsdp2 cannot resume across; use "
                                "train.strategy=ddp or a fixed placement.mode")])
        from trainer.placement.auto import layout_config, starting_layout

        plan = plan_placement(layout_config(cfg, starting_layout(cfg)), device_type=device_type)
        plan.notes.append("auto: starts here, profiles, then moves to the plan with the least "
                          "predicted step time")
        return plan
    devices = list(range(p.devices))
    if p.mode == "colocate":
        from trainer.placement.colocate import plan_colocate

        return plan_colocate(cfg, devices, device_type, single)
    if p.mode == "partial_colocate":
        from trainer.placement.partial_colocate import plan_partial_colocate

        return plan_partial_colocate(cfg, devices, device_type, single)
    if p.mode == "disaggregated":
        from trainer.placement.disaggregated import plan_disaggregated

        return plan_disaggregated(cfg, devices, device_type, single)
    raise ConfigError([("placement.mode", f"unknown mode {p.mode!r}")])
