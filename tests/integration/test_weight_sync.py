"""Weights reach rollout engines on other Ray actors by one bucketed gloo broadcast: afterwards
every engine (real vLLM) answers exactly as the trainer's policy does, and nothing went through
the Ray object store."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.e2e import trainer_helpers as helpers
from tests.integration.test_models_rollout import _sft
from trainer.config import parse_config

pytestmark = pytest.mark.slow

ray_head = helpers.ray_head
PROMPTS = ["12+35=", "7+8=", "40+2=", "3+3="]
BUCKET_BYTES = 256 * 1024  # the nano model is about 1 MB: several buckets


def _cfg(model_dir: str) -> Any:
    return parse_config({
        "model": {"path": model_dir},
        "data": {"arithmetic": {"train_size": 2000, "eval_size": 50}},
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        # float32: greedy answers are compared with the learner's exactly, and `auto` samples in
        # bf16 on a CPU with AVX512-BF16 or AMX, where a close argmax can fall the other way
        "rollout": {"engine": "vllm", "max_new_tokens": 6, "kv_cache_gb": 0.25, "temperature": 0.0,
                    "dtype": "float32", "weight_sync_bucket_mb": BUCKET_BYTES / 2**20},
        "placement": {"device_type": "cpu"},
    })


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A nano model (what the engines start from) and an SFT-trained copy (the new policy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import load_task
    from trainer.models import ensure_model

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("models") / "nano"
    cfg = parse_config({**_cfg(str(base)).model_dump(), "model": {"path": str(base), "preset": "nano"}})
    ensure_model(cfg)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    assert _sft(model, tok, load_task(cfg)[0], steps=120) < 1.5
    trained = base.parent / "trained"
    model.save_pretrained(trained)
    tok.save_pretrained(trained)
    return str(base), str(trained)


def _training_source_class() -> Any:
    """Built in a function so that Ray ships the class itself (pytest's module name for this
    file is not importable in a worker)."""

    class TrainingSource:
        """A training rank as far as weights go: a real Learner and its end of trainer.weight_sync."""

        def __init__(self, cfg_json: str, model_dir: str):
            from trainer.learner import Learner
            from trainer.weight_sync import TrainerWeightSync

            torch.set_num_threads(1)
            self.cfg = parse_config(json.loads(cfg_json))
            self.learner = Learner(self.cfg, model_dir, device="cpu")
            self.sync = TrainerWeightSync(device=9, bucket_bytes=BUCKET_BYTES)

        def address(self) -> tuple[str, int]:
            from trainer import rendezvous

            return rendezvous.host()

        def open_weight_broadcast(self, addr: str, port: int, receivers: list[Any], backend: str) -> None:
            self.sync.open_broadcast(addr, port, receivers, backend=backend)

        def load(self, model_dir: str) -> None:
            from transformers import AutoModelForCausalLM

            self.learner.policy.load_state_dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())

        def push(self, version: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
            return self.sync.push(version, lambda: self.learner.named_weights().items())

        def greedy(self, prompts: list[str]) -> list[str]:
            return self.learner.greedy(prompts, self.cfg.rollout.max_new_tokens)

        def weight_bytes(self) -> int:
            return sum(t.numel() * t.element_size() for t in self.learner.named_weights().values())

        def receiver_spans(self) -> list[dict[str, Any]]:
            return self.sync.receiver_spans()

    return TrainingSource


def _object_store_bytes_created(ray: Any) -> int:
    """Bytes ever put into the Ray object store of this cluster (plasma; inlined small values
    are not counted)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    address = ray.get_runtime_context().gcs_address
    return int(get_memory_info_reply(get_state_from_address(address)).store_stats.cumulative_created_bytes)


def test_broadcast_puts_the_learners_policy_into_every_vllm_engine(ray_head, models):
    import ray

    from trainer.controller import RolloutWorker
    from trainer.weight_sync import connect_broadcast

    base, trained = models
    cfg_json = _cfg(base).model_dump_json()
    env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                        "TOKENIZERS_PARALLELISM": "false"}}
    workers = [ray.remote(RolloutWorker).options(num_cpus=0, runtime_env=env).remote(
        cfg_json, d, base, "cpu", 1.0) for d in (0, 1)]
    source = ray.remote(_training_source_class()).options(num_cpus=0, runtime_env=env).remote(
        _cfg(trained).model_dump_json(), trained)
    try:
        def answers() -> list[tuple[int, list[str]]]:
            outs = ray.get([w.generate.remote(PROMPTS, 1) for w in workers], timeout=300)
            return [(o["version"], [s.response_text for s in o["samples"]]) for o in outs]

        before = answers()
        expected = ray.get(source.greedy.remote(PROMPTS))
        assert all(texts != expected for _, texts in before)  # the engines hold the base model
        connect_broadcast(source, workers, backend="gloo")

        created = _object_store_bytes_created(ray)
        metrics, spans = ray.get(source.push.remote(5), timeout=300)
        after = answers()
        assert _object_store_bytes_created(ray) - created < 64 * 1024  # no weights went through it

        # every engine now answers exactly as the learner's policy, and knows its version
        assert after == [(5, expected), (5, expected)], (after, expected)
        assert metrics["weight_sync/bytes"] == ray.get(source.weight_bytes.remote())
        assert metrics["weight_sync/buckets"] >= 3 and metrics["weight_sync/receivers"] == 2
        assert metrics["weight_sync/bytes_per_s"] > 0
        assert [s["phase"] for s in spans if s["device"] == 9][-1] == "weight_sync"
        received = ray.get(source.receiver_spans.remote())
        assert sorted(s["device"] for s in received) == [0, 1]
        assert all(s["phase"] == "weight_sync" and s["end"] >= s["start"] > 0 for s in received)

        # a second round over the same group: back to the base weights, version 6
        ray.get(source.load.remote(base))
        ray.get(source.push.remote(6), timeout=300)
        assert answers() == [(6, before[0][1]), (6, before[1][1])]
    finally:
        for w in workers:
            ray.get(w.close.remote(), timeout=60)
        for actor in [*workers, source]:
            ray.kill(actor)
