"""`ReferenceSplit`: the share of the reference pass the rollout workers take, from measured phase
times (trainer/controller.py)."""

from __future__ import annotations

import pytest

from trainer.controller import ReferenceSplit


def _step(split: ReferenceSplit, *, gen: float, other: float, per_row_worker: float, per_row_trainer: float,
          rows: int = 32) -> float:
    """One disaggregated step at the split's current share: the worker generates (gen s) and
    scores its share; the training rank does its other work (other s) and the reference on the rest."""
    worker_rows = split.rows(rows)
    trainer_rows = rows - worker_rows
    return split.observe(worker_rollout_s=gen, worker_reference_s=per_row_worker * worker_rows,
                         worker_rows=rows, worker_reference_rows=worker_rows, workers=1,
                         trainer_busy_s=other + per_row_trainer * trainer_rows,
                         trainer_reference_s=per_row_trainer * trainer_rows,
                         trainer_reference_rows=trainer_rows)


def test_auto_settles_where_both_sides_are_equally_busy():
    # the AVX2 machine's disaggregated step: generation 8.8 s, training 11.2 s, reference 3.7 s
    split = ReferenceSplit("auto", trainer_cores=1, worker_cores=1, warmup=0)
    assert split.share == 0.0 and split.rows(32) == 0
    for _ in range(6):
        share = _step(split, gen=8.8, other=11.2, per_row_worker=3.7 / 32, per_row_trainer=3.7 / 32)
    # 8.8 + 3.7 f = 11.2 + 3.7 (1 - f)  ->  f = 0.824
    assert share == pytest.approx((11.2 + 3.7 - 8.8) / (2 * 3.7), abs=0.02)
    worker = 8.8 + 3.7 * split.rows(32) / 32
    trainer = 11.2 + 3.7 * (32 - split.rows(32)) / 32
    assert abs(worker - trainer) < 0.3  # within one row's cost of even, against 6.4 s apart at f=0


def test_auto_keeps_the_reference_home_when_generation_is_the_longer_side():
    split = ReferenceSplit("auto", trainer_cores=1, worker_cores=1, warmup=0)
    for _ in range(4):
        share = _step(split, gen=12.0, other=4.0, per_row_worker=0.05, per_row_trainer=0.05)
    assert share == 0.0


def test_auto_moves_all_of_it_when_training_alone_outlasts_both():
    split = ReferenceSplit("auto", trainer_cores=1, worker_cores=1, warmup=0)
    for _ in range(4):
        share = _step(split, gen=2.0, other=10.0, per_row_worker=0.05, per_row_trainer=0.05)
    assert share == 1.0


def test_a_slower_worker_gets_a_smaller_share():
    # a worker half as fast at the reference pass: f = (W + bN - R) / (N (a + b))
    fast = ReferenceSplit("auto", trainer_cores=1, worker_cores=1, warmup=0)
    slow = ReferenceSplit("auto", trainer_cores=1, worker_cores=1, warmup=0)
    for _ in range(6):
        f_fast = _step(fast, gen=8.0, other=10.0, per_row_worker=0.1, per_row_trainer=0.1)
        f_slow = _step(slow, gen=8.0, other=10.0, per_row_worker=0.2, per_row_trainer=0.1)
    assert f_fast == pytest.approx((10.0 + 3.2 - 8.0) / (32 * 0.2), abs=0.03)
    assert f_slow == pytest.approx((10.0 + 3.2 - 8.0) / (32 * 0.3), abs=0.03)


def test_auto_ignores_the_warm_up_step():
    split = ReferenceSplit("auto", trainer_cores=1, worker_cores=1)  # warmup=1, as the controller runs it
    # a first step of engine start-up: its times say nothing about the steps after it
    assert _step(split, gen=2.0, other=60.0, per_row_worker=1.0, per_row_trainer=1.0) == 0.0
    assert split.est == {}
    assert _step(split, gen=12.0, other=4.0, per_row_worker=0.05, per_row_trainer=0.05) == 0.0
    assert split.est["R"] == 12.0


def test_a_fixed_share_is_kept_whatever_the_times():
    split = ReferenceSplit(0.25, trainer_cores=1, worker_cores=1)
    assert _step(split, gen=1.0, other=20.0, per_row_worker=0.1, per_row_trainer=0.1) == 0.25
    assert split.rows(32) == 8 and split.rows(3) == 1


def test_a_worker_shared_by_two_ranks_takes_a_share_that_evens_its_two_calls_with_each_rank():
    # 3 devices: one worker serves both training ranks' rollouts, one after the other
    split = ReferenceSplit("auto", trainer_cores=1, worker_cores=1, warmup=0, ranks_per_worker=2)
    for _ in range(6):
        share = _step(split, gen=4.0, other=10.0, per_row_worker=0.1, per_row_trainer=0.1, rows=16)
    # 2 (4 + 1.6 f) = 10 + 1.6 (1 - f)  ->  f = 3.6 / 4.8
    assert share == pytest.approx(0.75, abs=0.03)
    worker = 2 * (4.0 + 0.1 * split.rows(16))
    rank = 10.0 + 0.1 * (16 - split.rows(16))
    assert abs(worker - rank) < 0.35
