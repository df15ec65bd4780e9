"""The placement cost model: step time per mode, and a fit that recovers known parameters."""

from __future__ import annotations

import math
import random

import pytest

from trainer.placement.cost_model import (
    CostParams,
    Layout,
    LengthDist,
    StepObservation,
    Workload,
    fit,
    phase_times,
    predict_step_time,
)

TRUE = CostParams(gen_fixed_s=0.3, gen_step_s=0.02, gen_token_s=0.0004, reward_sample_s=0.001,
                  ref_token_s=0.0002, train_token_s=0.0009, train_fixed_s=0.3, allreduce_Bps=2e8,
                  sync_fixed_s=0.01, sync_local_Bps=5e8, sync_link_Bps=1e8, overhead_s=0.07)


def _recorded_steps(rng: random.Random, noise: float) -> list[StepObservation]:
    """Steps as the driver would report them, made from TRUE with multiplicative noise."""
    obs = []
    layouts = [Layout("colocate", 2), Layout("colocate", 4), Layout("disaggregated", 2),
               Layout("disaggregated", 4, rollout_devices=3), Layout("disaggregated", 4),
               Layout("partial_colocate", 4, reward_devices=1), Layout("partial_colocate", 2, reward_devices=2)]
    for layout in layouts:
        for param_bytes in (8e7, 3e8):
            for _ in range(8):
                samples = rng.choice([64, 128, 256])
                mean = rng.uniform(4, 40)
                longest = mean * rng.uniform(1.2, 3.0)
                prompt = rng.uniform(4, 20)
                gen_tokens = samples * mean
                metrics = {"tokens/generated": gen_tokens, "response/length_mean": mean,
                           "response/length_max": longest,
                           "tokens/trained": samples * (mean + prompt)}
                o = StepObservation(layout=layout, param_bytes=param_bytes, metrics=metrics)
                from trainer.placement.cost_model import _phases_of

                pt = _phases_of(TRUE, StepObservation(layout, param_bytes,
                                                      {**metrics, "time/reference": 1.0}))
                def jitter(x: float) -> float:
                    return x * (1 + rng.uniform(-noise, noise))
                metrics.update({"time/rollout": jitter(pt.rollout), "time/reward": jitter(pt.reward),
                                "time/reference": jitter(pt.reference), "time/train": jitter(pt.train),
                                "time/weight_sync": jitter(pt.weight_sync), "time/step": jitter(pt.step)})
                if layout.mode == "partial_colocate":
                    # as the controllers report it: the scorers' time on one rank's share of the
                    # samples, and the scoring the step still waited for after generation
                    metrics["time/reward"] = jitter(TRUE.reward_sample_s * samples / layout.train_pool)
                    metrics["time/reward_wait"] = jitter(pt.reward)
                obs.append(o)
    return obs


def test_fit_recovers_known_parameters_from_recorded_steps():
    result = fit(_recorded_steps(random.Random(0), noise=0.01))
    got = result.params
    for name in ("gen_fixed_s", "gen_step_s", "gen_token_s", "reward_sample_s", "ref_token_s",
                 "train_token_s", "train_fixed_s", "allreduce_Bps", "sync_local_Bps", "sync_link_Bps"):
        want = getattr(TRUE, name)
        assert getattr(got, name) == pytest.approx(want, rel=0.08), name
    assert got.overhead_s == pytest.approx(TRUE.overhead_s, abs=0.03)
    assert result.step_error < 0.03
    assert result.observations == 112
    assert result.by_mode["partial_colocate"]["error"] == pytest.approx(0.0, abs=0.03)
    metrics = result.as_metrics()
    assert metrics["placement/cost/sync_link_GBps"] == pytest.approx(0.1, rel=0.08)
    assert "placement/fit/step_error" in metrics


def test_fit_error_grows_with_measurement_noise():
    quiet = fit(_recorded_steps(random.Random(1), noise=0.01)).step_error
    noisy = fit(_recorded_steps(random.Random(1), noise=0.3)).step_error
    assert noisy > 3 * quiet


