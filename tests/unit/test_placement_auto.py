"""placement.mode=auto: the planner's decisions on steps measured from a known cost model
(profile, initial choice, re-plan on drift, hysteresis, only plans that fit)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from trainer.config import ConfigError, parse_config
from trainer.placement.auto import AutoPlanner, candidate_layouts, layout_config, starting_layout
from trainer.placement.cost_model import CostParams, Layout, LengthDist, Workload, phase_times
from trainer.placement.plan import plan_placement

COLOCATE = Layout("colocate", 2)
DISAGG = Layout("disaggregated", 2, rollout_devices=1)
# CPU-like: training per token dominates; generation has a per-decode-step latency floor
TRUE = CostParams(gen_fixed_s=0.05, gen_step_s=0.02, gen_token_s=0.001, train_fixed_s=0.05,
                  train_token_s=0.002, sync_fixed_s=0.02, reward_sample_s=0.0005)
SLOW_DECODE = replace(TRUE, gen_step_s=0.6)  # the shift: every decode step 30× slower


def cfg(**placement):
    # the reference pass stays with the training pool (what `measured` simulates)
    return parse_config({"train": {"max_steps": 200, "batch_size": 16}, "rollout": {"n": 8},
                         "placement": {"mode": "auto", "devices": 2, "profile_steps": 4,
                                       "replan_every": 10, "reference_on_rollout": 0, **placement}})


def measured(params: CostParams, layout: Layout, rng: random.Random, *,
             tail: float = 1.0, length: float = 1.0, oversample: float = 1.0,
             refills: int = 0) -> dict[str, float]:
    """One step's metrics as the driver combines them, from `params` with 2% noise; responses are
    4–6 tokens × `length` long on average, the longest of the 128 is `tail` × their mean.
    `oversample`: dynamic sampling generates for that many times the 16 prompts it trains on (the
    Workload's prompt tokens shrink so that the trained tokens stay those of 16 prompts, as
    StepObservation.workload reads a step whose generated and trained samples differ). `refills`:
    that many more generate calls (dynamic sampling's), on the rank that made the most."""
    mean = rng.uniform(4, 6) * length
    prompts = round(16 * oversample)
    trained = 16 * 8 * (8 + mean)
    w = Workload(prompts=prompts, n=8, response=LengthDist.from_mean_max(mean, mean * tail, prompts * 8),
                 prompt_tokens=trained / (prompts * 8) - mean, param_bytes=4e6, calls=1 + refills)
    pt = phase_times(params, w, layout)
    noise = lambda x: x * rng.uniform(0.98, 1.02)  # noqa: E731
    out = {"time/step": noise(pt.step), "time/rollout": noise(pt.rollout), "time/reward": noise(pt.reward),
           "time/train": noise(pt.train), "time/weight_sync": noise(pt.weight_sync),
           "time/reference": 0.0, "tokens/generated": w.gen_tokens, "tokens/trained": w.train_tokens,
           "response/length_mean": mean, "response/length_max": w.response.expected_max(w.samples)}
    if refills:
        out["sampling/refills"], out["sampling/refills_max"] = refills / 2, float(refills)
    if layout.mode == "partial_colocate":
        # the controllers report the scorers' time on their share, and the wait after generation
        out["time/reward"] = noise(params.reward_sample_s * w.samples / layout.train_pool)
        out["time/reward_wait"] = noise(pt.reward)
    return out


def drive(planner: AutoPlanner, steps: int, params_at=lambda step: TRUE, seed: int = 0,
          tail_at=lambda step: 1.0, length_at=lambda step: 1.0, oversample_at=lambda step: 1.0):
    """Run the planner like the driver does: a switch stops the gang and resumes at that step."""
    rng = random.Random(seed)
    decisions, layouts = [], {}
    for step in range(1, steps + 1):
        layouts[step] = planner.layout
        metrics = measured(params_at(step), planner.layout, rng, tail=tail_at(step),
                           length=length_at(step), oversample=oversample_at(step))
        for d in planner.observe(step, metrics, now=0.0):
            decisions.append(d)
        if planner.pending is not None:
            planner.switched(planner.pending, step)
    return decisions, layouts


def test_candidates_are_colocate_and_every_split_whose_batch_splits():
    c = parse_config({"train": {"batch_size": 16}, "placement": {"mode": "auto", "devices": 4}})
    plans = [(lay.mode, lay.rollout_pool) for lay, _fits in candidate_layouts(c)]
    # 3 training devices cannot split 16 prompts
    assert plans == [("colocate", 4), ("disaggregated", 2), ("disaggregated", 3)]
    assert layout_config(c, Layout("disaggregated", 4, rollout_devices=3)).data_parallel_size == 1


def test_auto_starts_in_colocate_and_plans_its_devices():
    c = cfg()
    assert starting_layout(c) == COLOCATE
    plan = plan_placement(c, device_type="cpu")
    assert plan.mode == "colocate" and plan.train_devices == [0, 1]
    assert any("auto" in n for n in plan.notes)
    with pytest.raises(ConfigError, match="controller.mode=parallel"):
        plan_placement(parse_config({"placement": {"mode": "auto"}, "controller": {"mode": "single"}}),
                       device_type="cpu")


def test_profiles_both_layouts_then_chooses_the_faster_and_stays():
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 80)
    kinds = [(d.kind, d.chosen.mode) for d in decisions]
    assert kinds[0] == ("profile", "disaggregated")
    assert ("initial", "colocate") in kinds
    initial = next(d for d in decisions if d.kind == "initial")
    assert initial.switch  # it was profiling disaggregated: back to colocate
    preds = {p["plan"]: p["predicted_step_s"] for p in initial.predictions}
    assert preds["colocate"] < preds["disaggregated 1 rollout / 1 train"]
    # the workload never changes: after the choice, no re-plan and no "kept" noise
    assert [d.kind for d in decisions if d.step > initial.step + 6] == []
    assert layouts[80] == COLOCATE
    # each switch gets its measured step time afterwards, next to what was predicted
    followups = [d for d in decisions if d.kind == "measured"]
    assert len(followups) == 2 and all(d.measured_step_s and d.predicted_step_s for d in followups)
    true_colocate = phase_times(TRUE, Workload(16, 8, LengthDist(5), 8, 4e6), COLOCATE).step
    assert followups[-1].measured_step_s == pytest.approx(true_colocate, rel=0.1)


