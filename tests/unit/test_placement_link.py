"""The cost model's link term from measured broadcasts (trainer/placement/link.py)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from trainer.config import ConfigError, parse_config
from trainer.placement.cost_model import (
    CostParams,
    Layout,
    LengthDist,
    OnlineFit,
    StepObservation,
    Workload,
    fit,
    phase_times,
)
from trainer.placement.link import calibrate_link, config_link_calibration, load_link_calibration


def _broadcasts(fixed_s: float, bandwidth: float, sizes: list[float], noise: float, rounds: int = 5):
    rng = random.Random(0)
    return [(b, (fixed_s + b / bandwidth) * (1 + rng.uniform(-noise, noise)))
            for b in sizes for _ in range(rounds)]


def test_two_policy_sizes_separate_the_fixed_cost_of_a_round_from_the_bandwidth() -> None:
    # 4 MB and 70 MB policies over a 0.2 GB/s link with 25 ms per round, 3% noise per broadcast
    cal = calibrate_link(_broadcasts(0.025, 2e8, [4.2e6, 70e6], noise=0.03))
    assert cal.sync_fixed_s == pytest.approx(0.025, rel=0.25)
    assert cal.sync_link_Bps == pytest.approx(2e8, rel=0.05)
    assert cal.error < 0.03
    # the small policy's time is half fixed cost: the large one's bandwidth alone halves it
    assert cal.seconds(4.2e6) == pytest.approx(0.025 + 4.2e6 / 2e8, rel=0.05)
    bandwidth_only = calibrate_link(_broadcasts(0.025, 2e8, [70e6], noise=0.03))
    assert bandwidth_only.seconds(4.2e6) < 0.6 * cal.seconds(4.2e6)


def test_one_size_puts_the_whole_time_on_the_bandwidth() -> None:
    cal = calibrate_link([(70e6, 0.30), (70e6, 0.34)])
    assert cal.sync_fixed_s == 0.0
    assert cal.sync_link_Bps == pytest.approx(70e6 / 0.32)
    assert cal.error == pytest.approx(0.02 / 0.32)


def test_a_time_that_does_not_grow_with_bytes_is_an_infinitely_fast_link() -> None:
    cal = calibrate_link([(1e6, 0.05), (1e8, 0.05)])
    assert math.isinf(cal.sync_link_Bps) and cal.sync_fixed_s == pytest.approx(0.05)
    assert cal.seconds(1e9) == pytest.approx(0.05)


def test_applied_calibration_is_the_link_sync_of_a_disaggregated_step(tmp_path) -> None:
    cal = calibrate_link(_broadcasts(0.01, 1e8, [4e6, 64e6], noise=0.0), source={"load_1min": 1.0})
    fitted = CostParams(gen_fixed_s=0.1, gen_step_s=0.01, train_fixed_s=0.05, train_token_s=1e-5,
                        sync_fixed_s=0.002, sync_link_Bps=5e9)
    w = Workload(prompts=16, n=8, response=LengthDist(4.0), prompt_tokens=6, param_bytes=4e6)
    p = cal.apply(fitted)
    pt = phase_times(p, w, Layout("disaggregated", 2))
    assert cal.seconds(4e6) == pytest.approx(0.05)
    assert pt.weight_sync == pytest.approx(cal.seconds(4e6))
    assert pt.rollout_side == pytest.approx(pt.rollout + cal.seconds(4e6))
    assert p.gen_fixed_s == fitted.gen_fixed_s and p.train_token_s == fitted.train_token_s
    # written and read back as bench/weight_sync.py and placement_calibration.py do
    path = tmp_path / "link.json"
    path.write_text(cal.to_json())
    back = load_link_calibration(path)
    assert (back.sync_fixed_s, back.sync_link_Bps) == pytest.approx((cal.sync_fixed_s, cal.sync_link_Bps))
    assert back.source == {"load_1min": 1.0} and len(back.measurements) == 10
    path.write_text(calibrate_link([(1e6, 0.05), (1e8, 0.05)]).to_json())
    assert math.isinf(load_link_calibration(path).sync_link_Bps)


@pytest.mark.parametrize("bad", [[], [(0.0, 0.1)], [(1e6, -0.1)], [(1e6, float("nan"))]])
def test_refuses_what_is_not_a_broadcast(bad) -> None:
    with pytest.raises(ValueError):
        calibrate_link(bad)


# This machine's link as bench/weight_sync.py --two-nodes measured it (docs/placement.md)
LINK_FIXED_S, LINK_BPS = 0.0345, 8.4e8
MICRO, SMALL = 4.2e6, 70e6  # the demo's policy and the `small` preset's, in bytes
RUN = CostParams(gen_fixed_s=0.05, gen_step_s=0.02, gen_token_s=0.001, train_fixed_s=0.05,
                 train_token_s=0.002, reward_sample_s=0.0005, sync_fixed_s=LINK_FIXED_S,
                 sync_link_Bps=LINK_BPS)


def _run_steps(params: CostParams, layout: Layout, steps: int, rng: random.Random,
               noise: float = 0.1) -> list[dict[str, float]]:
    """A run's combined metrics per step, of one policy size (MICRO), each phase ±`noise`."""
    out = []
    for _ in range(steps):
        mean = rng.uniform(4, 6)
        w = Workload(16, 8, LengthDist.from_mean_max(mean, mean * 1.5, 128), 8, MICRO)
        pt = phase_times(params, w, layout)

        def jitter(x: float) -> float:
            return x * (1 + rng.uniform(-noise, noise))

        out.append({"time/step": jitter(pt.step), "time/rollout": jitter(pt.rollout),
                    "time/reward": jitter(pt.reward), "time/train": jitter(pt.train),
                    "time/weight_sync": jitter(pt.weight_sync), "time/reference": 0.0,
                    "tokens/generated": w.gen_tokens, "tokens/trained": w.train_tokens,
                    "response/length_mean": mean, "response/length_max": w.response.expected_max(128)})
    return out