def test_disaggregated_overlaps_generation_with_training():
    w = Workload(prompts=64, n=8, response=LengthDist(200, 0.8, cap=1024), prompt_tokens=100,
                 param_bytes=1e9)
    p = TRUE
    colo = phase_times(p, w, Layout("colocate", 8))
    dis = phase_times(p, w, Layout("disaggregated", 8, rollout_devices=6))
    assert dis.step == pytest.approx(max(dis.rollout_side, dis.train_side) + p.overhead_s)
    no_overlap = predict_step_time(p, w, Layout("disaggregated", 8, rollout_devices=6, staleness=0))
    assert no_overlap == pytest.approx(dis.rollout_side + dis.train_side + p.overhead_s)
    assert colo.step == pytest.approx(colo.rollout + colo.reward + colo.reference + colo.train
                                      + colo.weight_sync + colo.offload + colo.overhead)


def test_long_tail_makes_generation_slower_for_the_same_mean():
    flat = Workload(64, 8, LengthDist(200, 0.0), 100, 1e9)
    tail = Workload(64, 8, LengthDist(200, 1.0, cap=4096), 100, 1e9)
    layout = Layout("colocate", 8)
    assert phase_times(TRUE, tail, layout).rollout > 1.5 * phase_times(TRUE, flat, layout).rollout


def test_partial_colocate_hides_scoring_in_the_tail():
    slow_rm = CostParams(**{**TRUE.__dict__, "reward_sample_s": 0.01})
    w = Workload(64, 8, LengthDist(200, 1.0, cap=4096), 100, 1e9)
    colo = phase_times(slow_rm, w, Layout("colocate", 8))
    part = phase_times(slow_rm, w, Layout("partial_colocate", 8, reward_devices=4))
    assert part.rollout + part.reward < colo.rollout + colo.reward


def test_length_distribution_matches_its_longest_response():
    d = LengthDist.from_mean_max(10.0, 30.0, 128)
    assert d.expected_max(128) == pytest.approx(30.0, rel=1e-3)
    xs = d.sample(20000, random.Random(0))
    assert sum(xs) / len(xs) == pytest.approx(10.0, rel=0.05)
    assert LengthDist(10, 2.0, cap=16).expected_max(1000) == 16


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="unknown placement mode"):
        Layout("auto", 2)
    with pytest.raises(ValueError, match="at least 2"):
        Layout("disaggregated", 1)
    assert math.isinf(CostParams().sync_link_Bps)


def test_online_fit_reports_parameters_and_error_per_step_once_it_has_enough():
    from trainer.config import parse_config
    from trainer.placement.cost_model import OnlineFit

    cfg = parse_config({"model": {"path": "/nonexistent/m", "preset": "micro"},
                        "placement": {"mode": "colocate", "devices": 2}})
    online = OnlineFit.for_config(cfg)
    assert online is not None and online.layout == Layout("colocate", 2)
    steps = [o for o in _recorded_steps(random.Random(2), noise=0.01)
             if o.layout == Layout("colocate", 2) and o.param_bytes == 8e7]
    online.param_bytes = 8e7
    reported = [online.observe(i + 1, o.metrics) for i, o in enumerate(steps)]
    assert reported[0] == {} and reported[4] == {}  # warm-up steps are skipped, then 4 are needed
    last = reported[-1]
    assert last["placement/fit/step_error"] < 0.05
    assert last["placement/cost/train_token_s"] > 0
    assert OnlineFit.for_config(parse_config({"model": {"path": "hub/unknown"}})) is None


def _reference_workload() -> Workload:
    return Workload(prompts=4, n=8, response=LengthDist.from_mean_max(160, 256, 32), prompt_tokens=12,
                    param_bytes=7e7)


