"""Every placement, controller mode and algorithm runs a few steps on a real Ray (HF rollouts:
quick to start; the vLLM path has its own test)."""

from __future__ import annotations

import pytest

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_events, read_metrics, read_summary, tiny_config
from trainer.entry import run_training

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model


@pytest.mark.slow
def test_disaggregated_overlaps_rollout_with_training(ray_head, nano_model, tmp_path):
    cfg = tiny_config(nano_model, placement={"mode": "disaggregated", "devices": 2, "staleness": 1},
                      train={"max_steps": 4, "batch_size": 4})
    summary = run_training(cfg, tmp_path, env={})
    assert summary["steps"] == 4
    placement = next(e for e in read_events(tmp_path) if e["kind"] == "placement")["data"]
    assert placement["rollout_devices"] == [0] and placement["train_devices"] == [1]
    spans = [s for e in read_events(tmp_path) if e["kind"] == "phase_spans" for s in e["data"]["spans"]]
    rollout = [s for s in spans if s["phase"] == "rollout"]
    train = [s for s in spans if s["phase"] == "train"]
    assert {s["device"] for s in rollout} == {0} and {s["device"] for s in train} == {1}
    # rollout of step t+1 runs while step t trains: some rollout span overlaps a train span
    assert any(r["start"] < t["end"] and t["start"] < r["end"] for r in rollout for t in train)
    staleness = [m["sampling/staleness"] for m in read_metrics(tmp_path) if m["step"] > 0]
    assert max(staleness) == 1
    assert any(s["phase"] == "weight_sync" and s["device"] == 0 for s in spans)
    # each step's policy went out once, by broadcast, to the one rollout worker
    steps = [m for m in read_metrics(tmp_path) if m["step"] > 0]
    assert all(m["weight_sync/bytes"] > 0 and m["weight_sync/receivers"] == 1 for m in steps)


@pytest.mark.slow
def test_rollout_worker_scores_the_reference_and_the_run_trains_the_same(ray_head, nano_model, tmp_path):
    """`placement.reference_on_rollout`: the worker's copy of the reference (sent after the warm
    start moved it) scores every sample, the training rank runs no reference pass, and the run's
    numbers are those of a run whose training rank ran it (same seed, same samples)."""
    runs = {}
    for share in (0, 1):
        cfg = tiny_config(nano_model, placement={"mode": "disaggregated", "devices": 2, "staleness": 1,
                                                 "reference_on_rollout": share},
                          algorithm={"kl_coef": 0.05}, train={"max_steps": 3, "batch_size": 4})
        run_training(cfg, tmp_path / str(share), env={})
        runs[share] = [m for m in read_metrics(tmp_path / str(share)) if m["step"] > 0]
    home, away = runs[0], runs[1]
    assert all(m["reference/given_frac"] == 0.0 and m["reference/rows"] > 0 for m in home)
    assert all(m["reference/given_frac"] == 1.0 and m["reference/rows"] == 0 for m in away)
    assert all(m["placement/reference_on_rollout"] == 1.0 and m["time/reference_rollout"] > 0 for m in away)
    spans = [s for e in read_events(tmp_path / "1") if e["kind"] == "phase_spans" for s in e["data"]["spans"]]
    # the rollout device's reference spans (the training device's hold only the advantages now)
    assert 0 in {s["device"] for s in spans if s["phase"] == "reference"}
    assert any(m["kl/mean"] > 0 for m in home)  # the warm start moved the reference off the policy
    for a, b in zip(home, away, strict=True):
        assert b["tokens/generated"] == a["tokens/generated"]
        for k in ("kl/mean", "loss/total", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), (a["step"], k)