def test_a_workload_shift_re_plans_to_the_plan_that_is_now_faster():
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 140, params_at=lambda s: SLOW_DECODE if s > 60 else TRUE)
    assert layouts[55] == COLOCATE
    replan = [d for d in decisions if d.kind == "replan"]
    assert replan and replan[0].switch and replan[0].chosen == DISAGG and replan[0].step > 60
    assert replan[0].drift > planner.drift_threshold and "drifted" in replan[0].reason
    # only generation slowed: not a machine-wide change, so the model was refitted, not rescaled
    assert "speed_factor" not in replan[0].extra and replan[0].extra["work_change"] < 0.2
    assert replan[0].extra["gain"] >= planner.min_gain
    assert layouts[140] == DISAGG
    event = replan[0].to_event()
    assert event["switch"] and event["plan"] == "disaggregated 1 rollout / 1 train"
    assert {c["plan"] for c in event["candidates"]} == {"colocate", "disaggregated 1 rollout / 1 train"}


def slower(p: CostParams, factor: float) -> CostParams:
    """The same machine `factor` times slower at everything (another job took its cores)."""
    return replace(p, **{f: getattr(p, f) * factor for f in ("gen_fixed_s", "gen_step_s", "gen_token_s",
                                                            "reward_sample_s", "train_fixed_s",
                                                            "train_token_s", "sync_fixed_s")})


def test_a_machine_wide_slowdown_keeps_the_plan_and_says_why():
    # every phase twice as slow on the same work moves every plan alike: no reason to switch (a
    # refit beside the other plan's old, fast steps used to predict it 11% faster and switch)
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 140, params_at=lambda s: slower(TRUE, 2.0) if s > 60 else TRUE)
    assert layouts[60] == COLOCATE and all(layouts[s] == COLOCATE for s in range(60, 141))
    kept = [d for d in decisions if d.kind == "kept" and d.step > 60]
    assert kept and not any(d.switch for d in decisions if d.step > 60)
    assert kept[0].extra["speed_factor"] == pytest.approx(2.0, rel=0.15)
    assert kept[0].extra["work_change"] < 0.2 and "machine's speed" in kept[0].reason


def test_responses_growing_a_long_tail_re_plan_for_the_work():
    # the same machine; from step 60 the longest of 128 responses is 40× their mean instead of
    # their mean: generation waits for the tail, and overlapping it with training now pays
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 140, tail_at=lambda s: 40.0 if s > 60 else 1.0)
    assert layouts[60] == COLOCATE
    replan = [d for d in decisions if d.kind == "replan" and d.switch]
    assert replan and replan[0].chosen == DISAGG and replan[0].step > 60 and layouts[140] == DISAGG
    assert replan[0].extra["work_change"] > 1.0 and "the work changed" in replan[0].reason


