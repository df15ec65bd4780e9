"""`yatt make-tiny-model DIR --preset reward`: a real sequence classifier trained on the arithmetic
task, used through `reward.kind: model`, agreeing with exact match on held-out problems."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from backend.cli import app
from trainer.config import parse_config
from trainer.data.arithmetic import arithmetic_examples
from trainer.rewards import build_reward
from trainer.rewards.tiny_reward_model import corrupt, labelled_pairs


def test_corruptions_are_always_wrong_answers():
    rng = random.Random(0)
    for near_miss in (0.0, 0.75, 1.0):
        for answer in ("0", "7", "10", "99", "198"):
            for _ in range(200):
                assert corrupt(answer, rng, near_miss).strip() != answer


def test_near_miss_corruptions_are_off_by_one_two_ten_a_hundred_or_swapped():
    rng = random.Random(0)
    for answer in ("10", "57", "99", "198"):
        for _ in range(200):
            out = corrupt(answer, rng, near_miss=1.0)
            swapped = sorted(out) == sorted(answer) and len(out) == len(answer)
            assert swapped or abs(int(out) - int(answer)) in (1, 2, 10, 100), (answer, out)


def test_held_out_pairs_are_drawn_as_before_near_misses_existed():
    """Agreement figures stay comparable: without `near_miss` the draw is the one pinned here
    (taken before the parameter existed); with it, the wrong responses change."""
    examples = arithmetic_examples(digits=2, ops=["+"], train_size=100, eval_size=10, seed=0)[1]
    prompts, responses, labels = labelled_pairs(examples, random.Random(5), 12)
    assert responses == ["113", "", "104", "102", "9114", "112", "112", "+", "103", "123", "117", "122"]
    assert labels == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    near = labelled_pairs(examples, random.Random(5), 12, near_miss=1.0)[1]
    assert near != responses and "" not in near and "+" not in near


@pytest.mark.slow
def test_reward_preset_trains_a_classifier_that_agrees_with_exact_match(tmp_path):
    out = tmp_path / "rm"
    # A step budget, not a time budget: the same classifier however busy the machine is (1,000
    # steps, the learning rate decaying to 0 over them, are about 29 CPU seconds; it may stop
    # sooner at 97%); the full preset's figures are in docs/placement.md.
    r = CliRunner().invoke(app, ["make-tiny-model", str(out), "--preset", "reward",
                                 "--max-steps", "1000", "--time-budget-s", "900"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "reward_model.json").read_text())
    reward = build_reward(parse_config({"reward": {"kind": "model", "model_path": str(out)}}))
    # held-out problems: the eval split of the same task, never in the classifier's training set
    _train, held_out = arithmetic_examples(digits=2, ops=["+"], train_size=20_000, eval_size=256, seed=0)
    prompts, responses, labels = labelled_pairs(held_out, random.Random(123), 400)
    scores = reward(prompts, responses, [None] * len(prompts))
    agree = sum((s > 0) == (y > 0.5) for s, y in zip(scores, labels, strict=True)) / len(labels)
    assert agree == pytest.approx(report["held_out_agreement"], abs=0.08)
    assert report["steps"] <= 1000 and report["recipe"]["schedule"] == "cosine to 0 at step 1000"
    assert agree > 0.9  # chance is 0.5 (balanced labels); 1,000 steps reach about 0.96-0.97
    right = [s for s, y in zip(scores, labels, strict=True) if y > 0.5]
    wrong = [s for s, y in zip(scores, labels, strict=True) if y < 0.5]
    assert sum(right) / len(right) > sum(wrong) / len(wrong)
    again = CliRunner().invoke(app, ["make-tiny-model", str(out), "--preset", "reward"])
    assert again.exit_code == 1 and "already exists" in again.output
