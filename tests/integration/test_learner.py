"""The `Learner` on a tiny real model: log-probs without full-vocabulary logits, ranks that stay
identical through empty batches, and a resume that follows the curve of an uninterrupted run.

Two data-parallel ranks are two real processes joined by the gloo all-reduce the controllers use.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.ranks import leave, meet
from trainer.config import parse_config
from trainer.models import ensure_model
from trainer.shm_grads import SharedGradients

# serial: runs alone, after the tests that run side by side (`make test`); it asserts
# on the ranks' measured waits for each other
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _cfg(model_dir: Path, **algorithm) -> dict:
    return {
        "model": {"path": str(model_dir), "preset": "nano"},
        "data": {"arithmetic": {"train_size": 500, "eval_size": 16}},
        "algorithm": {"name": "ppo", "kl_coef": 0.05, **algorithm},
        # fp32: these tests compare against exact references; the bf16 tests below ask for it
        "train": {"lr": 3e-3, "grad_clip": 0.05, "micro_batch_size": 4, "mixed_precision": "fp32"},
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 5, "temperature": 0.8},
        "placement": {"device_type": "cpu", "devices": 2},
    }


@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("models") / "nano"
    return ensure_model(parse_config(_cfg(model_dir)))


def _batch(learner, rank: int, step: int, rows: int):
    """A deterministic synthetic batch: varied lengths, rewards and sampler log-probs."""
    from trainer.learner import RLBatch

    g = torch.Generator().manual_seed(1000 * rank + step)
    vocab = learner.policy.config.vocab_size
    prompts, responses, logprobs = [], [], []
    for i in range(rows):
        prompts.append(torch.randint(2, vocab, (3 + i % 3,), generator=g).tolist())
        length = 2 + (i * 3 + step) % 5
        responses.append(torch.randint(2, vocab, (length,), generator=g).tolist())
        # sampler log-probs near the policy's (uniform-ish at init), some far off: exercises the cap
        logprobs.append((-torch.rand(length, generator=g) * 8).tolist())
    scores = torch.rand(rows, generator=g).round().tolist()
    return RLBatch(prompt_ids=prompts, response_ids=responses, scores=scores, n=2,
                   truncated=[False] * rows, sample_logprobs=logprobs, staleness=[1] * rows)


def _rank_main(rank: int, world: int, port: str, cfg_data: dict, model_dir: str, out: str,
               empty_at: dict) -> None:
    from trainer.learner import DataParallelGroup, Learner, RLBatch

    torch.set_num_threads(1)
    torch.manual_seed(rank)  # ranks draw differently: identical weights must come from lockstep
    cfg = parse_config(cfg_data)
    group = DataParallelGroup("127.0.0.1", meet(rank, port), rank, world)
    learner = Learner(cfg, model_dir, dist_group=group)
    metrics = []
    for step in range(4):
        if step in empty_at.get(rank, ()):
            batch = RLBatch([], [], [], n=2, truncated=[])
        else:
            batch = _batch(learner, rank, step, rows=6)
        metrics.append(learner.rl_step(batch))
    torch.save({"policy": learner.policy.state_dict(), "critic": learner.critic.state_dict(),
                "metrics": metrics}, out)
    leave(group.barrier)


def test_ranks_hold_identical_weights_after_steps_with_empty_batches(nano, tmp_path):
    """Rank 1 has nothing to train at step 1, rank 0 at step 2: with a tight grad clip and a
    critic, any path that skips clipping or the critic step on the empty rank drifts."""
    from safetensors.torch import load_file

    cfg_data = _cfg(nano)
    cfg_data["train"]["balance_ranks"] = False  # or rank 0's groups would fill the empty rank
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    port = str(tmp_path / "port")
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, cfg_data, str(nano), outs[r],
                                                  {1: [1], 0: [2]}))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    a, b = (torch.load(o, weights_only=False) for o in outs)
    initial = load_file(str(nano / "model.safetensors"))
    moved = 0
    for name, tensor in a["policy"].items():
        assert torch.equal(tensor, b["policy"][name]), f"policy {name} differs between ranks"
        if name in initial:
            moved += int(not torch.equal(tensor, initial[name]))
    assert moved > 0, "training changed nothing: the test would pass vacuously"
    for name, tensor in a["critic"].items():
        assert torch.equal(tensor, b["critic"][name]), f"critic {name} differs between ranks"
    assert a["metrics"][2]["train/empty_batch"] == 1.0 and b["metrics"][1]["train/empty_batch"] == 1.0
    # both ranks clipped to the same global norm, the empty one included
    for step in range(4):
        assert a["metrics"][step]["grad_norm"] == pytest.approx(b["metrics"][step]["grad_norm"])
    # the sampler's log-probs were used: far-off ones are weighted, and the mismatch is reported
    assert a["metrics"][0]["rollout/logprob_diff"] > 0.5
    assert 0 < a["metrics"][0]["rollout/is_capped_frac"] < 1


def _overlap_rank_main(rank: int, port: str, cfg_data: dict, model_dir: str, out: str,
                       mode: str) -> None:
    """An SFT step, then three RL steps of two epochs, rank 1 empty at step 1, with gradients
    averaged in shared memory (``mode`` "shared"), over gloo during the backward in small buckets
    ("buckets": several launched during the backward) or over gloo after it ("after"); records
    how many buckets each step's last policy backward had launched before `flush`."""
    from transformers import AutoModelForCausalLM

    from trainer import learner as L

    load = AutoModelForCausalLM.from_pretrained

    def with_unused_parameter(*args, **kwargs):
        model = load(*args, **kwargs)
        # no loss reaches it, and it is first in order: the policy's last bucket waits for `flush`
        model.register_parameter("unused", torch.nn.Parameter(torch.zeros(4)))
        return model

    AutoModelForCausalLM.from_pretrained = with_unused_parameter
    torch.set_num_threads(1)
    L.SHARED_MEMORY_GRADS = mode == "shared"
    L.OVERLAP_GRAD_ALL_REDUCE = mode == "buckets"
    L.GRAD_BUCKET_BYTES = 32 * 1024
    # collectives out of order across ranks wait for each other: fail in minutes, not ten
    group = L.DataParallelGroup("127.0.0.1", meet(rank, port), rank, 2, timeout_s=120)
    learner = L.Learner(parse_config(cfg_data), model_dir, dist_group=group)
    early: list[int] = []
    if mode == "shared":
        assert isinstance(learner.policy_grads, SharedGradients)
        assert isinstance(learner.critic_grads, SharedGradients)
    if mode == "buckets":
        buckets = learner.policy_grads
        assert isinstance(buckets, L.GradientBuckets)
        assert len(buckets.buckets) > 3
        flush = buckets.flush

        def counted_flush() -> None:
            if buckets.armed:  # the flush right after the last backward, not the one in `wait`
                early.append(buckets.launched)
            flush()

        buckets.flush = counted_flush
    # a warm-start step first: its blocking all-reduce after the backward, hooks installed
    learner.sft_step([f"{rank}+2=", "3+4="], [str(rank + 2), "7"], learner.optimizer)
    for step in range(3):
        empty = rank == 1 and step == 1
        batch = L.RLBatch([], [], [], n=2, truncated=[]) if empty else _batch(learner, rank, step, rows=6)
        learner.rl_step(batch)
    torch.save({"policy": learner.policy.state_dict(), "critic": learner.critic.state_dict(),
                "early": early}, out)
    leave(group.barrier)