def test_generation_growing_under_dynamic_sampling_compares_the_plans_again_and_says_why():
    # as the policy learns, more groups come back all right and dynamic sampling generates for
    # more prompts per step (here 1× → 1.8× from step 40 to 140) while it trains on the same 16:
    # generation is a small part of this step, so the measured phase times stay within the drift
    # threshold of the prediction (the old trigger never fired), but the work is not the one the
    # plan was chosen for, and the plans are compared again on it
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 200,
                               oversample_at=lambda s: 1.0 + 0.8 * min(1.0, max(0.0, (s - 40) / 100)))
    initial = next(d for d in decisions if d.kind == "initial")
    again = [d for d in decisions if d.step > initial.step + 6]
    assert again and all(d.kind == "kept" and d.chosen == COLOCATE for d in again)
    first = again[0]
    assert first.step > 40 and first.extra["trigger"] == "work"
    assert first.drift < planner.drift_threshold < first.extra["work_change"]
    assert first.extra["work_driver"] == "tokens/generated"
    assert first.extra["work_after"] > first.extra["work_before"] * (1 + planner.drift_threshold)
    assert "tokens/generated" in first.reason and "compared again on the work done now" in first.reason
    # predicted on the work done now: colocate's prediction is within 10% of what it measures
    true_now = [c for c in planner.checks if c["step"] == first.step][0]
    assert true_now["model_error"] < 0.1
    assert all(layouts[s] == COLOCATE for s in range(initial.step + 6, 201))
    # the checks between decisions saw the work grow without deciding anything
    assert any(c["work_change"] < planner.drift_threshold and c["step"] > 40 for c in planner.checks)


# Two shifts of one part of the step, from step 60: responses three times longer, and generating
# them costs more per token (attention over longer contexts: a 1-device rollout pool pays it twice
# over, so colocate stays fastest) or more per decode step (a slower decoder: every device pays
# it once, so overlapping it with training on the other device wins). Training scales with its
# tokens only. Measured on colocate alone, the two look alike.
PER_TOKEN = replace(TRUE, gen_token_s=4 * TRUE.gen_token_s)
PER_DECODE_STEP = replace(TRUE, gen_step_s=15 * TRUE.gen_step_s)


@pytest.mark.parametrize(("after", "fastest"), [(PER_TOKEN, COLOCATE), (PER_DECODE_STEP, DISAGG)],
                         ids=["per-token", "per-decode-step"])
def test_a_shift_of_one_phase_predicts_both_plans_from_new_steps_and_settles_on_the_fastest(after, fastest):
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 140, params_at=lambda s: after if s > 60 else TRUE,
                               length_at=lambda s: 3.0 if s > 60 else 1.0)
    assert layouts[60] == COLOCATE
    w = Workload(16, 8, LengthDist(15), 8, 4e6)
    truth = {lay: phase_times(after, w, lay).step for lay in (COLOCATE, DISAGG)}
    assert min(truth, key=truth.get) == fastest and layouts[140] == fastest
    # once both plans are measured after the shift, the model predicts both within 5% of the truth
    # (refitted on their new steps only; a refit beside disaggregated's steps from before the shift
    # predicted it 25% too fast per token, switched to it and had to switch back)
    for lay in (COLOCATE, DISAGG):
        assert phase_times(planner.params, w, lay).step == pytest.approx(truth[lay], rel=0.05)
    # the first move off colocate after the shift measures the other plan: the model cannot tell
    # per-token from per-decode-step on colocate's steps alone, and the event says so
    left = next(d for d in decisions if d.step > 60 and d.switch)
    assert left.kind == "replan" and left.extra["reprofile"] and "re-profile" in left.reason
    assert left.extra["model_update"] == "per_phase" and 58 <= left.extra["stale_before_step"] <= 62
    assert left.measured_step_s == pytest.approx(truth[COLOCATE], rel=0.1)  # steps since the shift
    ranges = {p["plan"]: p["predicted_range_s"] for p in left.predictions}
    lo, hi = ranges["disaggregated 1 rollout / 1 train"]
    assert lo <= truth[DISAGG] * 1.05 and hi >= truth[DISAGG] * 0.95  # the truth is in the range
    # the last event's predictions (on the mean work of its 4 steps, whose lengths vary ±20%)
    last = [d for d in decisions if d.step > 60 and d.predictions][-1]
    assert last.kind == "measured"
    preds = {p["mode"]: p["predicted_step_s"] for p in last.predictions}
    assert preds["colocate"] == pytest.approx(truth[COLOCATE], rel=0.1)
    assert preds["disaggregated"] == pytest.approx(truth[DISAGG], rel=0.1)
    assert min(preds, key=preds.get) == fastest.mode
    # one re-profile settles it: at most a switch there and one back
    assert sum(d.switch for d in decisions if d.step > 60) <= 2


