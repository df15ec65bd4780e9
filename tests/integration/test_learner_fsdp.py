"""The `Learner` sharded with FSDP2 over two real gloo ranks (`train.strategy: fsdp2`).

Each test spawns two processes joined by the same group the controllers use. The sharded
learner must compute what the unsharded one computes (fp32, same batches, ranks with uneven and
empty batches), gradient checkpointing must not change the gradients, the optimizer-offload
option must reach FSDP2, and a resumed sharded run must follow the curve of one that never
stopped.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.ranks import meet
from trainer.config import parse_config
from trainer.models import ensure_model

pytestmark = pytest.mark.slow

STEPS = 3
# rank → its batch size at each step: uneven micro-batch counts, an empty batch on each rank
ROWS = {0: [6, 0, 5], 1: [3, 4, 0]}


def _cfg(model_dir: Path, **train) -> dict:
    return {
        "model": {"path": str(model_dir), "preset": "nano"},
        "data": {"arithmetic": {"train_size": 500, "eval_size": 16}},
        "algorithm": {"name": "ppo", "kl_coef": 0.05},
        # fp32 unless a case asks for bf16: fsdp2 and ddp are compared to fp32 tolerances
        # balance_ranks off: the ranks keep their uneven and empty batches (FSDP's idle passes)
        "train": {"lr": 3e-3, "grad_clip": 0.05, "micro_batch_size": 2, "mixed_precision": "fp32",
                  "balance_ranks": False, **train},
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 5, "temperature": 0.8},
        "placement": {"device_type": "cpu", "devices": 2},
    }


@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("models") / "nano"
    return ensure_model(parse_config(_cfg(model_dir)))


def _batch(vocab: int, rank: int, step: int, rows: int):
    from trainer.learner import RLBatch

    g = torch.Generator().manual_seed(1000 * rank + step)
    prompts, responses, logprobs = [], [], []
    for i in range(rows):
        prompts.append(torch.randint(2, vocab, (3 + i % 3,), generator=g).tolist())
        length = 2 + (i * 3 + step) % 5
        responses.append(torch.randint(2, vocab, (length,), generator=g).tolist())
        logprobs.append((-torch.rand(length, generator=g) * 8).tolist())
    scores = torch.rand(rows, generator=g).round().tolist()
    return RLBatch(prompt_ids=prompts, response_ids=responses, scores=scores, n=2,
                   truncated=[False] * rows, sample_logprobs=logprobs, staleness=[1] * rows)


def _train(rank: int, world: int, port: int, cfg_data: dict, model_dir: str) -> dict:
    """Train STEPS steps on this rank's batches; returns metrics and whole (gathered) weights."""
    from trainer.learner import DataParallelGroup, Learner

    group = DataParallelGroup("127.0.0.1", port, rank, world)
    learner = Learner(parse_config(cfg_data), model_dir, dist_group=group)
    vocab = learner.policy.config.vocab_size
    # evaluation first, as a run does: greedy decoding on a gathered policy, uneven prompt counts
    assert len(learner.greedy(["1 + 2 ="] * (rank + 1), max_new_tokens=3)) == rank + 1
    metrics = [learner.rl_step(_batch(vocab, rank, step, ROWS[rank][step])) for step in range(STEPS)]
    full = learner.full_state_dicts()  # a collective on every rank
    out: dict = {"metrics": metrics, "sharded": learner.sharded}
    if rank == 0:
        out.update(policy=full["policy"], critic=full["critic"])
        if learner.sharded:
            from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

            root = learner._forwards[id(learner.policy)]
            assert isinstance(root, FSDPModule)
            state = root._get_fsdp_state()
            group_ = state._fsdp_param_group
            assert group_ is not None
            out["offload"] = isinstance(group_.offload_policy, CPUOffloadPolicy)
            out["param_dtypes"] = sorted({str(p.to_local().dtype) for p in learner.policy.parameters()})
            out["compute_dtype"] = str(group_.mp_policy.param_dtype)
            # a shard, not the whole: each rank holds about half of every sharded tensor
            emb = learner.policy.get_input_embeddings().weight
            out["shard_rows"] = (emb.to_local().shape[0], emb.shape[0])
    group.barrier()
    return out