def test_gradient_averages_in_shared_memory_and_during_backward_train_exactly_like_gloo_after_it(
        nano, tmp_path):
    """Gradients averaged in shared memory (`SharedGradients`, the default for ranks on one host)
    and by a bucketed all-reduce launched mid-backward (`GradientBuckets`) against gloo's blocking
    all-reduce after the backward: two micro-batches per rank, two epochs per step, a critic, a
    rank with an empty batch (it averages after no backward at all), and a policy parameter
    without a gradient (its bucket goes after the backward, still before the critic's). A bucket
    launched on an earlier micro-batch, out of order across ranks, or a shared slot read before
    its rank has written it, changes the weights or fails."""
    from safetensors.torch import load_file

    cfg_data = _cfg(nano)
    cfg_data["train"]["ppo_epochs"] = 2
    cfg_data["train"]["balance_ranks"] = False  # rank 1's empty step stays empty
    ctx = mp.get_context("spawn")
    runs = {}
    for mode in ("shared", "buckets", "after"):
        outs = [str(tmp_path / f"{mode}-rank{r}.pt") for r in range(2)]
        port = str(tmp_path / f"{mode}-port")
        procs = [ctx.Process(target=_overlap_rank_main,
                             args=(r, port, cfg_data, str(nano), outs[r], mode)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            assert p.exitcode == 0
        runs[mode] = [torch.load(o, weights_only=False) for o in outs]
    # each non-empty step's last backward launched buckets itself, two epochs each
    assert len(runs["buckets"][0]["early"]) == 6 and len(runs["buckets"][1]["early"]) == 4
    assert all(n > 0 for r in runs["buckets"] for n in r["early"])
    reference = runs["after"][0]
    initial = load_file(str(nano / "model.safetensors"))
    assert any(not torch.equal(t, reference["policy"][n]) for n, t in initial.items()), "nothing trained"
    for run in runs["shared"] + runs["buckets"] + runs["after"][1:]:
        for module in ("policy", "critic"):
            for name, tensor in run[module].items():
                assert torch.equal(tensor, reference[module][name]), f"{module} {name} differs"


def _lopsided_rank_main(rank: int, world: int, port: str, cfg_data: dict, model_dir: str, out: str,
                        plan: dict) -> None:
    """RL steps on lopsided batches: ``plan["rows"][rank]`` rows a rank, rank 0's responses
    ``plan["stretch"]`` times longer (its passes would hold the others up); rank
    ``plan["late"][0]`` comes to step ``plan["late"][1]`` ``plan["late"][2]`` s late, as after a
    slower rollout, and rank ``plan["empty"][0]`` to step ``plan["empty"][1]`` with nothing."""
    import time

    from trainer.learner import DataParallelGroup, Learner, RLBatch

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    group = DataParallelGroup("127.0.0.1", meet(rank, port), rank, world, timeout_s=120)
    learner = Learner(parse_config(cfg_data), model_dir, dist_group=group)
    metrics = []
    for step in range(plan["steps"]):
        if (rank, step) == tuple(plan["late"][:2]):
            time.sleep(plan["late"][2])
        if (rank, step) == tuple(plan["empty"]):
            batch = RLBatch([], [], [], n=2, truncated=[])
        else:
            batch = _batch(learner, rank, step, rows=plan["rows"][rank])
            if rank == 0:
                batch.response_ids = [r * plan["stretch"] for r in batch.response_ids]
                batch.sample_logprobs = [lp * plan["stretch"] for lp in batch.sample_logprobs]
        metrics.append(learner.rl_step(batch))
    torch.save({"policy": learner.policy.state_dict(), "metrics": metrics,
                "critic": learner.critic.state_dict() if learner.critic is not None else None}, out)
    leave(group.barrier)


def _run_lopsided(world: int, cfg_data: dict, model_dir: Path, outs: Path, plan: dict) -> list[dict]:
    """`_lopsided_rank_main` on ``world`` ranks, each a process; what each rank saved."""
    ctx = mp.get_context("spawn")
    files = [str(outs / f"rank{r}.pt") for r in range(world)]
    outs.mkdir(parents=True)
    port = str(outs / "port")
    procs = [ctx.Process(target=_lopsided_rank_main,
                         args=(r, world, port, cfg_data, str(model_dir), files[r], plan))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    return [torch.load(f, weights_only=False) for f in files]


def test_ranks_balanced_by_tokens_train_like_the_lopsided_batches(nano, tmp_path):
    """`train.balance_ranks` deals whole groups so each rank passes about as many tokens: the
    lopsided ranks come out balanced (an empty rank gets groups too), both ranks stay identical,
    and the update is the one the undealt batches give (same global norm, same weights up to
    summation order)."""
    from safetensors.torch import load_file

    # rank 0: 5 groups of long responses; rank 1: one group of short ones, a second late at step 0
    plan = {"steps": 4, "rows": [10, 2], "stretch": 8, "late": (1, 0, 1.0), "empty": (1, 2)}
    runs = {}
    for balance in (True, False):
        cfg_data = _cfg(nano)
        cfg_data["train"]["balance_ranks"] = balance
        runs[balance] = _run_lopsided(2, cfg_data, nano, tmp_path / str(balance), plan)
    dealt, lopsided = runs[True], runs[False]
    for step in range(4):
        m = dealt[0]["metrics"][step]
        assert m["train/rank_load_before"] > 1.5 and m["train/rank_load_after"] < 1.2, m
        for k in ("train/rank_load_before", "train/rank_load_after", "grad_norm"):
            assert m[k] == pytest.approx(dealt[1]["metrics"][step][k])
        assert m["grad_norm"] == pytest.approx(lopsided[0]["metrics"][step]["grad_norm"], rel=1e-4)
    # the wait for peers is measured where it happens: rank 0 waited for the late rank at the
    # exchange; undealt, the rank with 2 short rows waits for the long ones' backward every step
    assert dealt[0]["metrics"][0]["time/rank_wait"] > 0.7 > 0.3 > dealt[1]["metrics"][0]["time/rank_wait"]
    for step in range(4):
        assert "time/rank_wait" not in lopsided[0]["metrics"][step]
        assert (lopsided[1]["metrics"][step]["time/grad_sync"]
                > 2 * lopsided[0]["metrics"][step]["time/grad_sync"] + 0.005), step
    assert "train/empty_batch" not in dealt[1]["metrics"][2]  # the empty rank was dealt groups
    assert lopsided[1]["metrics"][2]["train/empty_batch"] == 1.0
    initial = load_file(str(nano / "model.safetensors"))
    assert any(not torch.equal(t, dealt[0]["policy"][n]) for n, t in initial.items()), "nothing trained"
    for module in ("policy", "critic"):
        for name, tensor in dealt[0][module].items():
            assert torch.equal(tensor, dealt[1][module][name]), f"{module} {name} differs between ranks"
            torch.testing.assert_close(tensor, lopsided[0][module][name], rtol=1e-4, atol=1e-5,
                                       msg=f"{module} {name}: dealt and lopsided batches trained apart")


def test_ranks_sharing_micro_batches_through_a_queue_train_like_the_lopsided_batches(nano, tmp_path):
    """`train.balance_ranks: queue`: a rank out of work takes the other rank's micro-batches as
    soon as that rank has published its rows, so no rank waits for another's rollout while it has
    rows to train, nor for work it could share. The update is the one the lopsided batches give
    each rank trained alone (`off`): the same global norm and weights up to summation order, though
    each micro-batch's loss was weighted by its own tokens and the global count applied after the
    gradient average; both ranks stay identical."""
    from safetensors.torch import load_file

    # rank 0: 5 groups of long responses (5 micro-batches), a second late at step 0; rank 1: one
    # group of short ones, nothing at step 2
    plan = {"steps": 4, "rows": [10, 2], "stretch": 3, "late": (0, 0, 1.0), "empty": (1, 2)}
    runs = {}
    for mode in ("queue", "off"):
        cfg_data = _cfg(nano, name="grpo")
        cfg_data["train"].update(balance_ranks=mode, micro_batch_size=2)
        runs[mode] = _run_lopsided(2, cfg_data, nano, tmp_path / mode, plan)
    queued, lopsided = runs["queue"], runs["off"]
    for step in range(4):
        m0, m1 = queued[0]["metrics"][step], queued[1]["metrics"][step]
        assert m0["grad_norm"] == pytest.approx(m1["grad_norm"])
        assert m0["grad_norm"] == pytest.approx(lopsided[0]["metrics"][step]["grad_norm"], rel=1e-4)
        assert m0["train/rank_load_before"] == pytest.approx(m1["train/rank_load_before"])
        assert m0["train/rank_load_before"] > 1.5
        # all of rank 0's tokens, or some of them on rank 1: each micro-batch was trained once
        assert m0["trained_tokens"] + m1["trained_tokens"] == pytest.approx(
            lopsided[0]["metrics"][step]["trained_tokens"]
            + lopsided[1]["metrics"][step].get("trained_tokens", 0.0))
    # step 0: rank 1 trained its own rows, waited for rank 0's, then took some of them; rank 0,
    # late, never waited
    first = [queued[r]["metrics"][0] for r in range(2)]
    assert first[1]["time/rank_wait"] > 0.7 > 0.3 > first[0]["time/rank_wait"]
    assert first[1]["train/taken_frac"] > 0.3
    assert first[0]["train/rank_load_after"] < first[0]["train/rank_load_before"]
    assert first[0]["train/taken_frac"] == 0.0
    # step 2: rank 1 came with nothing and trained rank 0's rows
    assert "train/empty_batch" not in queued[1]["metrics"][2]
    assert queued[1]["metrics"][2]["train/taken_frac"] == 1.0
    assert lopsided[1]["metrics"][2]["train/empty_batch"] == 1.0
    initial = load_file(str(nano / "model.safetensors"))
    assert any(not torch.equal(t, queued[0]["policy"][n]) for n, t in initial.items()), "nothing trained"
    for name, tensor in queued[0]["policy"].items():
        assert torch.equal(tensor, queued[1]["policy"][name]), f"policy {name} differs between ranks"
        torch.testing.assert_close(tensor, lopsided[0]["policy"][name], rtol=1e-4, atol=1e-5,
                                   msg=f"policy {name}: queued and lopsided batches trained apart")


def test_ranks_sharing_micro_batches_through_a_queue_replay_them_in_later_epochs(nano, tmp_path):
    """`train.ppo_epochs: 2` with the queue: the first epoch shares the micro-batches as above and
    the second replays the sharing, each rank training again what it took against the proximal
    log-probs its own first pass gave. The update, the loss metrics and the weights are those of
    the lopsided batches each trained alone over two epochs, on both ranks alike; a second epoch
    that trained other rows, or against other proximal log-probs, would move them apart."""
    # rank 0: 5 groups of long responses, a second late at step 0; rank 1: one group, none at step 2
    plan = {"steps": 3, "rows": [10, 2], "stretch": 3, "late": (0, 0, 1.0), "empty": (1, 2)}
    runs = {}
    for mode in ("queue", "off"):
        cfg_data = _cfg(nano, name="grpo")
        cfg_data["train"].update(balance_ranks=mode, micro_batch_size=2, ppo_epochs=2)
        runs[mode] = _run_lopsided(2, cfg_data, nano, tmp_path / mode, plan)
    queued, lopsided = runs["queue"], runs["off"]
    for step in range(3):
        m0, m1, want = queued[0]["metrics"][step], queued[1]["metrics"][step], lopsided[0]["metrics"][step]
        for k in ("grad_norm", "loss/policy", "loss/kl", "clip_frac", "rollout/logprob_diff"):
            assert m0[k] == pytest.approx(m1[k]), k
            assert m0[k] == pytest.approx(want[k], rel=1e-4, abs=1e-7), (step, k)
    # the first epoch was shared: rank 1 took some of rank 0's rows at step 0, all at step 2
    assert queued[1]["metrics"][0]["train/taken_frac"] > 0.3
    assert queued[1]["metrics"][2]["train/taken_frac"] == 1.0
    assert lopsided[1]["metrics"][2]["train/empty_batch"] == 1.0
    # the second epoch moved the weights beyond the first: clipping engaged against the old
    # log-probs (a rank replaying against its current policy would clip nothing)
    assert max(queued[0]["metrics"][s]["clip_frac"] for s in range(3)) > 0
    for name, tensor in queued[0]["policy"].items():
        assert torch.equal(tensor, queued[1]["policy"][name]), f"policy {name} differs between ranks"
        torch.testing.assert_close(tensor, lopsided[0]["policy"][name], rtol=1e-4, atol=1e-5,
                                   msg=f"policy {name}: queued and lopsided batches trained apart")


@pytest.mark.parametrize("name,kl_in_reward", [("ppo", False), ("reinforce_pp", True), ("grpo", True)])
def test_ranks_sharing_the_passes_before_the_advantages_through_a_queue_train_like_their_own_batches(
        nano, tmp_path, name, kl_in_reward):
    """Where the advantages need more than a prompt group's scores (PPO's critic values and its
    advantages whitened over the whole batch, REINFORCE++'s whitening and a KL in the reward, a
    GRPO reward less the KL), the queue shares those passes first and exchanges their results,
    then shares the training: the update, the critic's and the loss metrics are those of the
    lopsided batches each rank trained alone, on both ranks alike. An advantage whitened over
    one rank's rows, or a KL taken from another policy, would move them apart."""
    plan = {"steps": 3, "rows": [10, 2], "stretch": 3, "late": (0, 0, 1.0), "empty": (1, 2)}
    runs = {}
    for mode in ("queue", "off"):
        cfg_data = _cfg(nano, name=name, kl_in_reward=kl_in_reward)
        cfg_data["train"].update(balance_ranks=mode, micro_batch_size=2)
        runs[mode] = _run_lopsided(2, cfg_data, nano, tmp_path / mode, plan)
    queued, lopsided = runs["queue"], runs["off"]
    compared = ["grad_norm", "loss/policy", "kl/mean"] + (["loss/value"] if name == "ppo" else [])
    for step in range(3):
        m0, m1, want = queued[0]["metrics"][step], queued[1]["metrics"][step], lopsided[0]["metrics"][step]
        for k in compared:
            assert m0[k] == pytest.approx(m1[k]), k
            assert m0[k] == pytest.approx(want[k], rel=1e-4, abs=1e-7), (step, k)
        # rank 0's own rows: their advantages as the whole batch gave them
        assert m0["advantage/abs_mean"] == pytest.approx(want["advantage/abs_mean"], rel=1e-5), step
    # step 0: rank 1 passed its own rows, waited for the late rank's, and shared them; step 2: it
    # came with nothing and trained rank 0's rows
    first = [queued[r]["metrics"][0] for r in range(2)]
    assert first[1]["time/rank_wait"] > 0.7 > 0.3 > first[0]["time/rank_wait"]
    assert first[1]["train/taken_frac"] > 0.3
    assert queued[1]["metrics"][2]["train/taken_frac"] == 1.0
    # the weights up to summation order, which Adam under a tight clip carries to about 5e-5 in
    # three steps (PPO, measured); advantages whitened per rank put them 1e-2 apart
    for module in ("policy", "critic") if name == "ppo" else ("policy",):
        for key, tensor in queued[0][module].items():
            assert torch.equal(tensor, queued[1][module][key]), f"{module} {key} differs between ranks"
            torch.testing.assert_close(tensor, lopsided[0][module][key], rtol=0, atol=5e-4,
                                       msg=f"{module} {key}: queued and lopsided batches trained apart")


def test_three_ranks_sharing_micro_batches_through_a_queue_train_like_their_own_batches(nano, tmp_path):
    """The queue past two ranks: a rank out of work while two others have yet to publish takes
    from whichever publishes first; every micro-batch is trained once, by one rank, and all three
    ranks end identical, with the update their own batches give."""
    # rank 2 half a second late at step 0, rank 1 empty at step 1, rank 0's rows the longest
    plan = {"steps": 3, "rows": [8, 4, 4], "stretch": 4, "late": (2, 0, 0.5), "empty": (1, 1)}
    runs = {}
    for mode in ("queue", "off"):
        cfg_data = _cfg(nano, name="grpo")
        cfg_data["train"].update(balance_ranks=mode, micro_batch_size=2, batch_size=15)  # 5 prompts a rank
        cfg_data["placement"]["devices"] = 3
        runs[mode] = _run_lopsided(3, cfg_data, nano, tmp_path / mode, plan)
    queued, own = runs["queue"], runs["off"]
    for step in range(3):
        trained = [queued[r]["metrics"][step].get("trained_tokens", 0.0) for r in range(3)]
        assert sum(trained) == pytest.approx(sum(own[r]["metrics"][step].get("trained_tokens", 0.0)
                                                 for r in range(3)))
        for r in range(3):
            assert queued[r]["metrics"][step]["grad_norm"] == pytest.approx(
                own[0]["metrics"][step]["grad_norm"], rel=1e-4)
    # at step 0 ranks 0 and 1 ran out of their own rows before rank 2 came: both waited for it
    assert min(queued[r]["metrics"][0]["time/rank_wait"] for r in (0, 1)) > 0.2
    assert queued[1]["metrics"][1]["train/taken_frac"] == 1.0  # it came with nothing
    for name, tensor in queued[0]["policy"].items():
        for r in (1, 2):
            assert torch.equal(tensor, queued[r]["policy"][name]), f"policy {name}: rank {r} differs"
        torch.testing.assert_close(tensor, own[0]["policy"][name], rtol=1e-4, atol=1e-5)


def test_groups_are_dealt_longest_first_to_the_least_loaded_rank():
    from trainer.learner import deal_groups

    # 9 to rank 0, 5 to rank 1, 4 to rank 1 (5 < 9), 4 to rank 0 (9 = 9: the lower), 1 to rank 1
    assert deal_groups([5, 9, 1, 4, 4], 2) == [1, 0, 1, 1, 0]
    assert deal_groups([], 3) == []
    assert deal_groups([7, 7, 7], 3) == [0, 1, 2]


def test_logprobs_at_response_positions_match_the_full_forward(nano):
    """The chunked LM-head pass equals log_softmax over full logits, temperature and entropy too."""
    from trainer import learner as L
    from trainer.algorithms import entropy_from_logits, token_logprobs

    cfg = parse_config(_cfg(nano, name="grpo", kl_coef=0.0))
    learner = L.Learner(cfg, nano)
    batch = _batch(learner, 0, 0, rows=5)
    ids, attn, index, mask = learner._layout(batch.prompt_ids, batch.response_ids)
    with torch.no_grad():
        logits = learner.policy(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.7
        want_lp = token_logprobs(logits, ids[:, 1:]).gather(1, index)
        want_ent = entropy_from_logits(logits).gather(1, index)
        saved = L.LOGITS_CHUNK_ELEMENTS
        try:
            L.LOGITS_CHUNK_ELEMENTS = 1  # one position per chunk: exercises the chunking
            lp, ent = learner._logprobs(learner.policy, ids, attn, index, entropy=True, temperature=0.7)
        finally:
            L.LOGITS_CHUNK_ELEMENTS = saved
    assert ent is not None
    m = mask.bool()
    torch.testing.assert_close(lp[m], want_lp[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[m], want_ent[m], rtol=1e-5, atol=1e-5)


def test_entropy_is_trained_only_when_asked_and_equal_either_way(nano):
    """`entropy_grad=False` (entropy_coef 0, the default) keeps the entropy out of autograd — its
    softmax is not held for the backward — with the same values; True gives it a gradient."""
    from trainer import learner as L

    learner = L.Learner(parse_config(_cfg(nano, name="grpo", kl_coef=0.0)), nano)
    batch = _batch(learner, 0, 0, rows=4)
    ids, attn, index, mask = learner._layout(batch.prompt_ids, batch.response_ids)
    lp_a, ent_a = learner._logprobs(learner.policy, ids, attn, index, entropy=True, entropy_grad=True)
    lp_b, ent_b = learner._logprobs(learner.policy, ids, attn, index, entropy=True, entropy_grad=False)
    assert ent_a is not None and ent_b is not None
    assert ent_a.requires_grad and not ent_b.requires_grad and lp_b.requires_grad
    torch.testing.assert_close(ent_a.detach(), ent_b)
    torch.testing.assert_close(lp_a.detach(), lp_b.detach())
    (ent_a * mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.policy.parameters())


def test_compiled_blocks_train_like_eager_ones(nano):
    """`train.compile`: every block of the policy and the reference is compiled (their own
    functions, not shared through the deep copy), and two GRPO steps at two sequence lengths give
    the losses and weights of the eager learner."""
    from trainer import learner as L

    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        cfg = _cfg(nano, name="grpo", kl_coef=0.05)
        cfg["train"]["compile"] = compiled
        learner = L.Learner(parse_config(cfg), nano)
        if compiled:
            for model in (learner.policy, learner.reference):
                assert all(b._compiled_call_impl is not None for b in L._transformer_blocks(model))
        losses = [learner.rl_step(_batch(learner, 0, step, rows=4))["loss/total"] for step in range(2)]
        runs[compiled] = (losses, [p.detach().clone() for p in learner.policy.parameters()])
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-3, abs=1e-5)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.fixture
def eager_compile(monkeypatch):
    """`nn.Module.compile` with dynamo's eager backend: the same guards and recompiles as
    inductor, without its code generation (seconds instead of a minute); dynamo reset before
    and after, so that no eager-backend graph is left for a later test's blocks."""
    import torch._dynamo

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, backend="eager", **kw))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_sharded_ppo_learner_runs_every_block_variant_compiled(nano, eager_compile):
    """`train.compile` on an FSDP2 PPO learner in bf16 with gradient checkpointing: policy, frozen
    reference and critic share one block forward, compiled once per variant (grad mode, which
    tensors need grad, one-row batches): 10 here, past dynamo's default limit of 8, beyond which
    it runs the rest eagerly without a word. With the limit a hard failure, a step must pass.
    Dynamo's eager backend (`eager_compile`)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from trainer import learner as L

    graphs = counters["stats"]["unique_graphs"]
    cfg = _cfg(nano, name="ppo", kl_coef=0.05)
    cfg["train"].update(compile=True, strategy="fsdp2", mixed_precision="bf16", gradient_checkpointing=True)
    # dynamo's own patch (monkeypatch's undo would delete the settings, which hides them for good)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
        learner = L.Learner(parse_config(cfg), nano)
        assert math.isfinite(learner.rl_step(_batch(learner, 0, 0, rows=4))["loss/total"])
        assert counters["stats"]["unique_graphs"] - graphs > 8


def test_a_compiled_learners_greedy_eval_compiles_nothing_and_leaves_its_steps_compiled(nano, eager_compile,
                                                                                         monkeypatch):
    """`train.compile`: the held-out eval decodes with a KV cache, which through the compiled
    blocks would make a variant per layer and cache state; on a model of 28 blocks that used up
    dynamo's recompile limit before the first step, whose blocks then ran eagerly. The eval runs
    the blocks eagerly instead; the step after it still compiles its own. Eager backend."""
    import dataclasses

    import torch._dynamo
    from torch._dynamo.utils import counters

    from trainer import learner as L
    from trainer import models as M

    monkeypatch.setitem(M.PRESETS, "nano", dataclasses.replace(M.PRESETS["nano"], layers=6))
    cfg = _cfg(nano.parent / "nano-6", name="grpo", kl_coef=0.05)
    model_dir = ensure_model(parse_config(cfg))
    cfg["train"]["compile"] = True
    # the limit of a model 28 blocks deep, scaled to these 6 (its eval made 32 variants and more)
    with torch._dynamo.config.patch(recompile_limit=6, fail_on_recompile_limit_hit=True):
        learner = L.Learner(parse_config(cfg), model_dir)
        eager = L.Learner(parse_config({**cfg, "train": {**cfg["train"], "compile": False}}), model_dir)
        graphs = counters["stats"]["unique_graphs"]
        prompts = ["12+7=", "3+45=", "60+1="]
        assert learner.greedy(prompts, max_new_tokens=6) == eager.greedy(prompts, max_new_tokens=6)
        assert counters["stats"]["unique_graphs"] == graphs
        assert math.isfinite(learner.rl_step(_batch(learner, 0, 0, rows=4))["loss/total"])
        assert counters["stats"]["unique_graphs"] > graphs


def test_a_compiled_learner_meets_no_one_row_micro_batch_it_could_avoid(nano, eager_compile):
    """`train.compile`: a step whose rows split into micro-batches of three and one recompiled
    every block variant for the one-row batch (dynamo specializes size 1), mid-run: 20 s of a
    6 s step in the generation-heavy benchmark. The last micro-batch takes a row from the one
    before instead, and the step after the first compiles nothing. Eager backend."""
    from torch._dynamo.utils import counters

    from trainer import learner as L

    cfg = _cfg(nano, name="grpo", kl_coef=0.05)
    cfg["train"].update(compile=True, micro_batch_size=3)
    learner = L.Learner(parse_config(cfg), nano)
    assert math.isfinite(learner.rl_step(_batch(learner, 0, 0, rows=6))["loss/total"])  # 3 + 3
    graphs = counters["stats"]["unique_graphs"]
    assert math.isfinite(learner.rl_step(_batch(learner, 0, 1, rows=10))["loss/total"])  # 3 + 3 + 2 + 2
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_compiled_learner_runs_a_lone_row_with_a_copy_and_learns_the_same(nano, eager_compile, algo):
    """`train.compile`: a micro-batch left with one row (three rows by two, as when a rollout
    worker scored the reference of all but one row) runs with a copy of that row, so the step compiles
    no one-row variant mid-run (dynamo specializes size 1), and the step's losses and weights
    are those of the eager learner on the same batches. Eager backend."""
    from torch._dynamo.utils import counters

    from trainer import learner as L

    learners = {}
    for compiled in (True, False):
        torch.manual_seed(0)
        cfg = _cfg(nano, name=algo, kl_coef=0.05)
        cfg["train"].update(compile=compiled, micro_batch_size=2)
        learners[compiled] = L.Learner(parse_config(cfg), nano)
    losses: dict[bool, list[float]] = {True: [], False: []}
    for compiled, learner in learners.items():
        losses[compiled].append(learner.rl_step(_batch(learner, 0, 0, rows=4))["loss/total"])  # 2 + 2
        graphs = counters["stats"]["unique_graphs"]
        lone = dataclasses.replace(_batch(learner, 0, 1, rows=3), n=3)  # one group of 3: 2 + 1
        losses[compiled].append(learner.rl_step(lone)["loss/total"])
        if compiled:
            assert counters["stats"]["unique_graphs"] == graphs
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-6)
    for a, b in zip(learners[True].policy.parameters(), learners[False].policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batches_sort_rows_by_length_and_cap_rows_and_padded_tokens():
    from trainer.learner import in_row_order, micro_batches, padded_length

    lengths = torch.tensor([5, 40, 12, 40, 7, 100, 3, 12])
    chunks = micro_batches(lengths, max_rows=3, max_tokens=90)
    rows = torch.cat(chunks).tolist()
    assert sorted(rows) == list(range(8))  # every row once
    assert [lengths[i].item() for i in rows] == sorted(lengths.tolist(), reverse=True)
    for c in chunks:  # rows × the chunk's longest within the cap, unless a row alone exceeds it
        assert len(c) <= 3 and (len(c) * int(lengths[c].max()) <= 90 or len(c) == 1)
    assert [len(c) for c in chunks] == [1, 2, 3, 2]  # 100 | 40 40 | 12 12 7 | 5 3
    # a last micro-batch of one row takes one from the one before (a one-row batch recompiles
    # under train.compile); a row alone because it is too long stays alone
    tail = micro_batches(torch.tensor([9, 8, 7, 6, 5, 4, 3]), max_rows=3)
    assert [[9 - i for i in c.tolist()] for c in tail] == [[9, 8, 7], [6, 5], [4, 3]]
    assert [len(c) for c in micro_batches(torch.tensor([9, 8, 7, 6, 5, 4, 3]), max_rows=2)] == [2, 2, 2, 1]
    assert [len(c) for c in micro_batches(torch.tensor([60, 50, 10]), max_rows=8, max_tokens=90)] == [1, 1, 1]
    assert len(micro_batches(lengths, max_rows=64)) == 1  # no token cap: rows only
    # train.pad_to_multiple: auto rounds to 16 or a smaller power of two within 1/16 of the length
    assert [padded_length(n, "auto") for n in (7, 38, 103, 200, 255, 257, 1000)] == [7, 38, 104, 200, 256, 272, 1008]
    assert [padded_length(n, 16, cap=40) for n in (1, 16, 17, 39)] == [16, 16, 32, 40]
    # the cap counts a micro-batch at the width it is cut to (17 -> 32)
    three = torch.tensor([17, 15, 9])
    assert [len(c) for c in micro_batches(three, max_rows=8, max_tokens=48)] == [2, 1]
    assert [len(c) for c in micro_batches(three, max_rows=8, max_tokens=48, multiple=16)] == [1, 2]
    # results computed chunk by chunk come back in the batch's row order
    per_chunk = [lengths[c].float().unsqueeze(1) * 10 for c in chunks]
    assert in_row_order(chunks, per_chunk).squeeze(1).tolist() == (lengths * 10).float().tolist()


def test_trimmed_micro_batches_train_like_one_padded_batch(nano):
    """`train.micro_batch_tokens`: sorted, trimmed micro-batches (PPO: policy, reference and
    critic) give the losses, values and weights of the whole batch padded to its longest row,
    and so do micro-batches cut to widths rounded up to `train.pad_to_multiple`."""
    from trainer import learner as L

    runs = {}
    widths: dict[tuple, set[int]] = {}
    for tokens, multiple in ((None, 1), (24, 1), (24, 8)):
        torch.manual_seed(0)
        cfg = _cfg(nano)
        cfg["train"].update({"micro_batch_size": 64, "micro_batch_tokens": tokens, "pad_to_multiple": multiple})
        learner = L.Learner(parse_config(cfg), nano)
        batch = _batch(learner, 0, 0, rows=8)
        ids, attn, index, mask = learner._layout(batch.prompt_ids, batch.response_ids)
        chunks = learner._micro_batches(attn.sum(dim=1))
        assert (len(chunks) == 1) == (tokens is None)
        widths[tokens, multiple] = {L._trimmed(ids, attn, index, mask, c, multiple)[0][0].shape[1] for c in chunks}
        before = [p.detach().clone() for p in learner.policy.parameters()]
        metrics = [learner.rl_step(_batch(learner, 0, step, rows=8)) for step in range(2)]
        runs[tokens, multiple] = (metrics, [p.detach().clone() for p in learner.policy.parameters()],
                                  [p.detach().clone() for p in learner.critic.parameters()])
        assert any(not torch.equal(a, b) for a, b in zip(before, runs[tokens, multiple][1], strict=True))
    assert all(w % 8 == 0 for w in widths[24, 8])  # the rounded widths, padded beyond every row
    assert not all(w % 8 == 0 for w in widths[24, 1])  # this batch's own lengths are not
    one = runs[None, 1]
    for cut in (runs[24, 1], runs[24, 8]):
        for key in ("loss/total", "loss/value", "kl/mean", "critic/value_mean", "grad_norm"):
            assert [m[key] for m in cut[0]] == pytest.approx([m[key] for m in one[0]], rel=1e-4, abs=1e-6)
        for a, b in zip(cut[1] + cut[2], one[1] + one[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _controller_run(cfg_data: dict, run_dir: Path, model_dir: Path, max_steps: int) -> dict:
    """One rank's controller loop in this process (world of one, HF sampler): step → metrics."""
    import copy
    import json

    from trainer.controller import ControllerLoop

    data = copy.deepcopy(cfg_data)
    data["train"]["max_steps"] = max_steps
    loop = ControllerLoop(json.dumps(data), rank=0, world=1, device=0, device_type="cpu", cores=1,
                          run_dir=str(run_dir), rollout_workers=[], local_sampler=True,
                          model_dir=str(model_dir))
    loop.run("127.0.0.1", 0)
    return {r["step"]: r["metrics"] for r in loop.drain() if r["type"] == "metrics" and r["step"] > 0}


def test_a_resumed_run_follows_the_curve_of_one_that_never_stopped(nano, tmp_path):
    """Same seeds, CPU: stop after the step-2 checkpoint, resume, and steps 3-4 match an
    uninterrupted run's (weights, optimizer, reference, data position, sampler and RNG state)."""
    torch.set_num_threads(1)
    cfg_data = _cfg(nano, name="grpo", kl_coef=0.05,
                    warm_start={"steps": 20, "lr": 1e-3, "batch_size": 16})
    cfg_data.update({
        "train": {"lr": 1e-3, "batch_size": 4, "micro_batch_size": 8, "lr_schedule": "constant"},
        "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 4, "temperature": 1.0},
        "reward": {"kind": "rule", "rule": "exact_match+format"},
        "sampling": {"dynamic": True, "max_refills": 1},
        "placement": {"device_type": "cpu", "devices": 1},
        "checkpoint": {"every_steps": 2, "export_final": False},
        "eval": {"size": 4},
    })
    straight = _controller_run(cfg_data, tmp_path / "straight", nano, 4)
    _controller_run(cfg_data, tmp_path / "resumed", nano, 2)
    resumed = _controller_run(cfg_data, tmp_path / "resumed", nano, 4)
    assert sorted(resumed) == [3, 4]  # it went on from the checkpoint, not from the start
    for step in (3, 4):
        a, b = straight[step], resumed[step]
        for key in ("reward/mean", "response/length_mean", "loss/total", "grad_norm", "kl/mean"):
            assert key in a, f"{key} missing at step {step}"
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"{key} at step {step}"
    assert any(straight[s]["grad_norm"] > 0 for s in (3, 4)), "nothing trained: vacuous"


def test_checkpoints_keep_the_cuda_rng_where_cuda_exists(monkeypatch):
    """No GPU here: only torch.cuda's availability and RNG calls are stood in for."""
    from trainer import checkpoint as ckpt

    saved = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    restored: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    state = ckpt.rng_state()
    assert state["cuda"] is saved
    ckpt.set_rng_state(state)
    assert restored == [saved]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cuda" not in ckpt.rng_state()


def test_mixed_precision_setting_resolves_by_hardware(monkeypatch):
    """fp32 and bf16 are what they say; auto is bf16 only where the device computes it natively."""
    from trainer import learner as L

    cpu = torch.device("cpu")
    assert L.autocast_dtype("fp32", cpu) is None
    assert L.autocast_dtype("bf16", cpu) is torch.bfloat16
    monkeypatch.setattr(L, "native_bf16", lambda device: False)
    assert L.autocast_dtype("auto", cpu) is None
    monkeypatch.setattr(L, "native_bf16", lambda device: True)
    assert L.autocast_dtype("auto", cpu) is torch.bfloat16


def _learner(model_dir: Path, precision: str):
    from trainer.learner import Learner

    cfg = _cfg(model_dir, name="grpo", kl_coef=0.05)
    cfg["train"].update({"lr": 1e-3, "grad_clip": 1.0, "micro_batch_size": 8,
                         "mixed_precision": precision})
    torch.manual_seed(0)
    return Learner(parse_config(cfg), model_dir)


def _graded_batch(learner):
    """Four prompts × two responses each, the first of each pair rewarded, no sampler log-probs."""
    from trainer.learner import RLBatch

    g = torch.Generator().manual_seed(7)
    vocab = learner.policy.config.vocab_size
    prompts, responses, scores = [], [], []
    for i in range(4):
        prompt = torch.randint(2, vocab, (4 + i % 2,), generator=g).tolist()
        for j in range(2):
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (6 + (i + j) % 3,), generator=g).tolist())
            scores.append(1.0 - j)
    return RLBatch(prompt_ids=prompts, response_ids=responses, scores=scores, n=2,
                   truncated=[False] * len(scores))


