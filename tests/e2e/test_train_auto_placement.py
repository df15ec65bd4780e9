"""placement.mode=auto on a real Ray: the run profiles, chooses, and when its workload shifts
mid-way (a slower decoder from step K, injected with YATT_SLOW_DECODE) re-plans in the same run —
checkpoint, new gang, resume — training to the end with one metric row per step and every
prompt taken exactly once per pass."""

from __future__ import annotations

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_events, read_metrics, read_summary, tiny_config
from trainer import checkpoint as ckpt
from trainer.entry import run_training
from trainer.rollout.decode_delay import ENV_VAR

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model

STEPS, SHIFT, BATCH = 60, 30, 8


@pytest.mark.slow
def test_auto_re_plans_when_the_workload_shifts_and_loses_no_step(ray_head, nano_model, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv(ENV_VAR, f"{SHIFT}:0.4")  # from step 30: +0.4 s per decode step
    cfg = tiny_config(nano_model, train={"max_steps": STEPS, "batch_size": BATCH},
                      rollout={"n": 8, "max_new_tokens": 3},
                      placement={"mode": "auto", "devices": 2, "profile_steps": 3, "replan_every": 4},
                      checkpoint={"every_steps": 10, "keep": 2})
    summary = run_training(cfg, tmp_path, env={})

    placement = [e for e in read_events(tmp_path) if e["kind"] == "placement"]
    decisions = [e["data"] for e in placement]
    assert decisions[0]["decision"] == "start" and decisions[0]["mode"] == "colocate"
    # after the shift, a re-plan moved the roles, with the candidates' predictions and the reason
    shifted = [d for d in decisions if d["decision"] == "replan" and d["switch"] and d["step"] >= SHIFT]
    assert shifted, [e["message"] for e in placement]
    replan = shifted[0]
    # which plan the refit prefers depends on how this machine's load splits the phases; that it
    # moved, why, and that the move happened in the same run is what is checked here
    assert replan["chosen"] != replan["current"] and "drifted" in replan["reason"]
    assert {c["plan"] for c in replan["candidates"]} == {"colocate", "disaggregated 1 rollout / 1 train"}
    assert all(c["predicted_step_s"] > 0 for c in replan["candidates"])
    applied = [d for d in decisions if d["decision"] == "applied" and d["step"] >= replan["step"]]
    assert applied and applied[0]["plan"] == replan["plan"]
    # ... and afterwards the measured step time of the new plan, next to its prediction
    assert any(d["decision"] == "measured" and d["decision_step"] == replan["step"]
               and d["measured_step_s"] > 0 for d in decisions)

    # trained to the end: exactly one metric row per step, across every gang
    steps = [m["step"] for m in read_metrics(tmp_path) if m["step"] > 0]
    assert steps == list(range(1, STEPS + 1))
    assert summary["steps"] == STEPS and read_summary(tmp_path)["placement_switches"]
    # every step took exactly one batch of prompts (none skipped, none taken twice): the shard
    # positions of the final checkpoint add up to steps × batch, whatever gangs read them
    final = ckpt.latest_checkpoint(tmp_path)
    positions: dict[int, int] = {}
    for r in range(2):
        saved = ckpt.load_rank(final, r)
        if saved is not None:
            positions.update(saved["positions"])
    assert sorted(positions) == [0, 1] and sum(positions.values()) == STEPS * BATCH
    assert (tmp_path / "final" / "model.safetensors").exists()
