"""CI's training check: a few GRPO steps on a real Ray, vLLM rollouts, two parallel controllers,
reporting to a real HTTP server as the dispatcher's job would."""

from __future__ import annotations

import pytest
import torch

from tests.e2e import trainer_helpers as helpers
from tests.e2e.trainer_helpers import read_events, read_metrics, read_summary, tiny_config
from tests.unit.test_telemetry import FakeApi, free_port, wait_for
from trainer.entry import run_training
from trainer.weight_sync import sampler_wire_dtype

# DESIGN.md §3.7: what every RL step reports.
STEP_KEYS = [
    "throughput/gen_tokens_per_s", "throughput/samples_per_s", "throughput/trained_tokens_per_s",
    "time/rollout", "time/reward", "time/reference", "time/train", "time/weight_sync", "time/idle",
    "device/0/util_pct", "device/0/memory_mb", "device/0/busy_frac",
    "device/1/util_pct", "device/1/memory_mb", "device/1/busy_frac",
    "reward/mean", "reward/std", "kl/mean", "loss/policy", "loss/kl", "entropy", "clip_frac",
    "grad_norm", "lr", "response/length_mean", "response/length_max",
    "sampling/valid_fraction", "sampling/oversample_ratio",
]

ray_head = helpers.ray_head  # fixtures shared by the trainer's e2e tests
nano_model = helpers.nano_model


@pytest.mark.slow
def test_grpo_with_vllm_on_two_parallel_controllers(ray_head, nano_model, tmp_path):
    port = free_port()
    api = FakeApi(port)
    env = {"YATT_API_URL": f"http://127.0.0.1:{port}", "YATT_RUN_TOKEN": "run-token",
           "YATT_RUN_ID": "9"}
    cfg = tiny_config(nano_model, rollout={"engine": "vllm"},
                      algorithm={"name": "grpo", "kl_coef": 0.01,
                                 "warm_start": {"steps": 10, "batch_size": 16, "lr": 3e-3}})
    seen: list[int] = []
    try:
        summary = run_training(cfg, tmp_path, env=env, on_step=lambda s, m, d: seen.append(s))
        assert wait_for(lambda: any(b.get("state") == "succeeded" for p, b, _ in api.received
                                    if p.endswith("/state")))
    finally:
        api.stop()

    assert seen == [1, 2, 3]
    steps = {m["step"]: m for m in read_metrics(tmp_path)}
    for step in (1, 2, 3):
        missing = [k for k in STEP_KEYS if k not in steps[step]]
        assert not missing, f"step {step} lacks {missing}"
    assert steps[3]["tokens/generated"] > 0
    assert 0 <= steps[2]["device/0/busy_frac"] <= 1

    events = read_events(tmp_path)
    kinds = [e["kind"] for e in events]
    placement = next(e for e in events if e["kind"] == "placement")["data"]
    assert placement["mode"] == "colocate" and placement["train_devices"] == [0, 1]
    spans = [s for e in events if e["kind"] == "phase_spans" for s in e["data"]["spans"]]
    assert {s["device"] for s in spans} == {0, 1}
    assert {"rollout", "reward", "train", "weight_sync"} <= {s["phase"] for s in spans}
    assert kinds.count("eval") == 2 and "checkpoint" in kinds

    assert summary == read_summary(tmp_path)
    assert summary["steps"] == 3 and summary["restarts"] == 0
    assert 0 <= summary["eval/accuracy_start"] <= 1 and 0 <= summary["eval/accuracy_end"] <= 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]

    # the same records reached the API: state moves, every step's points, events, checkpoints
    states = [b["state"] for p, b, _ in api.received if p.endswith("/state")]
    assert states == ["running", "succeeded"]
    posted_steps = {p["step"] for p in api.points() if p["key"] == "reward/mean"}
    assert posted_steps == {1, 2, 3}
    # the SFT warm start's loss curve is reported while it runs (every 25 steps and its last)
    assert {p["step"] for p in api.points() if p["key"] == "warm_start/loss"} == {10}
    assert any(p.endswith("/checkpoints") for p, _, _ in api.received)
    assert all(auth == "Bearer run-token" for _, _, auth in api.received)

    # final/ is an HF model directory that transformers loads and that generates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tok = AutoTokenizer.from_pretrained(tmp_path / "final")
    out = model.generate(**tok(["3+4="], return_tensors="pt"), max_new_tokens=2, do_sample=False)
    assert out.shape[1] >= 5


