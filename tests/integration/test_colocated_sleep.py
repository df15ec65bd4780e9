"""A colocated controller's turns on a GPU, acted out on a CPU: the trainer's state leaves the
device once a step, before its first draw, and comes back once, before training; the vLLM engine
sleeps once a step, after the step's last draw (dynamic sampling's refills generate from the same
weights), and with `rollout.sleep_level: 2` the weight sync loads a whole policy into it before
it generates again.

vLLM's sleep is a no-op on its CPU backend, so the engine here gets a stand-in for `LLM.sleep` and
`LLM.wake_up` that does to the CPU model what a GPU sleep does to its memory: level 1 keeps a host
copy of the weights and puts it back at wake-up; level 2 leaves NaN where they were (on a GPU
their memory is unmapped and comes back uninitialized). The learner's moves to and from the
device, no-ops on a CPU, are counted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from trainer.config import parse_config
from trainer.models import ensure_model

pytestmark = pytest.mark.slow

STEPS = 3


def _model_of(worker):
    return worker.model_runner.get_model()


class _GPUSleepOnCPU:
    """`LLM.sleep(level)` and `LLM.wake_up(tags)` as they treat a GPU engine's weights."""

    def __init__(self, llm):
        self.llm = llm
        self.calls: list[tuple] = []
        self.saved: dict[str, torch.Tensor] | None = None

    def params(self) -> dict[str, torch.Tensor]:
        model = self.llm.collective_rpc(_model_of)[0]
        return {k: p for k, p in model.named_parameters() if p.is_floating_point()}

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        params = self.params()
        self.saved = {k: p.detach().clone() for k, p in params.items()} if level == 1 else None
        for p in params.values():
            p.data.fill_(math.nan)

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))
        if "weights" in tags and self.saved is not None:
            for k, p in self.params().items():
                p.data.copy_(self.saved[k])
            self.saved = None


@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("models") / "nano"
    return ensure_model(parse_config({"model": {"path": str(model_dir), "preset": "nano"}}))


@pytest.mark.parametrize("level", [1, 2])
def test_the_engine_sleeps_once_a_step_after_its_refills_and_is_loaded_before_it_generates(
        nano, tmp_path, monkeypatch, level):
    import trainer.rollout as rollout
    from trainer.controller import ControllerLoop
    from trainer.learner import Learner
    from trainer.rollout.vllm_engine import EngineSleep

    torch.set_num_threads(1)
    made: list = []
    make_engine = rollout.make_engine

    def make_sleepy_engine(cfg, model_dir, **kwargs):
        engine = make_engine(cfg, model_dir, **kwargs)
        engine._sleep = EngineSleep(_GPUSleepOnCPU(engine.llm), cfg.rollout.sleep_level, active=True)
        made.append(engine)
        return engine

    moves: list[str] = []
    monkeypatch.setattr(rollout, "make_engine", make_sleepy_engine)
    monkeypatch.setattr(Learner, "release_device", lambda self: moves.append("release"))
    monkeypatch.setattr(Learner, "reclaim_device", lambda self: moves.append("reclaim"))
    cfg = {
        "model": {"path": str(nano), "preset": "nano"},
        "data": {"arithmetic": {"train_size": 200, "eval_size": 4}},
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "train": {"max_steps": STEPS, "batch_size": 2, "lr": 1e-3},
        # an untrained model: every group scores alike and is dropped, so each step refills twice
        "rollout": {"engine": "vllm", "n": 4, "max_new_tokens": 4, "kv_cache_gb": 0.05,
                    "sleep_level": level},
        "sampling": {"dynamic": True, "max_refills": 2},
        "placement": {"mode": "colocate", "devices": 1, "device_type": "cpu"},
        "checkpoint": {"every_steps": 100, "export_final": False},
        "eval": {"size": 4},
    }
    loop = ControllerLoop(json.dumps(cfg), rank=0, world=1, device=0, device_type="cpu", cores=1,
                          run_dir=str(tmp_path / "run"), rollout_workers=[], local_sampler=True,
                          model_dir=str(nano))
    loop._swaps_device = True  # what device_type="gpu" sets: the CPU learner's moves are counted
    loop.run("127.0.0.1", 0, close_engine=False)
    (engine,) = made
    try:
        metrics = [r["metrics"] for r in loop.drain() if r["type"] == "metrics" and r["step"] > 0]
        assert len(metrics) == STEPS
        assert all(m["sampling/refills"] == 2 for m in metrics)  # three draws a step
        # the trainer's state left the device once a step and came back once
        assert moves == ["release", "reclaim"] * STEPS
        # one sleep a step, at the level asked; the weight sync woke the weights alone, and the next
        # step's first generate the KV cache (none after the last step's sync)
        sleepy = engine._sleep.llm
        step = [("sleep", level), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
        assert sleepy.calls == step * (STEPS - 1) + step[:2]
        # every weight the engine holds is a number again: the sync loaded each one (what a level-2
        # sleep discarded included), not a part of them; the vocabulary's padding rows too
        assert all(torch.isfinite(p).all() for p in sleepy.params().values())
        policy = dict(loop.learner.named_weights())
        embed = next(k for k in policy if k.endswith("embed_tokens.weight"))
        vllm_embed = next(p for k, p in sleepy.params().items() if k.endswith("embed_tokens.weight"))
        rows = policy[embed].shape[0]  # vLLM pads the vocabulary, with zeros
        assert torch.equal(vllm_embed[:rows].float(), policy[embed].to(vllm_embed.dtype).float())
        assert vllm_embed.shape[0] > rows and not vllm_embed[rows:].any()
        # generating from what sleep discarded is refused, not sampled from
        engine.wake()
        engine.sleep()
        if level == 2:
            with pytest.raises(RuntimeError, match="level-2 sleep"):
                engine.generate(["1+1="], 1)
        else:
            assert len(engine.generate(["1+1="], 1)) == 1
    finally:
        engine.close()
