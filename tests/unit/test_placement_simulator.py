"""The placement simulator and `yatt placement simulate`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from backend.cli import app
from trainer.placement.cost_model import CostParams, Layout, LengthDist, Workload, phase_times
from trainer.placement.simulator import simulate

P = CostParams(gen_fixed_s=0.1, gen_step_s=0.01, gen_token_s=1e-4, reward_sample_s=1e-3,
               ref_token_s=1e-5, train_token_s=3e-5, train_fixed_s=0.1, sync_fixed_s=0.05,
               overhead_s=0.1)


def test_flat_lengths_colocate_matches_the_analytic_model_and_idles_only_in_overhead():
    w = Workload(64, 8, LengthDist(100, 0.0), 50, 1e8)
    layout = Layout("colocate", 8)
    sim = simulate(P, w, layout, steps=5)
    assert sim.step_s == pytest.approx(phase_times(P, w, layout).step, rel=1e-6)
    assert sim.idle_frac == pytest.approx(P.overhead_s / sim.step_s)  # the driver's share only


def test_a_lopsided_split_shows_idle_devices():
    w = Workload(64, 8, LengthDist(100, 0.0), 50, 1e8)
    # 7 devices generate, 1 trains: the trainer waits for the rollouts and idles most of the step
    lopsided = simulate(P, w, Layout("disaggregated", 8, rollout_devices=1), steps=10)
    assert lopsided.idle_frac > 0.3
    balanced = simulate(P, w, Layout("disaggregated", 8, rollout_devices=4), steps=10)
    assert balanced.idle_frac < lopsided.idle_frac


def test_long_tail_leaves_devices_idle_and_streamed_scoring_uses_them():
    w = Workload(64, 8, LengthDist(100, 1.2, cap=2000), 50, 1e8)
    slow_rm = CostParams(**{**P.__dict__, "reward_sample_s": 0.02})
    colo = simulate(slow_rm, w, Layout("colocate", 16), steps=10)
    assert colo.idle_frac > 0.1
    part = simulate(slow_rm, w, Layout("partial_colocate", 16, reward_devices=8), steps=10)
    assert part.rollout_s < colo.rollout_s


def test_simulate_cli_prints_the_table_and_writes_plots(tmp_path):
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, ["placement", "simulate", "--model-size", "7b", "--devices", "8,64,1024",
                                 "--steps", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "colocate" in r.output and "disaggregated" in r.output and "idle" in r.output
    rows = json.loads((out / "simulate.json").read_text())["rows"]
    assert {(x["mode"], x["devices"]) for x in rows} >= {("colocate", 8), ("disaggregated", 1024)}
    for name in ("step_time.png", "throughput.png", "idle_fraction.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    by = {(x["mode"], x["devices"]): x for x in rows}
    assert by[("colocate", 1024)]["step_s"] < by[("colocate", 8)]["step_s"]
    bad = CliRunner().invoke(app, ["placement", "simulate", "--modes", "auto", "--out", str(out)])
    assert bad.exit_code == 2 and "--modes" in bad.output


def test_simulate_cli_takes_a_measured_link_term(tmp_path):
    """`--link` replaces the H100 profile's network with a calibrated link: a 7B policy (15.2 GB)
    over a 1 GB/s link costs a disaggregated step 15.2 s instead of 0.4 s over 40 GB/s (once:
    both sides of the step wait for the same push)."""
    from trainer.placement.link import calibrate_link

    link = tmp_path / "link.json"
    link.write_text(calibrate_link([(1e8, 0.15), (1e9, 1.05)]).to_json())  # 50 ms + 1 GB/s
    args = ["placement", "simulate", "--model-size", "7b", "--devices", "8", "--modes", "disaggregated",
            "--steps", "4"]
    base = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")])
    slow = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), "--link", str(link)])
    assert base.exit_code == 0 and slow.exit_code == 0, base.output + slow.output
    step = {d: json.loads((tmp_path / d / "simulate.json").read_text())["rows"][0]["step_s"] for d in "ab"}
    assert step["b"] - step["a"] == pytest.approx(15.2 - 15.2 / 40, rel=0.05)
    assert "link term from" in slow.output
