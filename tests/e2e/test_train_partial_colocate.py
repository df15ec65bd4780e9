"""partial_colocate on a real Ray with vLLM rollouts and a real reward model: every device
generates, a scorer on device 0 scores each controller's finished samples while they still
generate, and both devices train."""

from __future__ import annotations

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_events, read_metrics, read_summary, tiny_config
from trainer.entry import run_training

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    """The reward preset, trained briefly: any real classifier will do to check the plumbing."""
    from trainer.rewards.tiny_reward_model import make_reward_model

    path = tmp_path_factory.mktemp("rm") / "reward"
    make_reward_model(path, time_budget_s=5, eval_every=10)
    return str(path)


@pytest.mark.slow
def test_partial_colocate_scores_while_generating_with_the_reward_model(
        ray_head, nano_model, reward_model, tmp_path):
    # No warm start: the random policy's responses end at scattered lengths (EOS drawn at
    # random), so some finish early and are scored while the longest still decode. At 128 new
    # tokens a rank's first chunk (4 of 32 samples) is out about halfway through the first
    # rollout (0.19-0.21 s of 0.38-0.41 s, 2026-12-07); at 48 the random policy's first step
    # finished too few early and scoring began as the rollout ended (0.14-0.15 s of 0.146 s)
    cfg = tiny_config(nano_model, rollout={"engine": "vllm", "n": 8, "max_new_tokens": 128},
                      reward={"kind": "model", "model_path": reward_model},
                      algorithm={"name": "grpo", "warm_start": {"steps": 0}},
                      train={"max_steps": 3, "batch_size": 8},
                      placement={"mode": "partial_colocate", "devices": 2, "reward_devices": 1})
    summary = run_training(cfg, tmp_path, env={})
    assert summary["steps"] == 3 and summary["placement"] == "partial_colocate"
    events = read_events(tmp_path)
    placement = next(e for e in events if e["kind"] == "placement")["data"]
    assert placement["reward_devices"] == [0] and placement["local_sampler_devices"] == [0, 1]

    steps = {m["step"]: m for m in read_metrics(tmp_path) if m["step"] > 0}
    for m in steps.values():
        assert m["time/rollout"] > 0 and m["time/reward"] > 0 and m["time/train"] > 0
        assert m["time/rollout_scored"] >= m["time/rollout"]
        assert 0 <= m["placement/scoring_overlap_frac"] <= 1
    span_events = [e["data"] for e in events if e["kind"] == "phase_spans" and e["data"]["step"] > 0]
    overlapped = 0
    for data in span_events:
        spans = data["spans"]
        rollouts = [s for s in spans if s["phase"] == "rollout"]
        scoring = [s for s in spans if s["phase"] == "reward"]
        # both devices generate and train; only the scoring device scores
        assert {s["device"] for s in rollouts} == {0, 1}
        assert {s["device"] for s in spans if s["phase"] == "train"} == {0, 1}
        assert scoring and {s["device"] for s in scoring} == {0}
        # scoring started before generation finished: a chunk was scored while a device decoded
        last_generated = max(s["end"] for s in rollouts)
        overlapped += min(s["start"] for s in scoring) < last_generated
    assert overlapped == len(span_events)
    assert max(m["placement/scoring_overlap_frac"] for m in steps.values()) > 0

    # the rewards the policy trained on are what the reward model says of those samples
    from trainer.rewards.model import ModelReward

    scored = [s for data in span_events for s in data["scored_samples"]]
    assert len(scored) >= 8
    again = ModelReward(reward_model)([s["prompt"] for s in scored], [s["response"] for s in scored],
                                      [None] * len(scored))
    for s, r in zip(scored, again, strict=True):
        # the scorer actor and this process batch and pad differently: equal up to float noise
        assert s["reward"] == pytest.approx(r, abs=1e-3)
    assert len({round(s["reward"], 4) for s in scored}) > 1  # real scores, not a constant
    assert summary == read_summary(tmp_path)