def test_disaggregated_prediction_hands_the_workers_the_share_of_the_reference_that_evens_the_sides():
    p = CostParams(gen_token_s=0.0015, gen_step_s=0.01, ref_token_s=0.0007, train_token_s=0.002)
    w = _reference_workload()
    home = phase_times(p, w, Layout("disaggregated", 2, rollout_devices=1, reference_on_rollout=0.0))
    auto = phase_times(p, w, Layout("disaggregated", 2, rollout_devices=1, reference_on_rollout=None))
    full = p.ref_token_s * w.train_tokens  # one training device: the whole pass
    assert home.train_side - home.rollout_side > 0 and home.train_side - home.rollout_side < 2 * full
    # the workers take f with rollout_side + f ref = train_side - f ref (one device each side)
    assert auto.rollout_side == pytest.approx(auto.train_side)
    assert auto.step == pytest.approx((home.rollout_side + home.train_side) / 2)
    assert auto.reference == pytest.approx(full - (home.train_side - home.rollout_side) / 2)
    # a fixed share is what it says; generation-bound, auto leaves the reference home
    half = phase_times(p, w, Layout("disaggregated", 2, rollout_devices=1, reference_on_rollout=0.5))
    assert half.reference == pytest.approx(full / 2)
    assert half.rollout_side == pytest.approx(home.rollout_side + full / 2)
    slow_gen = CostParams(gen_token_s=0.03, gen_step_s=0.01, ref_token_s=0.0007, train_token_s=0.002)
    bound = phase_times(slow_gen, w, Layout("disaggregated", 2, rollout_devices=1, reference_on_rollout=None))
    assert bound.reference == pytest.approx(full) and bound.step == pytest.approx(bound.rollout_side)


def test_fit_reads_the_reference_cost_from_the_rows_the_training_devices_passed():
    """Steps whose workers scored some rows: `time/reference` covers the rest only, and the fit
    still recovers the per-token cost (and composes the measured step)."""
    rng = random.Random(3)
    obs = []
    for _ in range(12):
        given = rng.choice([0.0, 0.25, 0.5, 0.8])
        tokens = rng.uniform(3000, 6000)
        metrics = {"tokens/generated": tokens * 0.9, "response/length_mean": 150.0, "response/length_max": 256.0,
                   "tokens/trained": tokens, "reference/given_frac": given,
                   "time/reference": TRUE.ref_token_s * tokens * (1 - given),
                   "time/train": TRUE.train_fixed_s + TRUE.train_token_s * tokens,
                   "time/rollout": 1.0 + 0.0004 * tokens, "time/weight_sync": 0.5, "time/reward": 0.01,
                   "time/step": 5.0}
        obs.append(StepObservation(Layout("disaggregated", 2, rollout_devices=1), 8e7, metrics))
    res = fit(obs)
    assert res.params.ref_token_s == pytest.approx(TRUE.ref_token_s, rel=1e-3)


def test_a_refill_is_another_generate_call_and_the_fit_reads_it():
    # Dynamic sampling refills a step's batch with more generate calls; each pays the fixed cost
    # and decodes to its own longest response again. A decoder slow per decode step makes a step
    # with 3 refills take about 4 times one without, for less than twice the tokens.
    slow = CostParams(gen_fixed_s=0.2, gen_step_s=0.3, gen_token_s=0.0005, train_token_s=0.001)
    lay = Layout("colocate", 2)
    rng = random.Random(5)
    obs = []
    for _ in range(12):
        refills = rng.choice([0, 1, 2, 3])
        samples, mean = 128 * (1 + 0.25 * refills), rng.uniform(8, 12)
        w = Workload(prompts=round(samples / 8), n=8, response=LengthDist(mean), prompt_tokens=8,
                     param_bytes=4e6, calls=1 + refills)
        pt = phase_times(slow, w, lay)
        obs.append(StepObservation(lay, 4e6, {
            "tokens/generated": w.gen_tokens, "tokens/trained": w.train_tokens,
            "response/length_mean": mean, "response/length_max": mean,
            "sampling/refills": refills / 2, "sampling/refills_max": float(refills),
            "time/rollout": pt.rollout, "time/train": pt.train, "time/step": pt.step}))
    one = phase_times(slow, Workload(16, 8, LengthDist(10), 8, 4e6), lay).rollout
    four = phase_times(slow, Workload(32, 8, LengthDist(10), 8, 4e6, calls=4), lay).rollout
    assert four > 3.5 * one
    got = fit(obs).params
    # the step's calls come from the rank that refilled most, not the ranks' mean
    assert got.gen_step_s == pytest.approx(slow.gen_step_s, rel=0.02)
    assert got.gen_fixed_s == pytest.approx(slow.gen_fixed_s, rel=0.05, abs=0.02)
    for o in obs:
        assert phase_times(got, o.workload(), lay).rollout == pytest.approx(o.get("time/rollout"), rel=0.02)
