"""The trainer as the dispatcher runs it: `python -m trainer.entry` with the YATT_* variables,
and a second attempt in the same run directory that resumes from the newest checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_metrics, read_summary, tiny_config
from tests.unit.test_telemetry import FakeApi, free_port
from trainer.entry import PROJECT_ROOT, run_training

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model


@pytest.mark.slow
def test_entry_reads_its_environment_and_reports_to_the_api(nano_model, tmp_path):
    port = free_port()
    api = FakeApi(port)
    cfg = tiny_config(nano_model, train={"max_steps": 2}, placement={"devices": 1})
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"YATT_CONFIG_JSON": cfg.model_dump_json(), "YATT_RUN_ID": "31", "YATT_ATTEMPT": "1",
                "YATT_API_URL": f"http://127.0.0.1:{port}", "YATT_RUN_TOKEN": "tok-31",
                "YATT_RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        proc = subprocess.run([sys.executable, "-m", "trainer.entry"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
    finally:
        api.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    2/2" in proc.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["steps"] == 2
    states = [(p, b) for p, b, _ in api.received if p.endswith("/state")]
    assert [b["state"] for _, b in states] == ["running", "succeeded"]
    assert states[-1][0] == "/api/v1/runs/31/state"
    assert states[-1][1]["summary"]["steps"] == 2
    assert {p["step"] for p in api.points() if p["key"] == "loss/policy"} == {1, 2}


@pytest.mark.slow
def test_entry_fails_cleanly_on_a_bad_config(tmp_path):
    port = free_port()
    api = FakeApi(port)
    env = {**os.environ, "YATT_CONFIG_JSON": json.dumps({"train": {"max_steps": -1}}),
           "YATT_RUN_ID": "5", "YATT_API_URL": f"http://127.0.0.1:{port}", "YATT_RUN_TOKEN": "t",
           "YATT_RUN_DIR": str(tmp_path), "PYTHONPATH": str(PROJECT_ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-m", "trainer.entry"], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        api.stop()
    assert proc.returncode == 2
    (body,) = [b for p, b, _ in api.received if p.endswith("/state")]
    assert body["state"] == "failed" and "train.max_steps" in body["reason"]


@pytest.mark.slow
def test_a_new_attempt_resumes_from_the_newest_checkpoint(ray_head, nano_model, tmp_path):
    first = tiny_config(nano_model, train={"max_steps": 2}, checkpoint={"every_steps": 2},
                        placement={"devices": 1})
    before = run_training(first, tmp_path, env={})
    # the retry: same run directory, and (as a longer run) more steps to go
    second = tiny_config(nano_model, train={"max_steps": 4}, checkpoint={"every_steps": 2},
                         placement={"devices": 1})
    summary = run_training(second, tmp_path, env={})
    assert summary["resumed_from_steps"] == [2] and summary["steps"] == 4
    steps = [m["step"] for m in read_metrics(tmp_path)]
    assert steps == [0, 1, 2, 3, 4]  # no warm start and no step repeated on the retry
    # the start accuracy is the first attempt's, carried in the checkpoint
    assert summary["eval/accuracy_start"] == before["eval/accuracy_start"]
    assert read_summary(tmp_path)["steps"] == 4