def test_a_shift_that_no_attribution_makes_worth_a_switch_is_kept_without_measuring():
    # training got 4× slower per token: disaggregated's one training device pays it twice over
    # whichever way it is attributed; the old refit beside disaggregated's pre-shift steps
    # predicted it 3.43 s/step (truth 13.4) and switched, to be reverted
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    slow_train = replace(TRUE, train_token_s=4 * TRUE.train_token_s)
    decisions, layouts = drive(planner, 140, params_at=lambda s: slow_train if s > 60 else TRUE)
    assert all(layouts[s] == COLOCATE for s in range(20, 141))
    kept = [d for d in decisions if d.kind == "kept" and d.step > 60]
    assert kept and kept[0].extra["model_update"] == "per_phase"
    w = Workload(16, 8, LengthDist(5), 8, 4e6)
    lo, hi = next(p["predicted_range_s"] for p in kept[0].predictions if p["mode"] == "disaggregated")
    assert lo > phase_times(slow_train, w, COLOCATE).step  # slower under every attribution


def test_a_gain_below_the_threshold_is_kept_and_rate_limited():
    planner = AutoPlanner(cfg(replan_min_gain=0.3), param_bytes=4e6)
    decisions, layouts = drive(planner, 200, params_at=lambda s: SLOW_DECODE if s > 60 else TRUE)
    assert not [d for d in decisions if d.kind == "replan"]
    kept = [d for d in decisions if d.kind == "kept"]
    assert any("below placement.replan_min_gain" in d.reason for d in kept)
    assert all(not d.switch for d in kept) and layouts[200] == COLOCATE
    # rate-limited: at most one "kept" per 3 checks, each check re-anchors the prediction
    assert all(b.step - a.step >= 30 for a, b in zip(kept, kept[1:], strict=False))


def test_no_switch_when_fewer_than_replan_every_steps_remain():
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    planner.max_steps = 100
    decisions, layouts = drive(planner, 100, params_at=lambda s: SLOW_DECODE if s > 88 else TRUE)
    kept = [d for d in decisions if d.kind == "kept"]
    assert kept and "only" in kept[0].reason and layouts[100] == COLOCATE
    assert kept[0].extra["switch_cost_s"] == 30.0 and kept[0].extra["saved_s"] > 0


def test_only_plans_that_fit_are_profiled_or_chosen():
    planner = AutoPlanner(cfg(), param_bytes=4e6, candidates=[(COLOCATE, True), (DISAGG, False)])
    decisions, layouts = drive(planner, 140, params_at=lambda s: SLOW_DECODE if s > 60 else TRUE)
    assert decisions[0].kind == "initial" and not decisions[0].switch
    assert all(lay == COLOCATE for lay in layouts.values())
    assert all(not p["fits"] for d in decisions for p in d.predictions if p["mode"] == "disaggregated")


def test_colocate_that_does_not_fit_starts_in_the_first_plan_that_does():
    assert starting_layout(cfg(), [(COLOCATE, False), (DISAGG, True)]) == DISAGG
    with pytest.raises(ConfigError, match="no candidate plan fits"):
        starting_layout(cfg(), [(COLOCATE, False), (DISAGG, False)])


def test_prompt_shards_continue_across_a_change_of_world_size():
    from trainer.controller import PromptShards

    examples = list(range(24))
    two = [PromptShards(examples, rank=r, world=2, shards=2, seed=3) for r in range(2)]
    seen = two[0].take(5) + two[1].take(5)
    positions = {**two[0].positions(), **two[1].positions()}  # what the checkpoint merges
    one = PromptShards(examples, rank=0, world=1, shards=2, seed=3)
    one.load_positions(positions)
    seen += one.take(8)
    back = [PromptShards(examples, rank=r, world=2, shards=2, seed=3) for r in range(2)]
    for b in back:
        b.load_positions(one.positions())
    seen += back[0].take(3) + back[1].take(3)
    assert sorted(seen) == examples  # one epoch: every prompt exactly once, none skipped
    # with as many shards as ranks it is the plain per-rank stream
    from trainer.controller import PromptStream

    assert PromptShards(examples, rank=1, world=2, shards=2, seed=3).take(7) == \
        PromptStream(examples, rank=1, world=2, seed=3).take(7)


