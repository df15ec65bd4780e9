"""The SFT warm start that ends on a dev-split accuracy target, with a step budget.

A real nano model (built here, random init) learns 1-digit addition through the real Learner;
no Ray: one rank, so the dev accuracy's all-reduce is the identity.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, parse_config
from trainer.data import load_task
from trainer.learner import Learner
from trainer.models import ensure_model
from trainer.warm_start import dev_split, run_warm_start


def _setup(tmp_path, **warm_start):
    cfg = parse_config({
        "model": {"path": str(tmp_path / "nano"), "preset": "nano"},
        "data": {"arithmetic": {"digits": 1, "ops": ["+"], "eval_size": 20}},
        "algorithm": {"warm_start": {"lr": 3e-3, "batch_size": 32, "dev_size": 16, **warm_start}},
        "rollout": {"max_new_tokens": 4},
        "train": {"grad_clip": 1.0},
        "seed": 0,
    })
    torch.manual_seed(0)
    torch.set_num_threads(1)
    learner = Learner(cfg, ensure_model(cfg))
    train, evals = load_task(cfg)
    trained: list[str] = []
    real_step = learner.sft_step

    def recording_step(prompts, targets, opt):
        trained.extend(prompts)
        return real_step(prompts, targets, opt)

    learner.sft_step = recording_step
    return cfg, learner, train, evals, trained


def _run(cfg, learner, train):
    records: list[dict] = []
    res = run_warm_start(learner, train, cfg.algorithm.warm_start, rank=0, world=1, seed=cfg.seed,
                         max_new_tokens=cfg.rollout.max_new_tokens, emit=records.append)
    checks = [(r["step"], r["metrics"]["warm_start/dev_accuracy"])
              for r in records if "warm_start/dev_accuracy" in r["metrics"]]
    return res, records, checks


def test_stops_at_the_first_check_that_reaches_the_target(tmp_path):
    cfg, learner, train, _evals, trained = _setup(tmp_path, steps=400, target_accuracy=0.15,
                                                  eval_every=10)
    res, _records, checks = _run(cfg, learner, train)
    assert res.reached_target is True
    assert 0 < res.steps < 400 and res.steps % 10 == 0
    assert checks[0] == (0, 0.0)  # a random-init model is checked before any SFT, and fails
    assert [s for s, _ in checks] == list(range(0, res.steps + 1, 10))  # one check per 10 steps
    assert checks[-1][1] >= 0.15 and all(acc < 0.15 for _, acc in checks[:-1])
    assert res.dev_accuracy == checks[-1][1]
    assert len(trained) == 32 * res.steps  # and not one step past the check that met it
    _pool, dev = dev_split(train, 16)
    assert not {e.prompt for e in dev} & set(trained)  # the dev split is never trained on


def test_the_step_budget_stops_a_target_that_is_not_reached(tmp_path):
    cfg, learner, train, _evals, trained = _setup(tmp_path, steps=12, target_accuracy=1.0,
                                                  eval_every=5)
    res, records, checks = _run(cfg, learner, train)
    assert res.steps == 12 and res.reached_target is False
    assert [s for s, _ in checks] == [0, 5, 10, 12]  # the budget's last step is checked too
    assert res.dev_accuracy == checks[-1][1] < 1.0
    assert len(trained) == 32 * 12
    assert records[-1]["step"] == 12 and "warm_start/loss" in records[-1]["metrics"]
    assert "dev accuracy" in records[-1]["message"] and "12/12" in records[-1]["message"]


def test_without_a_target_it_runs_its_steps_on_every_train_example(tmp_path):
    cfg, learner, train, evals, trained = _setup(tmp_path, steps=3)
    res, records, checks = _run(cfg, learner, train)
    assert (res.steps, res.reached_target, res.dev_accuracy, checks) == (3, None, None, [])
    assert [r["step"] for r in records] == [3]
    assert set(trained) <= {e.prompt for e in train}
    assert not set(trained) & {e.prompt for e in evals}


def test_a_target_needs_a_step_budget_and_a_dev_split_that_leaves_sft_examples(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.warm_start: .*target_accuracy needs"):
        parse_config({"algorithm": {"warm_start": {"steps": 0, "target_accuracy": 0.5}}})
    with pytest.raises(ConfigError, match="algorithm.warm_start.target_accuracy"):
        parse_config({"algorithm": {"warm_start": {"steps": 10, "target_accuracy": 1.5}}})
    cfg, learner, train, _evals, _trained = _setup(tmp_path, steps=5, target_accuracy=0.5,
                                                   dev_size=80)
    assert len(train) == 80  # 100 one-digit sums, 20 of them held out for eval
    with pytest.raises(ValueError, match="dev_size=80 leaves no SFT examples"):
        _run(cfg, learner, train)
