"""Peak memory per device before launch: will this placement fit?

From the model's shape (config.json: layers, hidden, intermediate, vocab, heads), the algorithm
(reference for KL, critic for PPO), the optimizer (AdamW: two states per parameter), the dtype,
the rollout settings (KV cache: ``rollout.kv_cache_gb`` on CPU, ``gpu_memory_utilization`` on a
GPU), a reward model, and the placement (which roles share a device), estimate the peak bytes
of the busiest device and compare it with the device's memory: ``placement.device_memory_gb``
when set, else the GPU's memory, else (CPU) the host's RAM divided by the devices.

`check_memory` raises ConfigError naming the field to change and saying what would fit. The
per-process runtime terms (a Python process with torch; a vLLM engine) are calibrated from peak
RSS measured on this machine (docs/placement.md); a GPU adds its CUDA context instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, TrainerConfig
from trainer.precision import sampler_dtype

__all__ = ["MemoryEstimate", "ModelShape", "check_memory", "device_memory_bytes",
           "estimate_memory", "model_shape"]

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Resident size of a process apart from its models, measured here (docs/placement.md): a Ray
# actor with torch, transformers, the task's data and gloo (a training-only controller of the demo
# peaked at 0.80 GiB on 2026-12-07, 0.65 GiB with the stack of 2026-12-02), and what an in-process
# vLLM engine adds besides its KV cache (a rollout worker peaked at 1.84 GiB with a 1 GiB KV cache,
# then; 1.14 GiB with its 0.125 GiB on 2026-12-07). vLLM's CPU KV cache is resident in full: an
# engine with 3 GiB peaked exactly 2.0 GiB above one with 1 GiB.
CPU_PROCESS_BYTES = 0.75 * GiB
CPU_VLLM_ENGINE_BYTES = 0.25 * GiB
GPU_CONTEXT_BYTES = 1.0 * GiB  # CUDA context, cuBLAS workspace, NCCL buffers
# Activation bytes kept for backward, per token, per layer, per hidden unit (fp32 eager attention,
# no checkpointing; Korthikanti et al. 2022 count ~34 bytes/hidden/token at 16-bit).
ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER = 64


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied: bool = True
    max_positions: int | None = None  # the longest sequence (max_position_embeddings)
    head_dim: int | None = None  # where the config sets it apart from hidden / heads

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        attn = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o (+ q/k/v biases as in Qwen2)
        mlp = 3 * h * self.intermediate  # gate, up, down
        per_layer = attn + mlp + 2 * h
        embed = self.vocab * h * (1 if self.tied else 2)
        return embed + self.layers * per_layer + h

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> ModelShape:
        """From an HF config.json (Llama/Qwen/Mistral keys, GPT-2 keys as a fallback)."""
        h = int(c.get("hidden_size") or c["n_embd"])
        heads = int(c.get("num_attention_heads") or c.get("n_head") or 1)
        return cls(layers=int(c.get("num_hidden_layers") or c["n_layer"]), hidden=h,
                   intermediate=int(c.get("intermediate_size") or c.get("n_inner") or 4 * h),
                   vocab=int(c["vocab_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   tied=bool(c.get("tie_word_embeddings", True)),
                   max_positions=int(c.get("max_position_embeddings") or c.get("n_positions") or 0) or None,
                   head_dim=int(c["head_dim"]) if c.get("head_dim") else None)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """K and V of every layer for one token, on one rank of a tensor-parallel engine."""
        head_dim = self.head_dim or self.hidden // self.heads
        return self.layers * 2 * max(1, self.kv_heads // tensor_parallel) * head_dim * dtype_bytes


def read_shape(path: str | None) -> ModelShape | None:
    if not path:
        return None
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        return ModelShape.from_config(json.loads(f.read_text()))
    except (KeyError, ValueError, TypeError, json.JSONDecodeError):
        return None


def model_shape(cfg: TrainerConfig) -> ModelShape | None:
    """The policy's shape: its config.json, else the preset it will be built from, else None."""
    shape = read_shape(cfg.model.path)
    if shape is None and cfg.model.preset is not None:
        from trainer.models import PRESETS

        p = PRESETS[cfg.model.preset]
        shape = ModelShape(layers=p.layers, hidden=p.hidden, intermediate=p.intermediate,
                           vocab=p.bpe_vocab, heads=p.heads, kv_heads=p.kv_heads,
                           max_positions=p.max_positions)
    return shape