def test_a_switch_that_measures_slower_is_reverted_once():
    # the planner is told disaggregated got faster, but measuring it shows the opposite
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 40)
    assert layouts[40] == COLOCATE
    wrong = [{**p, "predicted_step_s": 0.1} if p["layout"] == DISAGG else p
             for p in planner._predictions(planner.params, planner._recent(COLOCATE, 4))]
    planner._decide("replan", 40, DISAGG, wrong, "test: a wrong prediction", predicted=0.1)
    planner.switched(DISAGG, 40)
    rng = random.Random(1)
    after = []
    for step in range(41, 120):
        after += planner.observe(step, measured(TRUE, planner.layout, rng), now=0.0)
        if planner.pending is not None:
            planner.switched(planner.pending, step)
    reverts = [d for d in after if d.kind == "replan" and d.switch]
    assert len(reverts) == 1 and reverts[0].chosen == COLOCATE and "switching back" in reverts[0].reason
    assert planner.layout == COLOCATE
    # back on colocate, the checks compare with what colocate measured, not with the prediction
    # for the plan it left: the steady workload drifts nowhere
    later = [c for c in planner.checks if c["step"] > reverts[0].step]
    assert len(later) >= 3 and all(c["drift"] < planner.drift_threshold for c in later)
    assert not [d for d in after if d.step > reverts[0].step and d.kind in ("kept", "replan")]


def test_slow_decode_spec_per_step_per_token_and_shifting_twice():
    from types import SimpleNamespace

    from trainer.rollout.decode_delay import decode_delay_s

    samples = [SimpleNamespace(response_ids=[1] * n) for n in (2, 5, 3)]
    assert decode_delay_s(9, samples, "10:0.5") == 0.0
    assert decode_delay_s(10, samples, "10:0.5") == 2.5  # the longest response: 5 decode steps
    assert decode_delay_s(10, samples, "10:0.5:token") == 5.0  # 10 generated tokens
    assert decode_delay_s(25, samples, "10:0.5:token,20:0.1") == pytest.approx(0.5)  # the later one
    assert decode_delay_s(10, samples, "") == 0.0
    with pytest.raises(ValueError, match="YATT_SLOW_DECODE"):
        decode_delay_s(10, samples, "10:fast")


# A reward model that costs 10 ms a sample, and responses with a long tail (the longest of 128 is
# 16× their mean): scoring can hide in the tail, where a device waits for the step's longest one.
SLOW_REWARD_MODEL = replace(TRUE, reward_sample_s=0.01)
PARTIAL = Layout("partial_colocate", 2, reward_devices=2)


def test_candidates_include_partial_colocate_only_when_the_reward_is_a_model():
    rule = cfg()
    model = cfg_with_reward_model()
    assert {lay.mode for lay, _ in candidate_layouts(rule)} == {"colocate", "disaggregated"}
    partial = [lay for lay, _ in candidate_layouts(model) if lay.mode == "partial_colocate"]
    assert [lay.scoring_pool for lay in partial] == [1, 2]
    concrete = layout_config(model, partial[0])
    assert concrete.placement.mode == "partial_colocate" and concrete.placement.reward_devices == 1
    assert plan_placement(concrete, device_type="cpu").reward_devices == [0]


def cfg_with_reward_model(**placement):
    c = cfg(**placement).model_dump()
    c["reward"] = {"kind": "model", "model_path": "/nonexistent/reward-model"}
    return parse_config(c)


def test_auto_chooses_partial_colocate_when_measured_scoring_makes_it_fastest():
    planner = AutoPlanner(cfg_with_reward_model(), param_bytes=4e6)
    decisions, layouts = drive(planner, 80, params_at=lambda s: SLOW_REWARD_MODEL,
                                 tail_at=lambda s: 16)
    initial = next(d for d in decisions if d.kind == "initial")
    preds = {p["plan"]: p["predicted_step_s"] for p in initial.predictions}
    assert min(preds, key=preds.get) == "partial_colocate 2 scoring / 2"
    assert layouts[80] == PARTIAL
    # what the planner predicted is what the true model gives (the fit saw scoring in two modes)
    w = Workload(16, 8, LengthDist.from_mean_max(5, 80, 128), 8, 4e6)
    truth = {lay: phase_times(SLOW_REWARD_MODEL, w, lay).step for lay in (COLOCATE, DISAGG, PARTIAL)}
    assert truth[PARTIAL] < 0.9 * min(truth[COLOCATE], truth[DISAGG])
    assert preds["partial_colocate 2 scoring / 2"] == pytest.approx(truth[PARTIAL], rel=0.1)
    measured_partial = [d for d in decisions if d.kind == "measured" and d.chosen == PARTIAL]
    assert measured_partial and measured_partial[-1].measured_step_s < 0.9 * truth[COLOCATE]
    # the event names the scoring devices
    assert initial.to_event()["chosen"]["reward_devices"] == 2