def _rewarded_margin(learner, batch) -> float:
    """Mean log-prob of the rewarded responses minus the unrewarded ones', in fp32."""
    ids, attn, index, mask = learner._layout(batch.prompt_ids, batch.response_ids)
    with torch.no_grad():
        lp, _ = learner._logprobs(learner.policy, ids, attn, index)
    seq = (lp * mask).sum(1) / mask.sum(1)
    good = torch.tensor(batch.scores) > 0.5
    return float(seq[good].mean() - seq[~good].mean())


def test_bf16_mixed_precision_logprobs_match_fp32(nano):
    """Under bf16 autocast the log-probs stay close to fp32's, the master weights and their
    gradients stay fp32, and the autocast really ran in bf16 (else the test is vacuous)."""
    learner = _learner(nano, "bf16")
    assert learner.autocast_dtype is torch.bfloat16
    batch = _batch(learner, 0, 0, rows=6)
    ids, attn, index, mask = learner._layout(batch.prompt_ids, batch.response_ids)
    with torch.no_grad():
        fp32, _ = learner._logprobs(learner.policy, ids, attn, index, entropy=True)
        with learner.autocast():
            bf16, ent = learner._logprobs(learner.policy, ids, attn, index, entropy=True)
            head_out = learner.policy.get_output_embeddings()(
                torch.zeros(1, learner.policy.config.hidden_size))
    assert head_out.dtype is torch.bfloat16  # the matrix products ran in bf16
    assert bf16.dtype is torch.float32 and ent is not None and ent.dtype is torch.float32
    m = mask.bool()
    diff = (bf16 - fp32)[m].abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.1, (float(diff.mean()), float(diff.max()))
    assert float(diff.max()) > 0, "bf16 equalled fp32 bit for bit: autocast did not run"
    metrics = learner.rl_step(batch)
    assert all(p.dtype is torch.float32 for p in learner.policy.parameters())
    assert all(p.grad is None or p.grad.dtype is torch.float32 for p in learner.policy.parameters())
    assert math.isfinite(metrics["loss/total"])


def test_bf16_mixed_precision_learns_like_fp32(nano):
    """Same start, same batches: a few GRPO steps lift the rewarded responses' log-probs over the
    unrewarded ones' by about as much in bf16 mixed precision as in fp32."""
    gains = {}
    for precision in ("fp32", "bf16"):
        learner = _learner(nano, precision)
        batch = _graded_batch(learner)
        before = _rewarded_margin(learner, batch)
        for _ in range(5):
            learner.rl_step(batch)
        gains[precision] = _rewarded_margin(learner, batch) - before
    assert gains["fp32"] > 0.5, gains  # it learned: else the comparison means nothing
    assert gains["bf16"] == pytest.approx(gains["fp32"], rel=0.2), gains