# vLLM's default for a CPU engine (`EngineArgs`: 256 for the LLM class off the large GPUs): the
# most sequences a yatt engine's scheduler runs at once, fewer where a run never hands it as many
CPU_MAX_NUM_SEQS = 256


def cpu_max_num_seqs(cfg: TrainerConfig) -> int:
    """The sequences a vLLM-CPU engine's scheduler runs at once: as many as one generate of the
    run can hand an engine, up to vLLM's default of ``CPU_MAX_NUM_SEQS``. A generate holds at
    most the step's prompts × `rollout.n` (the whole batch: one engine samples for every rank
    of a single controller or a tensor-parallel group); with dynamic sampling each rank asks for
    up to `sampling.max_oversample` times its share at a draw, rounded up (at most one prompt
    more per rank, and a layout has no more ranks than devices). Evaluation decodes through the
    learner, not the engine. A larger generate is still served, in waves."""
    prompts = cfg.train.batch_size
    if cfg.sampling.dynamic:
        prompts = math.ceil(prompts * cfg.sampling.max_oversample) + cfg.placement.devices
    return max(1, min(CPU_MAX_NUM_SEQS, prompts * cfg.rollout.n))


def cpu_kv_cache_bytes(cfg: TrainerConfig, shape: ModelShape | None) -> int:
    """The KV cache a vLLM-CPU engine allocates: ``rollout.kv_cache_gb``, but no more than its
    scheduler can fill, ``cpu_max_num_seqs`` sequences at the model's full length, each rank of a
    tensor-parallel engine holding its share of the KV heads. More is never used, and vLLM zeroes
    all of it when the engine starts: 1 GiB cost a controller's start 0.6-2.2 s on the Zen 4 EPYC
    (placement to warm start, 10.8 against 8.6 s and, an hour later, 10.2 against 9.6 s with the
    demo's 128 MiB; fresh pages cost this VM more at some times than at others). The setting
    itself where the shape or its length is not known."""
    setting = int(cfg.rollout.kv_cache_gb * GiB)
    if shape is None or not shape.max_positions:
        return setting
    per_token = shape.kv_bytes_per_token(DTYPE_BYTES[sampler_dtype(cfg, "cpu")],
                                         cfg.rollout.tensor_parallel_size)
    return min(setting, cpu_max_num_seqs(cfg) * shape.max_positions * per_token)


@dataclass
class MemoryEstimate:
    """Bytes on the busiest device, by part, and what each kind of device holds."""

    device_type: str
    peak_bytes: float
    available_bytes: float | None
    parts: dict[str, float]  # the busiest device's parts
    devices: dict[str, dict[str, float]] = field(default_factory=dict)  # role → parts

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.peak_bytes <= self.available_bytes

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items() if v >= 0.005 * GiB)
        avail = (f"{self.available_bytes / GiB:.2f} GiB available" if self.available_bytes
                 else "device memory unknown")
        return f"estimated peak {self.peak_bytes / GiB:.2f} GiB per device ({parts}) vs {avail}"


def device_memory_bytes(cfg: TrainerConfig, device_type: str, *, probe_gpu: bool = False) -> float | None:
    """Memory of one device: the config's figure, else the GPU's (when probing is allowed), else
    on CPU the host's RAM split evenly over the devices; None when unknown."""
    if cfg.placement.device_memory_gb is not None:
        return cfg.placement.device_memory_gb * GiB
    if device_type == "gpu":
        if probe_gpu:
            try:
                import torch

                if torch.cuda.is_available():
                    return float(torch.cuda.get_device_properties(0).total_memory)
            except Exception:
                return None
        return None
    import psutil

    return psutil.virtual_memory().total / cfg.placement.devices