def test_a_rule_reward_never_plans_partial_colocate_on_the_same_phase_times():
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    decisions, layouts = drive(planner, 80, params_at=lambda s: SLOW_REWARD_MODEL,
                                 tail_at=lambda s: 16)
    assert all(lay.mode != "partial_colocate" for lay in layouts.values())
    assert all(p["mode"] != "partial_colocate" for d in decisions for p in d.predictions)


def _run_reprofile(step_metrics, factor: float, *, stop_on_pending: bool = True):
    """A re-profile from colocate to disaggregated after step 44, the planner steady on colocate
    before it: `step_metrics(layout, f)` makes one step's metrics (`f`: the plan's speed against
    colocate's). Returns the planner and the decisions up to the follow-up."""
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    drive(planner, 40)
    assert planner.layout == COLOCATE and planner.phase == "steady"
    planner.anchor_step = 44  # no drift check in between: the re-profile is what is tested
    for step in range(41, 45):
        planner.observe(step, step_metrics(COLOCATE, 1.0), now=0.0)
    planner.fresh_since = 41  # the shift the re-profile follows
    preds = planner._predictions(planner.params, planner._recent(COLOCATE, 4))
    planner._decide("replan", 44, DISAGG, preds, "test: re-profile", switch_cost={"reprofile": True})
    planner._reprofiling = True
    planner.switched(DISAGG, 44)
    out = []
    for step in range(45, 60):
        out += planner.observe(step, step_metrics(DISAGG, factor), now=0.0)
        if (stop_on_pending and planner.pending is not None) or any(d.kind == "measured" for d in out):
            break
    return planner, out


def _reprofile(seed: int, factor: float, noise: float = 0.15):
    """A re-profile whose steps are noisy (±`noise`) around colocate's true step time
    (disaggregated's × `factor`): the planner's follow-up."""
    rng = random.Random(seed)
    base = phase_times(TRUE, Workload(16, 8, LengthDist(5), 8, 4e6), COLOCATE).step

    def noisy(layout: Layout, f: float) -> dict[str, float]:
        return {**measured(TRUE, layout, rng), "time/step": base * f * rng.uniform(1 - noise, 1 + noise)}

    return _run_reprofile(noisy, factor)


def test_a_re_profile_of_an_equally_fast_plan_goes_back_whatever_the_noise():
    # two plans of the same speed, ±15% per step, 4 steps each: the alternative's mean came out
    # below the old plan's in about half the seeds, and the re-profile kept it then (no margin)
    faster_by_noise = 0
    for seed in range(10):
        planner, out = _reprofile(seed, factor=1.0)
        m = next(d for d in out if d.kind == "measured")
        assert m.extra["reprofile"] and m.extra["reprofile_kept"] is False
        assert m.extra["noise_margin_s"] > 0 and "noise margin" in m.reason
        faster_by_noise += m.measured_step_s < m.extra["left_step_s"]
        back = [d for d in out if d.kind == "replan"]
        assert len(back) == 1 and back[0].chosen == COLOCATE and planner.pending == COLOCATE
        assert "by more than the noise margin" in back[0].reason
        assert back[0].extra["noise_margin_s"] == m.extra["noise_margin_s"]
    assert faster_by_noise >= 3  # the old rule would have kept the alternative in these


def test_a_re_profile_that_measures_clearly_faster_is_kept():
    for seed in range(10):
        planner, out = _reprofile(seed, factor=0.7)
        m = next(d for d in out if d.kind == "measured")
        assert m.extra["reprofile_kept"] is True
        assert m.extra["left_step_s"] - m.measured_step_s > m.extra["noise_margin_s"]
        assert not [d for d in out if d.kind == "replan"] and planner.pending is None
        assert planner.layout == DISAGG


def test_the_noise_margin_is_two_standard_errors_of_the_difference():
    from trainer.placement.auto import _noise_margin

    # Welch: sqrt(var_a / n_a + var_b / n_b), sample variances 1/6 and 2/3
    assert _noise_margin([1.0, 2.0, 1.5, 1.5], [3.0, 1.0, 2.0, 2.0]) == pytest.approx(
        2 * ((1 / 6) / 4 + (2 / 3) / 4) ** 0.5)
    assert _noise_margin([1.0], [1.0, 2.0]) == pytest.approx(2 * (0.5 / 1 + 0.5 / 2) ** 0.5)
    assert _noise_margin([1.0], [2.0]) == 0.0


