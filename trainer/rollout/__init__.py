"""Rollout engines: ``make_engine(cfg, model_dir, threads=...)`` picks vLLM or HF ``generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.config import TrainerConfig
from trainer.precision import sampler_dtype
from trainer.rollout.base import FinishReason, RolloutEngine, Sample

__all__ = ["FinishReason", "RolloutEngine", "Sample", "make_engine", "rollout_device", "sampler_dtype"]


def rollout_device(cfg: TrainerConfig) -> str:
    """``cuda`` when the placement asks for (or auto-detects) a GPU, else ``cpu``."""
    import torch

    kind = cfg.placement.device_type
    if kind == "gpu" or (kind == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def make_engine(
    cfg: TrainerConfig, model_dir: str | Path, *, threads: int, seed: int | None = None,
    tensor_parallel: Any = None,
) -> RolloutEngine:
    """The engine ``cfg.rollout.engine`` names, loaded from ``model_dir``, using ``threads`` cores.

    ``seed`` (default ``cfg.seed``) should differ per controller so ranks sample differently
    (and be the same on every rank of one ``tensor_parallel`` group: a
    ``vllm_engine.TensorParallelGroup``, this process's shard of a vLLM engine).
    """
    import torch

    device = rollout_device(cfg)
    if cfg.rollout.engine == "vllm":
        from trainer.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, cfg, threads=threads, seed=seed, device=device,
                          tensor_parallel=tensor_parallel)
    from trainer.rollout.hf_engine import HFEngine

    if device == "cpu":
        torch.set_num_threads(threads)
    return HFEngine(model_dir, cfg, seed=seed, device=device)
