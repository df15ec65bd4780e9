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

    cfg = tiny_config(nano_model, train={"max_steps": 5}, checkpoint={"every_steps": 2},
                      controller={"mode": "parallel", "max_restarts": 1})
    killed: list[int] = []

    def on_step(step, metrics, driver):
        if step == 3 and not killed:
            pid = ray.get(driver.controllers[1].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_training(cfg, tmp_path, env={}, on_step=on_step)

    assert killed
    assert summary["restarts"] == 1
    assert summary["resumed_from_steps"] == [2]  # the newest checkpoint when rank 1 died
    assert summary["steps"] == 5 and read_summary(tmp_path)["steps"] == 5
    restarts = [e for e in read_events(tmp_path) if e["kind"] == "restart"]
    assert restarts[0]["data"]["rank"] == 1 and restarts[0]["data"]["resume_step"] == 2
    assert any("resumed from checkpoint at step 2" in e["message"] for e in restarts[1:])
    steps = [m["step"] for m in read_metrics(tmp_path) if m["step"] > 0]
    assert steps[-1] == 5 and steps.count(3) >= 1 and 4 in steps
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