def _sync_s(p: CostParams, nbytes: float) -> float:
    w = Workload(16, 8, LengthDist(5.0), 8, nbytes)
    return phase_times(p, w, Layout("disaggregated", 2)).weight_sync


@pytest.mark.parametrize("run_extra_s", [0.0, 0.005], ids=["same-rounds", "run-rounds-5ms-dearer"])
def test_a_calibration_keeps_the_split_a_run_of_one_policy_size_cannot_see(run_extra_s) -> None:
    # the bench's broadcasts of two sizes (10% noise); the run's rounds may cost a little more
    # than the bench's (its own Ray call): that is the run's fixed term, the bandwidth is the link's
    cal = calibrate_link(_broadcasts(LINK_FIXED_S, LINK_BPS, [MICRO, SMALL], noise=0.1))
    truth = replace(RUN, sync_fixed_s=LINK_FIXED_S + run_extra_s)
    layout = Layout("disaggregated", 2, rollout_devices=1)
    steps = _run_steps(truth, layout, 30, random.Random(1))
    plain = OnlineFit(layout, param_bytes=MICRO)
    calibrated = OnlineFit(layout, param_bytes=MICRO, link=cal)
    for i, m in enumerate(steps):
        plain.observe(i + 1, m)
        reported = calibrated.observe(i + 1, m)
    assert plain.result is not None and calibrated.result is not None
    want = _sync_s(truth, SMALL)  # a 70 MB policy over the same link: 122-128 ms
    # the run's own sync fit puts everything in the fixed term: 70 MB predicted as 4 MB
    assert math.isinf(plain.result.params.sync_link_Bps)
    assert _sync_s(plain.result.params, SMALL) < 0.4 * want
    # with the calibration: its bandwidth, the run's fixed cost; within 5% at 70 MB
    got = calibrated.result.params
    assert got.sync_link_Bps == cal.sync_link_Bps
    assert got.sync_fixed_s == pytest.approx(LINK_FIXED_S + run_extra_s, rel=0.08)
    assert _sync_s(got, SMALL) == pytest.approx(want, rel=0.05)
    assert _sync_s(got, MICRO) == pytest.approx(_sync_s(truth, MICRO), rel=0.03)  # the run's own size
    assert reported["placement/cost/sync_link_GBps"] == pytest.approx(cal.sync_link_Bps / 1e9)
    # the rest of the fit is the same fit
    assert got.train_token_s == pytest.approx(plain.result.params.train_token_s)


def test_steps_faster_than_the_calibrated_bandwidth_allows_fit_their_own_link() -> None:
    # a calibration from a slower link (0.1 GB/s: 42 ms for 4.2 MB on the bandwidth alone) and a
    # run whose syncs take 20 ms: not that link; its steps decide, as without a calibration
    cal = calibrate_link(_broadcasts(0.01, 1e8, [MICRO, SMALL], noise=0.0))
    layout = Layout("disaggregated", 2, rollout_devices=1)
    obs = [StepObservation(layout, MICRO, m)
           for m in _run_steps(replace(RUN, sync_fixed_s=0.02, sync_link_Bps=math.inf), layout, 12,
                               random.Random(2))]
    p = fit(obs, link=cal).params
    assert p.sync_fixed_s == pytest.approx(0.0, abs=1e-12)
    assert _sync_s(p, MICRO) == pytest.approx(0.02, rel=0.05)


