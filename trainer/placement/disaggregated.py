"""disaggregated: a rollout pool generates while a training pool trains.

Rollout of step t+1 is dispatched before step t trains, so the two overlap; a rollout may lag the
policy by at most `placement.staleness` versions (0: no overlap). After each update training
rank 0 broadcasts the new weights to every rollout worker (trainer/weight_sync.py)."""

from __future__ import annotations

from trainer.config import TrainerConfig
from trainer.placement.plan import PlacementPlan


def plan_disaggregated(cfg: TrainerConfig, devices: list[int], device_type: str,
                       single: bool) -> PlacementPlan:
    n_rollout = cfg.rollout_pool_size
    rollout = devices[:n_rollout]
    train = devices[n_rollout:]
    notes = []
    if single:  # same devices and ranks; the driver moves every prompt, sample and batch
        notes.append("single controller: the driver moves every prompt, sample and batch")
    # Each controller feeds from its own share of the rollout pool; when the pool is smaller than
    # the training pool, controllers share workers round-robin.
    if len(rollout) >= len(train):
        assignment = [rollout[r::len(train)] for r in range(len(train))]
    else:
        assignment = [[rollout[r % len(rollout)]] for r in range(len(train))]
    return PlacementPlan(
        mode="disaggregated", device_type=device_type, devices=len(devices),
        cpus_per_device=cfg.placement.cpus_per_device,
        train_devices=train, local_sampler_devices=[], rollout_devices=rollout,
        rollout_assignment=assignment, overlap=cfg.placement.staleness > 0,
        staleness=cfg.placement.staleness, notes=notes,
    )
