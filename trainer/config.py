"""TrainerConfig: the one contract between the API, the CLI, the dashboard and the trainer.

Config groups per role, in the spirit of verl / OpenRLHF: ``model``, ``data``, ``algorithm``,
``train``, ``rollout``, ``reward``, ``controller``, ``placement``, ``sampling``, ``checkpoint``,
``eval``, ``report`` and ``seed``. Unknown keys are rejected everywhere, so a typo is an error
that names its dotted path, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "TrainerConfig",
    "ConfigError",
    "load_config",
    "parse_config",
    "apply_overrides",
    "validation_errors",
]


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Group):
    path: str = Field(
        ".yatt/models/arith-micro",
        description="Local model directory or hub id. With `preset`, a missing directory is "
        "built locally (random init, tokenizer trained on the task's text).",
        examples=[".yatt/models/arith-micro", "Qwen/Qwen2.5-0.5B-Instruct"],
    )
    preset: Literal["nano", "micro", "small"] | None = Field(
        None, description="Build a tiny model at `path` when it does not exist yet."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False


class ArithmeticConfig(_Group):
    digits: int = Field(2, ge=1, le=6, description="Digits per operand.")
    ops: list[Literal["+", "-", "*"]] = Field(default=["+"], min_length=1)
    train_size: int = Field(20_000, ge=1)
    eval_size: int = Field(256, ge=1)


class DataConfig(_Group):
    task: Literal["arithmetic"] | None = Field(
        "arithmetic", description="Built-in synthetic task with verifiable answers."
    )
    path: str | None = Field(
        None, description="JSONL or Parquet prompt file, or a hub dataset id; overrides `task`."
    )
    eval_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)

    @model_validator(mode="after")
    def _needs_a_source(self) -> DataConfig:
        if self.task is None and self.path is None:
            raise ValueError("set data.task or data.path")
        return self


class WarmStartConfig(_Group):
    steps: int = Field(0, ge=0, description="SFT steps before RL; 0 disables the warm start. "
                       "With `target_accuracy`, the step budget.")
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(64, ge=1)
    target_accuracy: float | None = Field(
        None, gt=0, le=1, description="Stop SFT once greedy exact-match accuracy on a dev split "
        "(held out of SFT, not the eval set) reaches this; `steps` caps it. None: run `steps`."
    )
    eval_every: int = Field(50, ge=1, description="SFT steps between dev-split evaluations.")
    dev_size: int = Field(128, ge=1, description="Train examples held out of SFT as the dev split.")

    @model_validator(mode="after")
    def _target_has_a_budget(self) -> WarmStartConfig:
        if self.target_accuracy is not None and self.steps == 0:
            raise ValueError("algorithm.warm_start.target_accuracy needs warm_start.steps > 0 "
                             "(the step budget)")
        return self


class AlgorithmConfig(_Group):
    name: Literal["grpo", "ppo", "rloo", "reinforce_pp", "sft"] = "grpo"
    kl_coef: float = Field(0.0, ge=0, description="KL to the frozen reference; 0 disables it.")
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_in_reward: bool = Field(False, description="Subtract KL from the reward instead of the loss.")
    clip_ratio_low: float = Field(0.2, gt=0, lt=1)
    clip_ratio_high: float = Field(0.2, gt=0, description="> clip_ratio_low is DAPO clip-higher.")
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    entropy_coef: float = Field(0.0, ge=0)
    norm_adv_by_std: bool = True
    gamma: float = Field(1.0, gt=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    critic_lr: float = Field(1e-4, gt=0)
    overlong_penalty: float = Field(0.0, ge=0, description="DAPO soft overlong penalty weight.")
    tis_cap: float = Field(
        2.0, ge=0, description="Truncated importance sampling: each token's loss is weighted by "
        "min(pi_trainer / pi_sampler, tis_cap), correcting stale samples and sampler/trainer "
        "mismatch; 0 leaves the ratio untruncated.")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)


class TrainConfig(_Group):
    max_steps: int = Field(50, ge=1)
    lr: float = Field(1e-5, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1, description="Prompts per step, across all controllers.")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward chunk.")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Also cap a chunk's padded tokens (rows × its longest row), as "
        "verl's `ppo_max_token_len_per_gpu`: the rows are sorted by length, so a chunk of short "
        "responses is not padded to the longest of the batch. None: rows only.",
        examples=[2048],
    )
    pad_to_multiple: int | Literal["auto"] = Field(
        "auto", description="Round each micro-batch's sequence length up to a multiple of this "
        "(HF's `pad_to_multiple_of`): sampled lengths differ every step, and a pass over shapes "
        "it has not met costs more per token than over shapes it has (docs/benchmarks.md, "
        "\"Shape buckets\"). auto: a multiple of 16, or of the largest power of two within a "
        "sixteenth of the length where that is smaller (a length under 256 pads by at most 1/16; "
        "short sequences, whose few lengths repeat anyway, stay nearly exact). 1: each "
        "micro-batch at its own longest row.",
        examples=["auto", 1, 64],
    )

    @field_validator("pad_to_multiple")
    @classmethod
    def _positive_multiple(cls, v: int | str) -> int | str:
        if v != "auto" and (not isinstance(v, int) or v < 1):
            raise ValueError("must be 'auto' or a whole number of tokens >= 1")
        return v

    balance_ranks: Literal["queue", "deal", "off"] = Field(
        "queue", description="How the data-parallel ranks share a step's training work; the global "
        "batch and its loss are the same either way. queue: each rank publishes its rows as its "
        "rollout ends and starts on its own micro-batches at once; a rank out of work takes the "
        "next micro-batch of another rank's rows, so no rank waits for another's rollout while "
        "there is work, nor for the slowest backward (not reproducible bit for bit from run to "
        "run: which rank sums which micro-batch's gradient depends on timing; with `ppo_epochs` above 1 "
        "the later epochs replay the first one's sharing). Where the advantages need more than a "
        "prompt group's scores (a KL in the reward, a critic, whitening over the batch) the "
        "ranks share the passes they need first, the same way. It applies with `strategy: ddp`; "
        "under fsdp2 the ranks deal. "
        "deal: before the update, deal whole prompt groups so that each rank passes about as many "
        "tokens (verl's `balance_batch`). off: each rank trains its own rows. true and false "
        "mean deal and off.")
    ppo_epochs: int = Field(1, ge=1)
    grad_clip: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp", description="How the training ranks hold the models (verl's `actor.strategy`): "
        "ddp: a full policy, reference and critic per rank, gradients all-reduced; fsdp2: "
        "parameters, gradients and optimizer state sharded across the ranks "
        "(torch.distributed.fsdp.fully_shard, block by block; gloo on CPU, NCCL on GPU).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward instead of keeping them.")
    compile: bool = Field(
        False, description="torch.compile each transformer block of the policy, reference and "
        "critic (dynamic shapes), as torchtitan does: fused element-wise work in the training "
        "and reference passes. Measured on this 2-core CPU (`small` model, 16 × 268 tokens, one "
        "core): a GRPO step 2.34 → 1.67 s, after about 30 s of compiling at the first step and "
        "15 s once more at the first new length. Worth it for long runs of long sequences.")
    offload_optimizer: bool = Field(
        False, description="fsdp2 only: keep sharded parameters, gradients and optimizer state in "
        "CPU memory and step the optimizer there (FSDP2 CPUOffloadPolicy; a no-op on a CPU device).")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Precision of the RL forward passes (policy, reference, critic): bf16 "
        "autocast with fp32 master weights, fp32 optimizer state and fp32 log-softmax/loss, or "
        "plain fp32. auto: bf16 where the hardware computes it natively (CPUs with AMX or "
        "AVX512-BF16, GPUs with bf16), else fp32. The SFT warm start always runs in fp32. Like "
        "verl's fsdp_config.mixed_precision and OpenRLHF's --bf16. Under fsdp2 it is FSDP2's "
        "MixedPrecisionPolicy (bf16 parameters for compute, fp32 gradient reduction).")

    @field_validator("balance_ranks", mode="before")
    @classmethod
    def _balance_from_bool(cls, v: Any) -> Any:
        return ("deal" if v else "off") if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _offload_needs_fsdp2(self) -> TrainConfig:
        if self.offload_optimizer and self.strategy != "fsdp2":
            raise ValueError("train.offload_optimizer needs train.strategy=fsdp2")
        return self


class RolloutConfig(_Group):
    engine: Literal["vllm", "hf"] = "vllm"
    compile: bool = Field(
        False, description="vLLM on a CPU: compile the model (torch.compile) instead of running "
        "it eagerly. Measured here (`small` model, bf16, 16 × 256 tokens, one core): 2.38 → 1.67 s "
        "per generation. The first engine of a configuration on a machine compiles (a start of "
        "20–36 s) and saves the compiled model under $VLLM_CACHE_ROOT; later ones load it (6 s against "
        "3 s eager, besides vLLM's import of 7–8 s). GPUs always compile (CUDA graphs).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The sampler's compute dtype; the trainer keeps `model.dtype` master weights "
        "and the sampler's log-probs are the behaviour policy (truncated importance sampling, "
        "`algorithm.tis_cap`, corrects the mismatch). auto: bfloat16 where vLLM's device computes "
        "bf16 natively (AMX/AVX512-BF16 CPUs, Ampere+ GPUs) and for the HF engine on a GPU; "
        "`model.dtype` otherwise (HF generate in bf16 on a CPU measured slower than fp32).",
    )
    n: int = Field(8, ge=1, description="Responses sampled per prompt.")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list)
    kv_cache_gb: float = Field(1.0, gt=0, description=(
        "vLLM's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE), allocated and zeroed when the engine "
        "starts; at most what the engine's scheduler can fill: the sequences one generate of the "
        "run holds (`train.batch_size` × `n`, times `sampling.max_oversample` with dynamic "
        "sampling; at most 256) at the model's full length (a larger setting allocates that "
        "much, since more is never used)."))
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1)
    sleep_level: Literal[1, 2] = Field(
        1, description="Colocated on a GPU: how the vLLM engine sleeps while the policy trains. "
        "1: its weights go to host memory and the KV cache is freed; 2: both are discarded (no "
        "host copy, nothing copied back at wake-up: the weight sync after each training step "
        "loads the whole policy anyway, and the cache wakes only after it). The engine sleeps "
        "once a step, after the step's last draw, so dynamic sampling's refills find its weights. "
        "A no-op on vLLM's CPU backend.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM tensor parallelism: each rollout engine spans this many "
        "devices, for policies larger than one device. The controllers of a group of that many "
        "consecutive ranks run one engine together (vLLM's external launcher: every rank holds "
        "its shard and the group samples all its ranks' prompts at once; each takes back its "
        "own), and the trainer's weights load in place into every shard. colocate only.",
    )
    weight_sync_bucket_mb: float = Field(
        256.0, gt=0, description="Bucket size of the weight broadcast from the training ranks to "
        "the rollout engines (one collective per bucket; each engine loads a bucket as it arrives)."
    )


class RewardConfig(_Group):
    kind: Literal["rule", "function", "model", "remote"] = "rule"
    rule: Literal["exact_match", "format", "exact_match+format"] = "exact_match"
    function: str | None = Field(None, description="`module:function` for kind=function.")
    model_path: str | None = Field(None, description="HF sequence classifier for kind=model.")
    url: str | None = Field(None, description="Remote scorer endpoint for kind=remote.")
    timeout_s: float = Field(10.0, gt=0)
    retries: int = Field(3, ge=0)
    batch_size: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _kind_has_its_source(self) -> RewardConfig:
        needed = {"function": "function", "model": "model_path", "remote": "url"}.get(self.kind)
        if needed and getattr(self, needed) is None:
            raise ValueError(f"reward.kind={self.kind} needs reward.{needed}")
        if self.function is not None and ":" not in self.function:
            raise ValueError("reward.function must look like 'module:function'")
        return self


class ControllerConfig(_Group):
    mode: Literal["parallel", "single"] = Field(
        "parallel", description="parallel: one RL loop per data-parallel rank (YATT); "
        "single: the driver runs the loop and moves all data to and from the same ranks "
        "(verl-style baseline, trainer/single_controller.py)."
    )
    max_restarts: int = Field(2, ge=0, description="Controller restarts from checkpoint.")


class PlacementConfig(_Group):
    mode: Literal["colocate", "disaggregated", "partial_colocate", "auto"] = "colocate"
    devices: int = Field(2, ge=1, description="GPUs, or slices of cores on a CPU machine.")
    device_type: Literal["auto", "cpu", "gpu"] = "auto"
    rollout_devices: int | None = Field(
        None, ge=1, description="Devices in the rollout pool (disaggregated); default half."
    )
    staleness: int = Field(1, ge=0, description="Max policy versions a rollout may lag.")
    reward_devices: int = Field(
        1, ge=1, description="partial_colocate: devices that also host a reward scorer, which "
        "scores finished samples while every device still generates."
    )
    cpus_per_device: float = Field(1.0, gt=0)
    device_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one device, for the check before launch; default: "
        "the GPU's memory, or on CPU the host's RAM divided by the devices."
    )
    profile_steps: int = Field(
        4, ge=2, description="auto: measured steps per layout while profiling (after 2 warm-up "
        "steps) before the first choice."
    )
    replan_every: int = Field(
        10, ge=2, description="auto: steps between checks of the measured phase times against "
        "the prediction."
    )
    replan_drift: float = Field(
        0.2, gt=0, description="auto: relative gap between measured and predicted phase times "
        "that makes a check refit the cost model and compare the plans again."
    )
    replan_min_gain: float = Field(
        0.1, ge=0, lt=1, description="auto: predicted step-time gain a new plan must clear "
        "(and repay its switch cost over the remaining steps) before the run switches to it."
    )
    link_calibration: str | None = Field(
        None, min_length=1, description="A measured weight-sync link (`bench/weight_sync.py --two-nodes` writes "
        "`.yatt/link-calibration.json`): its fixed cost per round and bandwidth are the cost "
        "model's prior for the link terms, which one policy size cannot separate. Read where the "
        "run starts (the driver's host: use an absolute path for runs submitted over HTTP).",
        examples=[".yatt/link-calibration.json"],
    )
    reference_on_rollout: float | Literal["auto"] = Field(
        "auto", description="Rollout workers (disaggregated): the share of each rollout's samples "
        "whose reference log-probs the worker computes right after generating them, with its own "
        "copy of the frozen reference (exact for stale samples too), instead of the training "
        "ranks' reference pass. auto: the share that evens the two sides' measured busy time "
        "(0 when generation is the longer side), re-chosen every step; on GPUs auto keeps 0, the "
        "engine having claimed the device's memory. 0: always the training ranks.",
        examples=["auto", 0.5, 0],
    )

    @model_validator(mode="after")
    def _split_fits(self) -> PlacementConfig:
        if self.rollout_devices is not None and self.rollout_devices >= self.devices:
            raise ValueError("placement.rollout_devices must be less than placement.devices")
        if self.reference_on_rollout != "auto" and not 0 <= self.reference_on_rollout <= 1:
            raise ValueError("placement.reference_on_rollout must be 'auto' or a share from 0 to 1, "
                             f"not {self.reference_on_rollout}")
        if self.reward_devices > self.devices:
            raise ValueError("placement.reward_devices must be at most placement.devices")
        return self


class SamplingConfig(_Group):
    dynamic: bool = Field(False, description="DAPO dynamic sampling: drop zero-variance groups.")
    max_refills: int = Field(3, ge=0)
    ema_decay: float = Field(0.9, ge=0, lt=1)
    max_oversample: float = Field(4.0, ge=1)


class CheckpointConfig(_Group):
    every_steps: int = Field(10, ge=1)
    keep: int = Field(2, ge=1)
    export_final: bool = True


class EvalConfig(_Group):
    every_steps: int = Field(0, ge=0, description="0: evaluate only when RL starts and ends.")
    size: int = Field(256, ge=1)


class ReportConfig(_Group):
    flush_interval_s: float = Field(1.0, gt=0)
    max_batch: int = Field(2000, ge=1, le=10_000)
    log_every_steps: int = Field(1, ge=1)


class TrainerConfig(_Group):
    """A whole training run. Every field has a default, so `{}` is a valid (tiny) run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Stored in a 64-bit column.")

    @model_validator(mode="after")
    def _batch_splits_across_controllers(self) -> TrainerConfig:
        ranks = self.data_parallel_size
        if self.train.batch_size % ranks:
            raise ValueError(
                f"train.batch_size={self.train.batch_size} must divide evenly across "
                f"{ranks} data-parallel controllers"
            )
        return self

    @model_validator(mode="after")
    def _sharding_runs_in_parallel_controllers(self) -> TrainerConfig:
        if self.train.strategy == "fsdp2" and self.controller.mode != "parallel":
            raise ValueError("train.strategy=fsdp2 needs controller.mode=parallel (the "
                             "single-controller baseline keeps a whole model per rank)")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_engines_fit(self) -> TrainerConfig:
        tp = self.rollout.tensor_parallel_size
        if tp == 1:
            return self
        if self.rollout.engine != "vllm":
            raise ValueError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")
        if self.placement.mode != "colocate" or self.controller.mode != "parallel":
            raise ValueError("rollout.tensor_parallel_size > 1 is built for placement.mode=colocate "
                             "with controller.mode=parallel (each engine's shards live in the "
                             "controllers of its devices)")
        if self.placement.devices % tp:
            raise ValueError(f"rollout.tensor_parallel_size={tp} must divide placement.devices="
                             f"{self.placement.devices}")
        return self

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel training ranks this placement runs (in both controller modes)."""
        if self.placement.mode == "disaggregated":
            return self.placement.devices - self.rollout_pool_size
        return self.placement.devices

    @property
    def rollout_pool_size(self) -> int:
        """Devices that generate in disaggregated mode."""
        if self.placement.rollout_devices is not None:
            return self.placement.rollout_devices
        return max(1, self.placement.devices // 2)


class ConfigError(ValueError):
    """A config that does not validate; ``errors`` holds (dotted path, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{path}: {msg}" if path else msg for path, msg in errors))


def validation_errors(exc: ValidationError) -> list[tuple[str, str]]:
    """Turn a pydantic error into (dotted path, message) pairs a person can act on."""
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        out.append((path, msg))
    return out


def parse_config(data: dict[str, Any]) -> TrainerConfig:
    """Validate a plain dict; raises ConfigError naming every bad field path."""
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_errors(exc)) from exc


def apply_overrides(data: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (values parsed as YAML) to a config dict, in place."""
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([(item, "override must look like key.path=value")])
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([(key, f"'{part}' is not a group")])
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return data


def load_config(path: str | Path, sets: list[str] | None = None) -> TrainerConfig:
    """Read a YAML config file, apply overrides, validate."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping at the top level")])
    return parse_config(apply_overrides(data, sets or []))
