"""A controller process killed mid-run: the driver restarts the controllers from the newest
checkpoint and the run completes (DESIGN.md §3.2)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_events, read_metrics, read_summary, tiny_config
from trainer.entry import run_training

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model


@pytest.mark.slow
def test_killed_controller_is_restarted_from_its_checkpoint(ray_head, nano_model, tmp_path):
    import ray

    cfg = tiny_config(nano_model, train={"max_steps": 40}, checkpoint={"every_steps": 2},
                      controller={"mode": "parallel", "max_restarts": 1})
    killed: list[int] = []

    def on_step(step, metrics, driver):
        # by step 3 the checkpoint of step 2 is complete; the controllers are still mid-run
        if step >= 3 and not killed:
            pid = ray.get(driver.controllers[1].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_training(cfg, tmp_path, env={}, on_step=on_step)

    assert killed
    assert summary["restarts"] == 1
    # The controllers run ahead of the driver's view: the newest checkpoint when rank 1 died is
    # some even step (checkpoints every 2 steps); the run resumed from exactly that one.
    (resumed,) = summary["resumed_from_steps"]
    assert resumed % 2 == 0 and 2 <= resumed < 40
    assert summary["steps"] == 40 and read_summary(tmp_path)["steps"] == 40
    restarts = [e for e in read_events(tmp_path) if e["kind"] == "restart"]
    assert restarts[0]["data"]["rank"] == 1 and restarts[0]["data"]["resume_step"] == resumed
    assert any(f"resumed from checkpoint at step {resumed}" in e["message"] for e in restarts[1:])
    # after the restart, the steps continue from the checkpoint's next step up to the end
    after = [m["step"] for m in read_metrics(tmp_path) if m["time"] > restarts[0]["time"]]
    assert after == list(range(resumed + 1, 41))
    # the warm start ran once: the resumed controllers took the trained weights from the checkpoint
    assert sum(1 for m in read_metrics(tmp_path) if m["step"] == 0) == 1
    assert (tmp_path / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_restarts_are_bounded(ray_head, nano_model, tmp_path):
    import ray

    cfg = tiny_config(nano_model, train={"max_steps": 4}, controller={"max_restarts": 0})

    def on_step(step, metrics, driver):
        if step == 1:
            os.kill(ray.get(driver.controllers[0].pid.remote()), signal.SIGKILL)

    with pytest.raises(Exception, match="max_restarts=0"):
        run_training(cfg, tmp_path, env={}, on_step=on_step)
    states = [e["data"]["state"] for e in read_events(tmp_path) if e["kind"] == "state"]
    assert states[-1] == "failed"