def test_two_policy_sizes_in_the_steps_decide_for_themselves() -> None:
    cal = calibrate_link(_broadcasts(0.2, 1e7, [MICRO, SMALL], noise=0.0))  # far from the truth
    layout = Layout("disaggregated", 2, rollout_devices=1)
    rng = random.Random(3)
    obs = []
    for nbytes in (MICRO, SMALL):
        for m in _run_steps(RUN, layout, 6, rng, noise=0.0):
            w = Workload(16, 8, LengthDist(5.0), 8, nbytes)
            obs.append(StepObservation(layout, nbytes,
                                       {**m, "time/weight_sync": phase_times(RUN, w, layout).weight_sync}))
    p = fit(obs, link=cal).params
    assert p.sync_link_Bps == pytest.approx(LINK_BPS, rel=1e-6)
    assert p.sync_fixed_s == pytest.approx(LINK_FIXED_S, rel=1e-6)


def test_the_auto_planner_predicts_a_larger_policy_with_the_config_calibration(tmp_path) -> None:
    from trainer.placement.auto import AutoPlanner

    path = tmp_path / "link-calibration.json"
    path.write_text(calibrate_link(_broadcasts(LINK_FIXED_S, LINK_BPS, [MICRO, SMALL], noise=0.1)).to_json())
    # in place the sync costs more than over the link, as on this machine (colocate 46-175 ms,
    # disaggregated 36-100 ms in one auto run): loading into the colocated engine at 0.1 GB/s
    truth = replace(RUN, sync_local_Bps=1e8)
    rng = random.Random(4)
    planners = {}
    for name, extra in (("plain", {}), ("calibrated", {"link_calibration": str(path)})):
        cfg = parse_config({"train": {"max_steps": 100, "batch_size": 16}, "rollout": {"n": 8},
                            "placement": {"mode": "auto", "devices": 2, **extra}})
        planner = AutoPlanner(cfg, param_bytes=MICRO)
        profiled = set()
        for step in range(1, 31):  # the profile: colocate, then disaggregated, then the choice
            profiled.add(planner.layout.mode)
            for m in _run_steps(truth, planner.layout, 1, rng):
                planner.observe(step, m, now=0.0)
            if planner.pending is not None:
                planner.switched(planner.pending, step)
        assert planner.phase == "steady" and profiled == {"colocate", "disaggregated"}
        planners[name] = planner
    assert planners["calibrated"].link is not None and planners["plain"].link is None
    want = _sync_s(truth, SMALL)
    got = planners["calibrated"].params
    assert got is not None and _sync_s(got, SMALL) == pytest.approx(want, rel=0.08)
    assert got.sync_fixed_s == pytest.approx(LINK_FIXED_S, rel=0.1)
    # in place: the model's one fixed term plus the bytes at the in-place bandwidth it fitted
    w = Workload(16, 8, LengthDist(5.0), 8, MICRO)
    assert phase_times(got, w, Layout("colocate", 2)).weight_sync == pytest.approx(
        phase_times(truth, w, Layout("colocate", 2)).weight_sync, rel=0.08)
    # without it, one size's in-place and link syncs split any way least squares lands on: the
    # 70 MB sync is predicted as the 4 MB one (all fixed) or as all bandwidth (5× too slow)
    plain = planners["plain"].params
    assert plain is not None and abs(_sync_s(plain, SMALL) / want - 1) > 0.5


def test_a_calibration_that_cannot_be_read_is_a_config_error_naming_the_field(tmp_path) -> None:
    def cfg(path: str):
        return parse_config({"placement": {"mode": "disaggregated", "link_calibration": path}})

    (tmp_path / "garbage.json").write_text("not json")
    (tmp_path / "other.json").write_text('{"sync_link_Bps": 1e9}')
    (tmp_path / "negative.json").write_text('{"sync_fixed_s": -1, "sync_link_Bps": 1e9}')
    for name, says in (("missing.json", "cannot read"), ("garbage.json", "is not a link calibration"),
                       ("other.json", "missing key 'sync_fixed_s'"), ("negative.json", "must be ≥ 0")):
        with pytest.raises(ConfigError) as exc:
            config_link_calibration(cfg(str(tmp_path / name)))
        assert exc.value.errors[0][0] == "placement.link_calibration" and says in exc.value.errors[0][1]
    with pytest.raises(ConfigError) as exc:
        OnlineFit.for_config(parse_config({"model": {"path": "/nonexistent/m", "preset": "micro"},
                                           "placement": {"link_calibration": str(tmp_path / "x")}}))
    assert exc.value.errors[0][0] == "placement.link_calibration"
    with pytest.raises(ConfigError) as exc:
        cfg("")
    assert exc.value.errors[0][0] == "placement.link_calibration"
    assert config_link_calibration(parse_config({})) is None
    # yatt train refuses it before starting Ray
    from typer.testing import CliRunner

    from backend.cli import app

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("placement:\n  mode: disaggregated\n")
    result = CliRunner().invoke(app, ["train", str(yaml_file), "--set",
                                      f"placement.link_calibration={tmp_path / 'missing.json'}"])
    assert result.exit_code == 2
    assert "config error: placement.link_calibration: cannot read" in result.output