def test_a_revert_judged_on_steps_from_before_a_shift_is_checked_and_undone():
    # A re-profile decided before a shift measures the other plan after it: the old rule compared
    # disaggregated's new (slower) steps with colocate's old ones and went back for good, anchored
    # on colocate's old steps (seen in CI: "colocate measured 1.239 s/step, not faster than 0.043
    # s/step of disaggregated"). Back on colocate, its steps no longer measure what the revert went
    # by; the two plans' steps since the shift say disaggregated is faster (a slower decoder).
    planner = AutoPlanner(cfg(), param_bytes=4e6)
    drive(planner, 40)
    assert planner.layout == COLOCATE and planner.phase == "steady"
    planner.anchor_step = 44
    rng = random.Random(3)
    for step in range(41, 45):
        planner.observe(step, measured(TRUE, COLOCATE, rng), now=0.0)
    planner.fresh_since = 41
    preds = planner._predictions(planner.params, planner._recent(COLOCATE, 4))
    planner._decide("replan", 44, DISAGG, preds, "test: re-profile", switch_cost={"reprofile": True})
    planner._reprofiling = True
    planner.switched(DISAGG, 44)
    out, layouts = [], {}
    for step in range(45, 141):  # the shift: from step 45 on, generation is per-decode-step bound
        layouts[step] = planner.layout
        out += planner.observe(step, measured(PER_DECODE_STEP, planner.layout, rng, length=3.0), now=0.0)
        if planner.pending is not None:
            planner.switched(planner.pending, step)
    w = Workload(16, 8, LengthDist(15), 8, 4e6)
    truth = {lay: phase_times(PER_DECODE_STEP, w, lay).step for lay in (COLOCATE, DISAGG)}
    assert truth[DISAGG] < truth[COLOCATE] / 1.2 < phase_times(TRUE, w, COLOCATE).step * 10
    switches = [d for d in out if d.switch]
    # the stale revert still happens (nothing could tell yet) ...
    assert switches[0].chosen == COLOCATE and "switching back" in switches[0].reason
    assert switches[0].predicted_step_s < truth[DISAGG]  # it went by colocate's steps before the shift
    # ... and is undone at its follow-up, once colocate measured after the shift too
    undo = switches[1]
    assert undo.kind == "replan" and undo.chosen == DISAGG and undo.extra["stale_revert"]
    assert "the workload shifted" in undo.reason and undo.drift > planner.drift_threshold
    assert undo.measured_step_s == pytest.approx(truth[COLOCATE], rel=0.1)
    assert undo.predicted_step_s == pytest.approx(truth[DISAGG], rel=0.1)
    # then it stays: the checks compare with what the plans measured after the shift
    assert len(switches) == 2 and all(layouts[s] == DISAGG for s in range(undo.step + 1, 141))
    assert not [d for d in out if d.step > undo.step and d.kind in ("kept", "replan")]


def test_a_shift_two_steps_before_a_check_compares_the_re_profile_with_steps_after_it_only():
    # The check at step 50 sees 8 steps from before a slower decoder and 2 after. The re-profile it
    # started compared disaggregated with colocate's last 3 steps, one of them from before the
    # shift: their mean came out below colocate's step time and their spread made a noise margin
    # no measurement clears, so a plan 24% faster was sent back (seen on a real run: colocate 0.404
    # s/step "not faster than 0.509 s/step of disaggregated", which measured 0.739 after). With
    # the 2 steps after the shift alone it was kept in 4 seeds of 6: their work varies ±20%. The
    # check now waits for `profile_steps` steps after the shift, and compares with those.
    w = Workload(16, 8, LengthDist(15), 8, 4e6)
    truth = {lay: phase_times(PER_DECODE_STEP, w, lay).step for lay in (COLOCATE, DISAGG)}
    for seed in range(6):
        planner = AutoPlanner(cfg(), param_bytes=4e6)
        drive(planner, 40)
        assert planner.layout == COLOCATE and planner.phase == "steady"
        planner.anchor_step = 40
        rng = random.Random(seed)
        out, layouts = [], {}
        for step in range(41, 141):
            layouts[step] = planner.layout
            shifted = step >= 49
            out += planner.observe(step, measured(PER_DECODE_STEP if shifted else TRUE, planner.layout,
                                                  rng, length=3.0 if shifted else 1.0), now=0.0)
            if planner.pending is not None:
                planner.switched(planner.pending, step)
        assert any(c["step"] == 50 and c.get("deferred") for c in planner.checks)
        move = next(d for d in out if d.switch)
        assert move.step == 52 and move.chosen == DISAGG and move.extra["stale_before_step"] == 49
        m = next(d for d in out if d.kind == "measured")
        assert m.extra["left_steps"] == 4  # steps 49-52: colocate after the shift
        assert m.extra["left_step_s"] == pytest.approx(truth[COLOCATE], rel=0.1)
        assert m.extra["reprofile_kept"] is True, seed
        assert sum(d.switch for d in out) == 1 and all(layouts[s] == DISAGG for s in range(m.step + 1, 141))


