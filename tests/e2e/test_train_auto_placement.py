"""placement.mode=auto on a real Ray: the run profiles, chooses, and when its workload shifts
mid-way (slower generation work from step K, injected with YATT_SLOW_DECODE) re-plans in the same
run — checkpoint, new gang, resume — settling on the plan that measures fastest after the shift,
training to the end with one metric row per step and every prompt taken exactly once per pass."""

from __future__ import annotations

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_events, read_metrics, read_summary, tiny_config
from trainer import checkpoint as ckpt
from trainer.entry import run_training
from trainer.rollout.decode_delay import ENV_VAR

# serial: runs alone, after the tests that run side by side (`make test`); it asserts
# on placement chosen from measured phase times
pytestmark = pytest.mark.serial

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model

STEPS, BATCH = 60, 8
# The profile's initial choice comes at step 12-14 (colocate 3 steps; disaggregated 3 after its
# gang's 2 warm-up steps, which starts after step 7-9 as the old gang drains its prefetch). From
# step 20 every generated token costs 4 ms more, which a device pays for its share of the batch:
# colocate, where both devices generate 96 of the 192 tokens a step, pays 0.38 s; disaggregated's
# one rollout device pays 0.77 s for all of them, which overlapping a nano model's training
# (about 0.04 s) does not win back. Colocate is then faster by about 40%, whichever plan the run
# is on when the shift comes. (A slower decoder per decode step, what this test used before,
# costs both plans alike on this model: which one a re-plan preferred was a coin flip.)
SHIFT = 20
SLOW = f"{SHIFT}:0.004:token"
DISAGG = "disaggregated 1 rollout / 1 train"


def _plan_by_step(placement: list[dict], steps: int) -> dict[int, str]:
    """The plan each step ran on, from the `applied` events (a switch after step k runs k + 1 on)."""
    applied = sorted((d["step"], d["plan"]) for d in placement if d["decision"] == "applied")
    plan, out = "colocate", {}
    for step in range(1, steps + 1):
        while applied and applied[0][0] < step:
            plan = applied.pop(0)[1]
        out[step] = plan
    return out


@pytest.mark.slow
def test_auto_re_plans_when_the_workload_shifts_and_loses_no_step(ray_head, nano_model, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv(ENV_VAR, SLOW)
    cfg = tiny_config(nano_model, train={"max_steps": STEPS, "batch_size": BATCH},
                      rollout={"n": 8, "max_new_tokens": 3},
                      placement={"mode": "auto", "devices": 2, "profile_steps": 3, "replan_every": 4},
                      checkpoint={"every_steps": 10, "keep": 2})
    summary = run_training(cfg, tmp_path, env={})

    placement = [e for e in read_events(tmp_path) if e["kind"] == "placement"]
    decisions = [e["data"] for e in placement]
    messages = [e["message"] for e in placement]
    assert decisions[0]["decision"] == "start" and decisions[0]["mode"] == "colocate"
    assert any(d["decision"] == "profile" and d["switch"] and d["step"] < SHIFT for d in decisions)
    plan_at = _plan_by_step(decisions, STEPS)
    after = [d for d in decisions if d.get("step", 0) >= SHIFT]
    if any(plan_at[s] == DISAGG for s in range(SHIFT, STEPS + 1)):
        # on disaggregated after the shift: a check notices it (the phases drifted; with both
        # plans' predictions) and moves the roles in the same run, applied and measured after.
        # A re-profile decided on noise before the shift and measured across it is reverted on
        # stale steps first, and the revert's own follow-up undoes that (its reason: drifted).
        moved = [d for d in after if d["decision"] == "replan" and d["switch"] and d["plan"] == "colocate"]
        assert moved and "drifted" in moved[0]["reason"], messages
        assert {c["plan"] for c in moved[0]["candidates"]} == {"colocate", DISAGG}
        assert all(c["predicted_step_s"] > 0 for c in moved[0]["candidates"])
        applied = [d for d in after if d["decision"] == "applied" and d["step"] >= moved[0]["step"]]
        assert applied and applied[0]["plan"] == "colocate"
        assert any(d["decision"] == "measured" and d["decision_step"] == moved[0]["step"]
                   and d["measured_step_s"] > 0 for d in after)
    # the run ends on the plan that is faster after the shift, and where it ran both there, the
    # faster one measured (steps past each gang's 2 warm-up steps)
    assert plan_at[STEPS] == "colocate", messages
    starts = {d["step"] for d in decisions if d["decision"] == "applied"}
    times: dict[str, list[float]] = {}
    for m in read_metrics(tmp_path):
        step = m["step"]
        if step > SHIFT + 1 and not any(0 <= step - s <= 2 for s in starts):
            times.setdefault(plan_at[step], []).append(m["time/step"])
    if DISAGG in times:
        mean = {plan: sum(ts) / len(ts) for plan, ts in times.items()}
        assert mean["colocate"] < mean[DISAGG], mean

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
