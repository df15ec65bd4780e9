"""The trainer's orchestration pieces that need no Ray: placement plans, combining the ranks'
metrics, the prompt shard stream, lr schedules, checkpoint bookkeeping, the progress line."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.controller import PromptStream
from trainer.driver import combine_rank_metrics, resolve_paths
from trainer.entry import format_step
from trainer.learner import lr_lambda
from trainer.placement import plan_placement


def plan(**groups):
    return plan_placement(parse_config(groups), device_type="cpu")


def test_colocate_runs_one_controller_with_its_own_sampler_per_device():
    p = plan(placement={"mode": "colocate", "devices": 4}, train={"batch_size": 8})
    assert p.train_devices == [0, 1, 2, 3] and p.local_sampler_devices == [0, 1, 2, 3]
    assert p.rollout_devices == [] and not p.overlap


def test_disaggregated_splits_a_rollout_pool_from_a_training_pool():
    p = plan(placement={"mode": "disaggregated", "devices": 5, "rollout_devices": 3},
             train={"batch_size": 4})
    assert p.rollout_devices == [0, 1, 2] and p.train_devices == [3, 4]
    assert p.rollout_assignment == [[0, 2], [1]] and p.overlap and p.staleness == 1
    small = plan(placement={"mode": "disaggregated", "devices": 4, "rollout_devices": 1},
                 train={"batch_size": 3})
    assert small.rollout_assignment == [[0], [0], [0]]
    no_overlap = plan(placement={"mode": "disaggregated", "devices": 2, "staleness": 0})
    assert not no_overlap.overlap


@pytest.mark.parametrize("placement", [{"mode": "colocate", "devices": 3},
                                       {"mode": "disaggregated", "devices": 4, "rollout_devices": 2}])
def test_single_controller_uses_the_same_devices_and_ranks_as_parallel(placement):
    single = plan(controller={"mode": "single"}, placement=placement, train={"batch_size": 6})
    parallel = plan(controller={"mode": "parallel"}, placement=placement, train={"batch_size": 6})
    assert single.train_devices == parallel.train_devices and len(single.train_devices) > 1
    assert single.rollout_devices == parallel.rollout_devices
    assert single.rollout_assignment == parallel.rollout_assignment
    assert single.local_sampler_devices == parallel.local_sampler_devices
    assert any("driver moves every" in n for n in single.notes) and not parallel.notes
    assert parse_config({"controller": {"mode": "single"}, "placement": placement,
                         "train": {"batch_size": 6}}).data_parallel_size == len(single.train_devices)


def test_auto_refuses_what_it_cannot_re_plan():
    with pytest.raises(ConfigError, match="controller.mode=parallel"):
        plan(controller={"mode": "single"}, placement={"mode": "auto"})
    with pytest.raises(ConfigError, match="fsdp2") as info:
        plan(placement={"mode": "auto"}, train={"strategy": "fsdp2"})
    assert info.value.errors[0][0] == "placement.mode"


def test_partial_colocate_generates_and_trains_everywhere_and_scores_on_a_subset():
    p = plan(placement={"mode": "partial_colocate", "devices": 4, "reward_devices": 2},
             train={"batch_size": 8})
    assert p.train_devices == [0, 1, 2, 3] and p.local_sampler_devices == [0, 1, 2, 3]
    assert p.reward_devices == [0, 1] and p.rollout_devices == [] and not p.overlap
    assert p.to_event()["reward_devices"] == [0, 1]
    default = plan(placement={"mode": "partial_colocate", "devices": 2})
    assert default.reward_devices == [0]  # one scoring device unless told otherwise
    assert parse_config({"placement": {"mode": "partial_colocate", "devices": 4},
                         "train": {"batch_size": 8}}).data_parallel_size == 4


def test_partial_colocate_refuses_more_scorers_than_devices_and_the_single_controller():
    with pytest.raises(ConfigError) as info:
        parse_config({"placement": {"mode": "partial_colocate", "devices": 2, "reward_devices": 3}})
    assert "reward_devices" in str(info.value)
    with pytest.raises(ConfigError) as single:
        plan(placement={"mode": "partial_colocate", "devices": 2}, controller={"mode": "single"})
    assert single.value.errors[0][0] == "controller.mode"


def test_rank_metrics_combine_sums_maxes_and_means():
    out = combine_rank_metrics([
        {"throughput/tokens_per_s": 100.0, "time/train": 1.0, "reward/mean": 0.2,
         "sampling/kept_groups": 4.0, "device/0/util_pct": 50.0},
        {"throughput/tokens_per_s": 300.0, "time/train": 3.0, "reward/mean": 0.4,
         "sampling/kept_groups": 2.0, "device/1/util_pct": 70.0},
    ])
    assert out == {"throughput/tokens_per_s": 400.0, "time/train": 3.0,
                   "reward/mean": pytest.approx(0.3), "sampling/kept_groups": 6.0,
                   "device/0/util_pct": 50.0, "device/1/util_pct": 70.0}
    # refills: the ranks' mean, and the most any rank made (the step waits for its extra calls)
    out = combine_rank_metrics([{"sampling/refills": 0.0}, {"sampling/refills": 3.0}, {"sampling/refills": 0.0}])
    assert out == {"sampling/refills": 1.0, "sampling/refills_max": 3.0}


def test_prompt_stream_shards_reshuffles_and_resumes_from_its_position():
    examples = list(range(10))
    a = PromptStream(examples, rank=0, world=2, seed=1)
    b = PromptStream(examples, rank=1, world=2, seed=1)
    first = a.take(5)
    assert sorted(first) == [0, 2, 4, 6, 8] and sorted(b.take(5)) == [1, 3, 5, 7, 9]
    second = a.take(5)
    assert sorted(second) == sorted(first) and second != first  # a new epoch, a new order
    rest = a.take(7)
    resumed = PromptStream(examples, rank=0, world=2, seed=1)
    resumed.position = 10
    assert resumed.take(7) == rest


def test_lr_schedules():
    warm_cos = lr_lambda("cosine", 2, 12)
    assert [warm_cos(s) for s in (0, 1)] == [0.5, 1.0]
    assert warm_cos(2) == pytest.approx(1.0) and warm_cos(7) == pytest.approx(0.5)
    assert warm_cos(12) == pytest.approx(0.0)
    assert lr_lambda("linear", 0, 10)(5) == pytest.approx(0.5)
    assert lr_lambda("constant", 0, 10)(9) == 1.0


def test_checkpoint_bookkeeping(tmp_path):
    from trainer import checkpoint as ckpt

    for step in (2, 4, 6):
        path = ckpt.checkpoint_dir(tmp_path, step)
        path.mkdir(parents=True)
        if step != 6:  # an interrupted save has no marker and is never the resume point
            ckpt.mark_complete(path, {"step": step})
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000004"
    ckpt.prune(tmp_path, keep=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000004"]
    assert ckpt.read_trainer_state(ckpt.latest_checkpoint(tmp_path)) == {"step": 4}


def test_checkpoints_newer_than_the_reports_are_kept_apart_from_the_resume_point(tmp_path):
    """A controller may checkpoint steps whose reports the driver has not drained yet: pruning
    keeps the newest checkpoint reported through, and a restart resumes there, dropping newer."""
    from trainer import checkpoint as ckpt

    for step in (10, 20, 30, 40, 50):
        path = ckpt.checkpoint_dir(tmp_path, step)
        path.mkdir(parents=True)
        ckpt.mark_complete(path, {"step": step})
        ckpt.prune(tmp_path, keep=1, reported_through=26)
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(tmp_path)] == [20, 50]
    assert ckpt.step_of(ckpt.latest_checkpoint(tmp_path, at_most=49)) == 20
    assert ckpt.latest_checkpoint(tmp_path, at_most=19) is None
    assert ckpt.discard_after(tmp_path, 20) == [50]
    assert not ckpt.checkpoint_dir(tmp_path, 50).exists()
    assert ckpt.step_of(ckpt.latest_checkpoint(tmp_path)) == 20


def test_relative_paths_become_absolute(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    out = resolve_paths({"model": {"path": ".yatt/models/m", "preset": "nano"},
                         "data": {"path": "prompts.jsonl"}}, base=tmp_path)
    assert out["model"]["path"] == str(tmp_path / ".yatt/models/m")
    assert out["data"]["path"] == str(tmp_path / "prompts.jsonl")
    hub = resolve_paths({"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}}, base=tmp_path)
    assert hub["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_progress_line_names_step_reward_throughput_and_phases():
    line = format_step(3, 40, {"reward/mean": 0.625, "throughput/tokens_per_s": 2345.6,
                               "time/rollout": 1.25, "time/train": 0.5, "time/idle": 0.0,
                               "time/step": 1.8})
    assert line.startswith("step    3/40 | reward 0.625 | 2,346 tok/s")
    assert "rollout 1.25s" in line and "train 0.50s" in line and "idle" not in line