def test_a_check_waits_for_no_more_steps_after_a_shift_than_its_window_holds():
    # profile_steps 6 over a window of replan_every 4: waiting for 6 steps after the shift in a
    # window of 4 would wait for ever (it did: colocate to step 140); it waits for at most 4
    planner = AutoPlanner(cfg(profile_steps=6, replan_every=4), param_bytes=4e6)
    decisions, layouts = drive(planner, 140, params_at=lambda s: PER_DECODE_STEP if s > 60 else TRUE,
                               length_at=lambda s: 3.0 if s > 60 else 1.0)
    assert layouts[60] == COLOCATE and layouts[140] == DISAGG
    assert next(d for d in decisions if d.step > 60 and d.switch).step <= 70


def _reprofile_under_refills(seed: int, factor: float):
    """A re-profile from colocate to disaggregated under a slow decoder and dynamic sampling: each
    step draws 0–3 refills (another generate call each, and a quarter more samples), so a step's
    time varies 3-fold with its luck. At the same work disaggregated takes `factor` × colocate's
    time (±3%). Returns the `measured` follow-up, the decisions and the raw step times of both plans."""
    rng = random.Random(seed)
    ref = Workload(24, 8, LengthDist(5), 8, 4e6, calls=2.5)
    at_ref = {lay: phase_times(PER_DECODE_STEP, ref, lay).step for lay in (COLOCATE, DISAGG)}

    def step_of(layout: Layout, f: float) -> dict[str, float]:
        r = rng.choice([0, 1, 2, 3])
        m = measured(PER_DECODE_STEP, layout, rng, oversample=1 + 0.25 * r, refills=r)
        # the layout's own time for this step's work, scaled to `f` × colocate's at the same work
        m["time/step"] *= at_ref[COLOCATE] * f / at_ref[layout]
        return m

    planner, out = _run_reprofile(step_of, factor, stop_on_pending=False)
    m = next(d for d in out if d.kind == "measured")
    raw = {lay: [o.get("time/step") for o in planner.obs if o.layout == lay and 41 <= planner._step_of(o)]
           for lay in (COLOCATE, DISAGG)}
    return m, out, raw


def test_a_re_profile_under_dynamic_sampling_compares_the_plans_at_the_same_work():
    # Raw step times under refills spread so widely that a plan 20% faster at the same work cleared
    # the noise margin in few seeds (and lost on the raw means in some): in the demo's
    # slow-decoder run the margin was 35% of the step. Scaled to the same work by the model, which
    # reads a refill as another generate call, it is kept in every seed.
    from trainer.placement.auto import _mean, _noise_margin

    raw_kept = 0
    for seed in range(10):
        m, out, raw = _reprofile_under_refills(seed, factor=0.8)
        assert m.extra["work_adjusted"] is True, seed
        assert m.extra["reprofile_kept"] is True, seed
        assert "at the same work" in m.reason
        # (0.80–0.90 of colocate: the model reads the work, not the test's factor on the step time)
        assert m.extra["step_at_common_work_s"] < 0.95 * m.extra["left_step_at_common_work_s"]
        # the margin left is a few % of the step; on the raw step times it was 24–53%
        assert m.extra["noise_margin_s"] < 0.1 * m.extra["left_step_at_common_work_s"]
        assert not [d for d in out if d.kind == "replan"]
        left, here = raw[COLOCATE][-4:], raw[DISAGG][-4:]
        raw_kept += _mean(left) - _mean(here) > _noise_margin(left, here)
    assert raw_kept <= 3  # what the raw comparison would have kept (2 of the 10)


def test_a_re_profile_of_an_equally_fast_plan_under_dynamic_sampling_still_goes_back():
    kept = 0
    for seed in range(10):
        m, out, _raw = _reprofile_under_refills(seed, factor=1.0)
        kept += m.extra["reprofile_kept"]
        if not m.extra["reprofile_kept"]:
            back = [d for d in out if d.kind == "replan"]
            assert len(back) == 1 and back[0].chosen == COLOCATE
    assert kept <= 1