def _resolved_device_type(cfg: TrainerConfig) -> str:
    if cfg.placement.device_type != "auto":
        return cfg.placement.device_type
    try:
        import torch  # noqa: F401 — only asked when already importable cheaply

        return "gpu" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def estimate_memory(cfg: TrainerConfig, *, device_type: str | None = None,
                    available_bytes: float | None = None,
                    shape: ModelShape | None = None,
                    prompt_tokens: int | None = None) -> MemoryEstimate | None:
    """Peak bytes per device for `cfg`'s placement; None when the model's shape is unknown (a hub
    id not downloaded yet). `prompt_tokens`: the prompts' length when it is known (a benchmark's
    fixed batches); otherwise it is guessed from the data settings."""
    shape = shape or model_shape(cfg)
    if shape is None:
        return None
    dt = device_type or _resolved_device_type(cfg)
    wb = DTYPE_BYTES[cfg.model.dtype]
    P = shape.params
    weights = P * wb
    algo = cfg.algorithm
    train: dict[str, float] = {
        "policy": weights,
        "gradients": weights,
        "optimizer": 2 * weights,  # AdamW's two moments, in the parameters' dtype
    }
    if algo.kl_coef > 0 and algo.name != "sft":
        train["reference"] = weights
    if algo.name == "ppo":
        train["critic"] = 4 * weights
    seq = _seq_tokens(cfg, prompt_tokens)
    mb = min(cfg.train.micro_batch_size, cfg.train.batch_size * cfg.rollout.n)
    # gradient checkpointing keeps each block's input and recomputes one block at a time
    kept_layers = 1 if cfg.train.gradient_checkpointing else shape.layers
    kept_inputs = shape.layers * shape.hidden * 4 if cfg.train.gradient_checkpointing else 0
    # the LM head runs at response positions only; its fp32 logits stay for the backward (their
    # gradient exists one chunk at a time), and the entropy's softmax too when it is trained
    logit_bytes = (8 if algo.entropy_coef > 0 else 4) * shape.vocab
    train["activations"] = mb * (seq * (kept_layers * shape.hidden * ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER
                                        + kept_inputs)
                                 + cfg.rollout.max_new_tokens * logit_bytes)
    if cfg.train.strategy == "fsdp2":
        # each rank holds 1/ranks of every sharded state, plus the blocks gathered for compute
        # (the one running and the next) and the root's (embeddings, LM head), in compute dtype
        ranks = cfg.data_parallel_size
        for part in ("policy", "gradients", "optimizer", "reference", "critic"):
            if part in train:
                train[part] /= ranks
        if cfg.train.offload_optimizer and dt == "gpu":
            for part in ("policy", "gradients", "optimizer"):  # CPUOffloadPolicy: in host memory
                train.pop(part)
        cb = 4.0 if cfg.train.mixed_precision == "fp32" else 2.0  # auto: bf16 on bf16 hardware
        embed = shape.vocab * shape.hidden
        train["gathered"] = (2 * (P - embed) / max(1, shape.layers) + embed) * cb
    if cfg.reward.kind == "model":
        rm = read_shape(cfg.reward.model_path)
        if rm is not None:
            train["reward_model"] = rm.params * 4.0
    sampler: dict[str, float] = {}
    if dt == "gpu":
        avail = available_bytes if available_bytes is not None else device_memory_bytes(cfg, dt)
        # vLLM takes this share of the device for weights, activations and its KV cache
        sampler["sampler"] = (cfg.rollout.gpu_memory_utilization * avail) if avail else weights
        runtime = {"runtime": GPU_CONTEXT_BYTES}
        engine_runtime = 0.0
    else:
        # a tensor-parallel engine holds 1/tp of the weights on each of its devices
        sampler["sampler_weights"] = (P * DTYPE_BYTES[sampler_dtype(cfg, "cpu")]
                                      / cfg.rollout.tensor_parallel_size)
        sampler["kv_cache"] = float(cpu_kv_cache_bytes(cfg, shape))
        runtime = {"runtime": CPU_PROCESS_BYTES}
        engine_runtime = CPU_VLLM_ENGINE_BYTES if cfg.rollout.engine == "vllm" else 0.0
    if engine_runtime:
        sampler["engine_runtime"] = engine_runtime
    if cfg.rollout.engine == "hf" and dt == "cpu":
        sampler = {"sampler_weights": weights,
                   "kv_cache": _hf_kv_bytes(shape, cfg, wb)}
    devices: dict[str, dict[str, float]] = {}
    mode = cfg.placement.mode
    if mode == "disaggregated":
        devices["train"] = {**runtime, **train}
        devices["rollout"] = {**runtime, **sampler}
        share = cfg.placement.reference_on_rollout
        if "reference" in train and share != 0 and not (share == "auto" and dt == "gpu"):
            # the worker's copy of the frozen reference, and one micro-batch's forward through it
            devices["rollout"]["reference"] = weights
            devices["rollout"]["reference_activations"] = mb * cfg.rollout.max_new_tokens * 4 * shape.vocab
    elif mode == "partial_colocate":
        # the reward model lives only on the scoring devices, in a scorer process of its own
        reward_model = train.pop("reward_model", 0.0)
        devices["train+rollout"] = {**runtime, **train, **sampler}
        if cfg.placement.reward_devices:
            devices["train+rollout+reward"] = {**runtime, **train, **sampler,
                                               "scorer_runtime": runtime["runtime"],
                                               "reward_model": reward_model}
    else:  # colocate, auto (as colocate: the plan that holds the most)
        devices["train+rollout"] = {**runtime, **train, **sampler}
        if cfg.controller.mode == "single" and cfg.placement.devices > 1:
            devices["rollout"] = {**runtime, **sampler}
    role, parts = max(devices.items(), key=lambda kv: sum(kv[1].values()))
    avail = available_bytes if available_bytes is not None else device_memory_bytes(cfg, dt)
    return MemoryEstimate(device_type=dt, peak_bytes=sum(parts.values()), available_bytes=avail,
                          parts=parts, devices=devices)