@pytest.mark.slow
def test_grpo_with_vllm_disaggregated_moves_weights_by_bucketed_broadcast(ray_head, nano_model, tmp_path):
    """The rollout pool's vLLM engine gets each new policy by a gloo broadcast in several
    buckets (trainer/weight_sync.py), and the run trains."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(nano_model, rollout={"engine": "vllm", "weight_sync_bucket_mb": 0.25},
                      placement={"mode": "disaggregated", "devices": 2, "staleness": 1},
                      algorithm={"name": "grpo", "kl_coef": 0.01,
                                 "warm_start": {"steps": 10, "batch_size": 16, "lr": 3e-3}})
    summary = run_training(cfg, tmp_path, env={})
    assert summary["steps"] == 3 and summary["restarts"] == 0
    initial = AutoModelForCausalLM.from_pretrained(nano_model).state_dict()
    # the policy's floating-point tensors travel in the dtype the engine computes in: bf16 on a
    # CPU with native bf16, half the bytes of the learner's fp32 weights
    wire = torch.empty((), dtype=sampler_wire_dtype(cfg, "cpu")).element_size()
    policy_bytes = sum(t.numel() * (wire if t.is_floating_point() else t.element_size())
                       for t in initial.values())
    steps = [m for m in read_metrics(tmp_path) if m["step"] > 0]
    for m in steps:
        assert m["weight_sync/bytes"] == policy_bytes  # one copy of the policy per step
        assert m["weight_sync/buckets"] >= 3 and m["weight_sync/receivers"] == 1
        assert m["time/weight_sync"] > 0
    assert any(m["grad_norm"] > 0 for m in steps)  # an RL update happened, not only the warm start
    assert max(m["sampling/staleness"] for m in steps) == 1  # sampled by the previous version
    spans = [s for e in read_events(tmp_path) if e["kind"] == "phase_spans" for s in e["data"]["spans"]]
    assert {s["device"] for s in spans if s["phase"] == "weight_sync"} == {0, 1}  # both ends
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    assert any(not torch.equal(final[k], initial[k]) for k in initial)  # it trained


@pytest.mark.slow
def test_two_controllers_share_one_tensor_parallel_vllm_engine(ray_head, nano_model, tmp_path):
    """rollout.tensor_parallel_size=2: the two colocated controllers run one vLLM engine sharded
    over their devices, refill in lockstep under dynamic sampling, and sample every step from the
    policy they just trained (the engine's log-probs stay the learner's after each in-place load)."""
    # float32 on both sides: on a CPU with native bf16, auto would sample and train in bf16 (a
    # real mismatch, about 1e-3); a longer warm start than tiny_config's and 8 samples a prompt,
    # so that most steps keep groups with a learning signal
    cfg = tiny_config(nano_model, rollout={"engine": "vllm", "tensor_parallel_size": 2, "n": 8,
                                           "dtype": "float32"},
                      algorithm={"name": "grpo", "warm_start": {"steps": 40, "batch_size": 16, "lr": 3e-3}},
                      train={"max_steps": 4, "batch_size": 4, "lr": 2e-3, "mixed_precision": "fp32"},
                      sampling={"dynamic": True, "max_refills": 2})
    summary = run_training(cfg, tmp_path, env={})
    assert summary["steps"] == 4 and summary["restarts"] == 0
    events = read_events(tmp_path)
    shards = sorted((e["data"]["rank"], e["data"]["engine"], e["data"]["shard"])
                    for e in events if e["kind"] == "tensor_parallel")
    assert shards == [(0, 0, 0), (1, 0, 1)]
    steps = [m for m in read_metrics(tmp_path) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(m["tokens/generated"] > 0 for m in steps)
    # with the weights of step t-1 in both shards, step t's samples score as the learner's own
    # (measured: about 1e-7 here; 0.15-0.24 when the shards keep the warm start's weights).
    # A step whose refills kept no group trains nothing and has no such figure.
    diffs = [m["rollout/logprob_diff"] for m in steps if "rollout/logprob_diff" in m]
    assert len(diffs) >= 2 and max(diffs) < 1e-3, diffs
    assert steps[-1]["grad_norm"] > 0