def _rank_main(rank: int, world: int, rendezvous: str, runs: dict, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    results = {name: _train(rank, world, meet(rank, Path(rendezvous) / f"port{k}"), cfg, model_dir)
               for k, (name, cfg) in enumerate(runs.items())}
    torch.save(results, out)


def _spawn(target, args_for_rank, timeout_s: float = 900.0) -> None:
    """Run `target` on 2 ranks; a rank that fails stops the other at once (it would otherwise
    wait for the failed one in a collective until its timeout)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_for_rank(r)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.fixture(scope="module")
def trained(nano, tmp_path_factory) -> dict:
    """One spawn, five learners per rank, trained on the same batches."""
    runs = {
        "ddp": _cfg(nano),
        "fsdp": _cfg(nano, strategy="fsdp2"),
        "fsdp_checkpointed": _cfg(nano, strategy="fsdp2", gradient_checkpointing=True),
        "fsdp_offload": _cfg(nano, strategy="fsdp2", offload_optimizer=True),
        "fsdp_bf16": _cfg(nano, strategy="fsdp2", mixed_precision="bf16"),
    }
    tmp = tmp_path_factory.mktemp("fsdp")
    outs = [str(tmp / f"rank{r}.pt") for r in range(2)]
    rendezvous = tmp / "ports"
    rendezvous.mkdir()
    _spawn(_rank_main, lambda r: (r, 2, str(rendezvous), runs, str(nano), outs[r]))
    return {"rank0": torch.load(outs[0], weights_only=False),
            "rank1": torch.load(outs[1], weights_only=False)}


def _assert_close_states(a: dict, b: dict, what: str, **tol) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, name=name: f"{what} {name}: {m}", **tol)


def test_fsdp_trains_what_the_unsharded_learner_trains(trained, nano):
    """fp32, same batches, uneven and empty batches per rank: same losses, norms and weights."""
    from safetensors.torch import load_file

    ddp, fsdp = trained["rank0"]["ddp"], trained["rank0"]["fsdp"]
    assert fsdp["sharded"] and not ddp["sharded"]
    rows, total = fsdp["shard_rows"]
    assert rows < total, "the embedding is not sharded"
    for step in range(STEPS):
        for r in ("rank0", "rank1"):
            a, b = trained[r]["ddp"]["metrics"][step], trained[r]["fsdp"]["metrics"][step]
            assert a.keys() == b.keys()
            for key in ("loss/total", "loss/policy", "loss/value", "grad_norm", "kl/mean"):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"{r} step {step} {key}"
    _assert_close_states(ddp["policy"], fsdp["policy"], "policy", rtol=1e-4, atol=1e-5)
    _assert_close_states(ddp["critic"], fsdp["critic"], "critic", rtol=1e-4, atol=1e-5)
    initial = load_file(str(nano / "model.safetensors"))
    moved = sum(not torch.equal(fsdp["policy"][k], initial[k]) for k in initial)
    assert moved > 0, "training changed nothing: the comparison would pass vacuously"
    # ranks stayed in lockstep: both clipped to the same global norm at every step
    for step in range(STEPS):
        assert (trained["rank0"]["fsdp"]["metrics"][step]["grad_norm"]
                == pytest.approx(trained["rank1"]["fsdp"]["metrics"][step]["grad_norm"]))
    assert trained["rank0"]["fsdp"]["metrics"][1]["train/empty_batch"] == 1.0
    assert trained["rank1"]["fsdp"]["metrics"][2]["train/empty_batch"] == 1.0


def test_gradient_checkpointing_gives_the_same_gradients(trained):
    plain, ckpt = trained["rank0"]["fsdp"], trained["rank0"]["fsdp_checkpointed"]
    for step in range(STEPS):
        assert ckpt["metrics"][step]["grad_norm"] == pytest.approx(
            plain["metrics"][step]["grad_norm"], rel=1e-5)
    _assert_close_states(plain["policy"], ckpt["policy"], "policy", rtol=1e-5, atol=1e-6)


def test_optimizer_offload_reaches_fsdp_and_changes_nothing_on_cpu(trained):
    """On a CPU device CPUOffloadPolicy is a no-op (the shards already live in CPU memory): the
    option must reach FSDP2 and training must be unchanged. Its effect needs a GPU."""
    plain, off = trained["rank0"]["fsdp"], trained["rank0"]["fsdp_offload"]
    assert off["offload"] and not plain["offload"]
    _assert_close_states(plain["policy"], off["policy"], "policy", rtol=1e-6, atol=1e-7)


def test_bf16_mixed_precision_keeps_fp32_master_weights(trained):
    bf16, fp32 = trained["rank0"]["fsdp_bf16"], trained["rank0"]["fsdp"]
    assert bf16["compute_dtype"] == "torch.bfloat16" and fp32["compute_dtype"] == "torch.float32"
    assert bf16["param_dtypes"] == ["torch.float32"]
    # bf16 compute: close to the fp32 run's losses, not equal to them
    first = [(bf16["metrics"][0][k], fp32["metrics"][0][k]) for k in ("loss/total", "grad_norm")]
    assert any(a != b for a, b in first)
    for a, b in first:
        assert a == pytest.approx(b, rel=0.05, abs=1e-3)


def _controller_rank(rank: int, rendezvous: str, cfg_data: dict, run_dir: str, model_dir: str,
                     max_steps: int, out: str) -> None:
    from trainer.controller import ControllerLoop

    torch.set_num_threads(1)
    data = copy.deepcopy(cfg_data)
    data["train"]["max_steps"] = max_steps
    loop = ControllerLoop(json.dumps(data), rank=rank, world=2, device=rank, device_type="cpu",
                          cores=1, run_dir=run_dir, rollout_workers=[], local_sampler=True,
                          model_dir=model_dir)
    loop.run("127.0.0.1", meet(rank, Path(rendezvous)))
    records = loop.drain()
    torch.save({r["step"]: r["metrics"] for r in records
                if r["type"] == "metrics" and r["step"] > 0}, out)


def _controllers(cfg_data: dict, run_dir: Path, model_dir: Path, max_steps: int) -> dict:
    outs = [str(run_dir.parent / f"{run_dir.name}-{max_steps}-rank{r}.pt") for r in range(2)]
    port = run_dir.parent / f"{run_dir.name}-{max_steps}-port"
    _spawn(_controller_rank, lambda r: (r, str(port), cfg_data, str(run_dir), str(model_dir), max_steps,
                                        outs[r]))
    return torch.load(outs[0], weights_only=False)


def test_a_resumed_fsdp_run_follows_the_curve_of_one_that_never_stopped(nano, tmp_path):
    """Two sharded controllers (HF sampler, fixed seeds): stop after the step-2 checkpoint, resume,
    and steps 3-4 match an uninterrupted run (gathered weights, per-rank optimizer shards,
    reference, data position, RNG)."""
    cfg_data = _cfg(nano, strategy="fsdp2")
    cfg_data["algorithm"] = {"name": "grpo", "kl_coef": 0.05,
                             "warm_start": {"steps": 20, "lr": 1e-3, "batch_size": 16}}
    cfg_data.update({
        "train": {"lr": 1e-3, "batch_size": 4, "micro_batch_size": 2, "strategy": "fsdp2"},
        "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 4, "temperature": 1.0},
        "reward": {"kind": "rule", "rule": "exact_match+format"},
        # groups whose rewards all agree are dropped: batches are uneven, some empty
        "sampling": {"dynamic": True, "max_refills": 1},
        "checkpoint": {"every_steps": 2, "export_final": True},
        "eval": {"size": 4},
    })
    straight = _controllers(cfg_data, tmp_path / "straight", nano, 4)
    _controllers(cfg_data, tmp_path / "resumed", nano, 2)
    resumed = _controllers(cfg_data, tmp_path / "resumed", nano, 4)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        a, b = straight[step], resumed[step]
        assert a.keys() - {"time/step"} <= b.keys()  # an empty batch (no losses) on both or neither
        for key in ("reward/mean", "loss/total", "grad_norm", "kl/mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"{key} at step {step}"
    assert any(straight[s]["grad_norm"] > 0 for s in (3, 4)), "nothing trained: vacuous"
    # the final export is a whole HF model, loadable as it is
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "straight" / "final"))
    assert final.config.architectures == ["Qwen2ForCausalLM"]


def _padded_batch(rank: int, step: int, rows: int):
    """`rows` rows of distinct lengths (every micro-batch of two is padded), fixed per rank/step."""
    from trainer.learner import RLBatch

    g = torch.Generator().manual_seed(100 * rank + step)
    prompts = [torch.randint(2, 60, (3,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(2, 60, (2 + i,), generator=g).tolist() for i in range(rows)]
    logprobs = [(-torch.rand(len(r), generator=g) * 4).tolist() for r in responses]
    return RLBatch(prompt_ids=prompts, response_ids=responses, scores=[float(i % 2) for i in range(rows)],
                   n=2, truncated=[False] * rows, sample_logprobs=logprobs, staleness=[0] * rows)


# rank → rows at each step: rank 1 has one micro-batch fewer at step 1 and none at step 2
IDLE_ROWS = {0: [4, 4, 4], 1: [4, 2, 0]}


def _compiled_rank(rank: int, rendezvous: str, cfg_data: dict, model_dir: str, out: str) -> None:
    """A compiled, sharded learner (dynamo's eager backend): its graph count after each step."""
    from torch._dynamo.utils import counters

    from trainer.learner import DataParallelGroup, Learner

    torch.set_num_threads(1)
    compile_module = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: compile_module(self, backend="eager", **kw)
    group = DataParallelGroup("127.0.0.1", meet(rank, Path(rendezvous)), rank, 2)
    learner = Learner(parse_config(cfg_data), model_dir, dist_group=group)
    graphs, losses = [], []
    for step, rows in enumerate(IDLE_ROWS[rank]):
        metrics = learner.rl_step(_padded_batch(rank, step, rows))
        losses.append(metrics.get("loss/total"))
        graphs.append(counters["stats"]["unique_graphs"])
    group.barrier()
    torch.save({"graphs": graphs, "losses": losses}, out)


def test_a_compiled_sharded_rank_with_fewer_micro_batches_compiles_nothing_new(nano, tmp_path):
    """`train.compile` with FSDP2: a rank with fewer micro-batches than the other (or none) runs
    idle passes for the collectives. They ran one row of two tokens with no padding: a shape no
    micro-batch has (dynamo specializes a batch of one row; HF gives the blocks no mask without
    padding), so a rank compiled the blocks again when it first fell short, mid-run (here rank 1
    went from 4 graphs to 5 at step 1). They now run at the shape of the rank's last
    micro-batch: the steps after the first compile nothing on either rank."""
    cfg_data = _cfg(nano, strategy="fsdp2", compile=True)
    cfg_data["algorithm"] = {"name": "grpo", "kl_coef": 0.05}
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    _spawn(_compiled_rank, lambda r: (r, str(tmp_path / "port"), cfg_data, str(nano), outs[r]))
    ranks = [torch.load(o, weights_only=False) for o in outs]
    for r, got in enumerate(ranks):
        first, *later = got["graphs"]
        assert first > 0, f"rank {r}: nothing compiled: vacuous"
        assert later == [first] * len(later), f"rank {r} compiled at a later step: {got['graphs']}"
    assert all(loss is not None for loss in ranks[0]["losses"])  # rank 0 trained every step