def _seq_tokens(cfg: TrainerConfig, prompt_tokens: int | None = None) -> int:
    # prompts of the built-in task are short; a file's prompts are bounded by the context
    prompt = 4 * cfg.data.arithmetic.digits + 4 if cfg.data.path is None else 512
    return (prompt if prompt_tokens is None else prompt_tokens) + cfg.rollout.max_new_tokens


def _hf_kv_bytes(shape: ModelShape, cfg: TrainerConfig, wb: int) -> float:
    seqs = cfg.train.batch_size * cfg.rollout.n
    return float(shape.kv_bytes_per_token(wb) * _seq_tokens(cfg) * seqs)


def _with(cfg: TrainerConfig, **changes: Any) -> TrainerConfig | None:
    """`cfg` with dotted-path changes, or None when that config does not validate."""
    from trainer.config import parse_config

    data = cfg.model_dump()
    for path, value in changes.items():
        node = data
        *head, last = path.split("__")
        for part in head:
            node = node[part]
        node[last] = value
    try:
        return parse_config(data)
    except ConfigError:
        return None


def check_memory(cfg: TrainerConfig, *, probe_gpu: bool = False) -> MemoryEstimate | None:
    """Raise ConfigError when the busiest device cannot hold its roles; the errors name the
    fields to change (first the most direct one) and what value of each would fit.

    `placement.mode: auto` is checked as the plan it starts with (colocate, or the first
    candidate that fits); when no candidate fits, colocate's errors say what to change."""
    if cfg.placement.mode == "auto":
        from trainer.placement.auto import layout_config, starting_layout

        start: TrainerConfig | None
        try:
            start = layout_config(cfg, starting_layout(cfg))
        except ConfigError:
            start = _with(cfg, placement__mode="colocate")
        if start is not None:
            return check_memory(start, probe_gpu=probe_gpu)
    dt = _resolved_device_type(cfg) if probe_gpu else (
        "cpu" if cfg.placement.device_type == "auto" else cfg.placement.device_type)
    avail = device_memory_bytes(cfg, dt, probe_gpu=probe_gpu)
    shape = model_shape(cfg)
    est = estimate_memory(cfg, device_type=dt, available_bytes=avail, shape=shape)
    if est is None or est.fits or avail is None:
        return est
    over = est.peak_bytes - avail
    head = f"{est.describe()}: does not fit"
    fixes: list[tuple[str, str]] = []
    p = cfg.placement

    def fits(alt: TrainerConfig | None, available: float | None = avail) -> bool:
        if alt is None:
            return False
        e = estimate_memory(alt, device_type=dt, available_bytes=available, shape=shape)
        return e is not None and e.fits

    if dt == "cpu" and cfg.rollout.engine == "vllm":
        kv = (est.parts.get("kv_cache", 0.0) - over) / GiB  # the cache the engine would allocate
        kv = math.floor(kv * 10) / 10
        if kv >= 0.1:
            fixes.append(("rollout.kv_cache_gb", f"rollout.kv_cache_gb ≤ {kv:g} would fit"))
    if dt == "gpu":
        util = math.floor((cfg.rollout.gpu_memory_utilization - over / avail) * 100) / 100
        if util >= 0.05:
            fixes.append(("rollout.gpu_memory_utilization",
                          f"rollout.gpu_memory_utilization ≤ {util:g} would fit"))
    if dt == "cpu" and cfg.rollout.engine == "vllm" and p.mode == "colocate":
        tp = cfg.rollout.tensor_parallel_size
        for k in range(tp + 1, p.devices + 1):
            if p.devices % k == 0 and fits(_with(cfg, rollout__tensor_parallel_size=k)):
                fixes.append(("rollout.tensor_parallel_size", f"rollout.tensor_parallel_size={k} "
                              "would fit (each engine's weights split over that many devices)"))
                break
    if p.mode != "disaggregated" and p.devices >= 2 and fits(_with(cfg, placement__mode="disaggregated")):
        fixes.append(("placement.mode", "placement.mode=disaggregated would fit (training and "
                      "rollout on separate devices)"))
    if cfg.model.dtype == "float32" and fits(_with(cfg, model__dtype="bfloat16")):
        fixes.append(("model.dtype", "model.dtype=bfloat16 would fit"))
    if dt == "cpu" and p.device_memory_gb is None and p.devices > 1:
        import psutil

        total = psutil.virtual_memory().total
        for d in range(p.devices - 1, 0, -1):
            alt = _with(cfg, placement__devices=d)
            if alt is not None and fits(alt, total / d):
                fixes.append(("placement.devices", f"placement.devices={d} would fit (each CPU "
                              f"device gets {total / d / GiB:.1f} GiB of the host's RAM)"))
                break
    if cfg.train.micro_batch_size > 1 and est.parts.get("activations", 0) > over:
        fixes.append(("train.micro_batch_size", "a smaller train.micro_batch_size would fit"))
    if not fixes:
        fixes.append(("placement.device_memory_gb" if p.device_memory_gb is not None
                      else "placement.devices",
                      "no single change found that fits; use a smaller model or larger devices"))
    path0, fix0 = fixes[0]
    errors = [(path0, f"{head}; {fix0}")]
    errors += [(path, fix) for path, fix in fixes[1:]]
    raise ConfigError(errors)
