"""The cost model's link term from measured broadcasts (trainer/placement/link.py)."""

from __future__ import annotations

import math
import random

import pytest

from trainer.placement.cost_model import CostParams, Layout, LengthDist, Workload, phase_times
from trainer.placement.link import calibrate_link, load_link_calibration


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