@pytest.mark.slow
def test_single_controller_trains_the_same_ranks_as_parallel_with_all_data_through_the_driver(
        ray_head, nano_model, tmp_path):
    """Same seed, devices, ranks and algorithm: the driver-held loop gives the parallel mode's
    numbers (only the control flow differs), and every sample passes through the driver."""
    runs = {}
    for mode in ("parallel", "single"):
        cfg = tiny_config(nano_model, controller={"mode": mode}, train={"max_steps": 3, "batch_size": 8})
        runs[mode] = (run_training(cfg, tmp_path / mode, env={}), read_metrics(tmp_path / mode))
    summary, single = runs["single"]
    _, parallel = runs["parallel"]
    assert summary["controller"] == "single" and summary["steps"] == 3
    placement = next(e for e in read_events(tmp_path / "single") if e["kind"] == "placement")["data"]
    assert placement["train_devices"] == [0, 1] and placement["local_sampler_devices"] == [0, 1]
    spans = [s for e in read_events(tmp_path / "single") if e["kind"] == "phase_spans"
             for s in e["data"]["spans"]]
    assert {s["device"] for s in spans if s["phase"] == "train"} == {0, 1}  # both ranks train
    assert {s["device"] for s in spans if s["phase"] == "rollout"} == {0, 1}
    # the warm start and every RL step took the same numbers in both modes
    for p, s in zip(parallel, single, strict=True):
        assert p["step"] == s["step"]
        for key in ("reward/mean", "loss/policy", "grad_norm", "response/length_mean", "tokens/trained"):
            if key in p:
                assert s[key] == pytest.approx(p[key], rel=1e-4, abs=1e-6), (p["step"], key)
    assert summary["eval/accuracy_end"] == runs["parallel"][0]["eval/accuracy_end"]
    assert summary["reward/mean_first"] != summary["last/reward/mean"] or summary["last/grad_norm"] > 0
    for p, s in zip(parallel[1:], single[1:], strict=True):
        # each generated token brings a float log-prob (9 pickled bytes) to the single driver
        assert s["driver/bytes_in"] > 9 * s["tokens/generated"]
        assert s["driver/bytes_out"] > s["tokens/generated"]  # and goes back out in a batch
        assert p["driver/bytes_in"] > 0 and p["driver/bytes_out"] == 0  # scalars and spans only
        assert s["time/overhead"] >= 0 and s["driver/rss_peak_mb"] >= s["driver/rss_mb"] > 0


@pytest.mark.slow
def test_single_controller_dynamic_sampling_and_disaggregated_rollouts(ray_head, nano_model, tmp_path):
    cfg = tiny_config(nano_model, controller={"mode": "single"},
                      placement={"mode": "disaggregated", "devices": 2, "staleness": 1},
                      sampling={"dynamic": True, "max_refills": 2})
    summary = run_training(cfg, tmp_path, env={})
    assert summary["controller"] == "single" and summary["steps"] == 3
    m = [x for x in read_metrics(tmp_path) if x["step"] > 0]
    assert all("sampling/refills" in x and x["sampling/refills"] <= 2 for x in m)
    assert max(x["sampling/staleness"] for x in m) == 1  # the next rollout overlapped training
    assert all("device/0/busy_frac" in x and "device/1/util_pct" in x for x in m)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "rloo", "reinforce_pp", "sft"])
def test_each_algorithm_completes_a_short_run(ray_head, nano_model, tmp_path, algo):
    # PPO and REINFORCE++ on two controllers: their ranks share the passes before the advantages
    # (a critic's values, whitening over the batch) and the training through the balance queue
    devices = 2 if algo in ("ppo", "reinforce_pp") else 1
    cfg = tiny_config(nano_model, algorithm={"name": algo, "kl_coef": 0.0 if algo == "sft" else 0.01,
                                             "warm_start": {"steps": 0}},
                      train={"max_steps": 2, "batch_size": 4}, checkpoint={"every_steps": 10},
                      placement={"mode": "colocate", "devices": devices})
    summary = run_training(cfg, tmp_path, env={})
    assert summary["algorithm"] == algo and summary["steps"] == 2
    last = [x for x in read_metrics(tmp_path) if x["step"] == 2][0]
    assert ("loss/sft" if algo == "sft" else "loss/policy") in last
    if devices > 1:
        assert "train/taken_frac" in last, sorted(last)  # the queue's, not the dealing's
    if algo == "ppo":
        assert "loss/value" in last
    assert "eval/accuracy_end" in read_summary(tmp_path)


@pytest.mark.slow
def test_fsdp2_controllers_train_what_ddp_controllers_train(ray_head, nano_model, tmp_path):
    """Two controllers on a real Ray, sharded (train.strategy=fsdp2) or whole per rank (ddp):
    same seed, same numbers step by step, and the sharded run's final export is a whole model."""
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        cfg = tiny_config(nano_model, train={"max_steps": 3, "batch_size": 8, "strategy": strategy,
                                                      "mixed_precision": "fp32"})
        runs[strategy] = (run_training(cfg, tmp_path / strategy, env={}), read_metrics(tmp_path / strategy))
    (ddp_summary, ddp), (fsdp_summary, fsdp) = runs["ddp"], runs["fsdp2"]
    assert fsdp_summary["steps"] == 3
    for a, b in zip(ddp, fsdp, strict=True):
        assert a["step"] == b["step"]
        for key in ("reward/mean", "loss/policy", "grad_norm", "tokens/trained"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (a["step"], key)
    assert fsdp_summary["eval/accuracy_end"] == ddp_summary["eval/accuracy_end"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "fsdp2" / "final")).num_parameters() > 0
