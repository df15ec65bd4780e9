"""Shared pieces of the trainer's end-to-end tests: one local Ray head for the session, a tiny
config, and readers for a run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.config import TrainerConfig, parse_config


@pytest.fixture(scope="session")
def ray_head():
    """A real local Ray head with two CPU devices declared as `yatt_device` (as `yatt train` does)."""
    import os

    import ray

    from trainer.entry import PROJECT_ROOT

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, resources={"yatt_device": 2.0},
                 include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(PROJECT_ROOT)}})
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def nano_model(tmp_path_factory) -> str:
    """A nano model built once for the session (random init, arithmetic tokenizer)."""
    from trainer.models import ensure_model

    path = tmp_path_factory.mktemp("models") / "nano"
    ensure_model(parse_config({"model": {"path": str(path), "preset": "nano"}}))
    return str(path)


def tiny_config(model: str, **groups: dict[str, Any]) -> TrainerConfig:
    """A run that takes seconds: nano model, 1-digit sums, a few small steps."""
    data: dict[str, Any] = {
        "model": {"path": model},
        "data": {"task": "arithmetic", "arithmetic": {"digits": 1, "train_size": 80, "eval_size": 20}},
        "algorithm": {"name": "grpo", "warm_start": {"steps": 10, "batch_size": 16, "lr": 3e-3}},
        "train": {"max_steps": 3, "batch_size": 4, "lr": 1e-4, "micro_batch_size": 32},
        "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 3, "kv_cache_gb": 0.25},
        "placement": {"mode": "colocate", "devices": 2},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "eval": {"size": 20},
        "report": {"flush_interval_s": 0.2},
    }
    for group, values in groups.items():
        data.setdefault(group, {})
        data[group] = {**data[group], **values} if isinstance(values, dict) else values
    return parse_config(data)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())
