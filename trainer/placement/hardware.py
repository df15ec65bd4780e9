"""Cost-model parameters for clusters this machine cannot hold, from public hardware figures.

The defaults describe an H100 SXM5 80 GB node of 8 GPUs (sources in docs/placement.md):
989.4 TFLOPS dense BF16, 3.35 TB/s HBM3, 900 GB/s NVLink per GPU, 128 GB/s PCIe Gen5 (both
directions), one 400 Gb/s NIC per GPU, and 38-43% MFU for dense BF16 training at scale (Llama 3).
Efficiencies below those peaks are stated next to each term; they are assumptions, not
measurements, and `yatt placement simulate` takes them as options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.placement.cost_model import CostParams, Layout, LengthDist, Workload

__all__ = ["H100", "MODELS", "Hardware", "ModelSpec", "cost_params_for", "model_spec", "tensor_parallel"]


@dataclass(frozen=True)
class Hardware:
    name: str = "H100 SXM5 80GB"
    memory_bytes: float = 80e9
    bf16_flops: float = 989.4e12
    hbm_Bps: float = 3.35e12
    nvlink_Bps: float = 900e9  # per GPU, both directions
    pcie_Bps: float = 128e9  # PCIe Gen5 x16, both directions
    net_Bps: float = 50e9  # 400 Gb/s per GPU
    gpus_per_node: int = 8
    train_mfu: float = 0.40  # Llama 3: 38-43% on 16K H100s
    decode_hbm_eff: float = 0.70  # share of HBM bandwidth a decode step reaches (assumed)
    decode_flops_eff: float = 0.30  # matmul efficiency of batched decode (assumed)
    link_eff: float = 0.80  # achieved share of link bandwidth in collectives (assumed)
    exposed_comm: float = 0.30  # gradient reduction not hidden behind backward (assumed)


H100 = Hardware()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


# Shapes of the Qwen2.5 family (public config.json files), a common RLHF starting point.
MODELS = {
    "0.5b": ModelSpec("0.5b", 0.49e9, 24, 2, 64),
    "1.5b": ModelSpec("1.5b", 1.54e9, 28, 2, 128),
    "7b": ModelSpec("7b", 7.6e9, 28, 4, 128),
    "14b": ModelSpec("14b", 14.7e9, 48, 8, 128),
    "32b": ModelSpec("32b", 32.5e9, 64, 8, 128),
    "72b": ModelSpec("72b", 72.7e9, 80, 8, 128),
}


def model_spec(size: str) -> ModelSpec:
    """A named size (`7b`), or any `<N>b` scaled from the nearest named shape."""
    key = size.lower()
    if key in MODELS:
        return MODELS[key]
    try:
        params = float(key.removesuffix("b")) * 1e9
    except ValueError:
        raise ValueError(f"unknown model size {size!r}; use one of {', '.join(MODELS)} or '<N>b'") from None
    base = min(MODELS.values(), key=lambda m: abs(math.log(m.params / params)))
    return ModelSpec(key, params, base.layers, base.kv_heads, base.head_dim)


def tensor_parallel(model: ModelSpec, hw: Hardware) -> int:
    """GPUs per inference replica: the smallest power of two whose memory holds the bf16
    weights in at most half of it (the rest is KV cache)."""
    tp = 1
    while 2 * model.params / tp > 0.5 * hw.memory_bytes and tp < hw.gpus_per_node:
        tp *= 2
    return tp


def cost_params_for(model: ModelSpec, hw: Hardware, layout: Layout, w: Workload, *,
                    reward_model: ModelSpec | None = None) -> tuple[CostParams, int]:
    """Per-device cost parameters for `model` on `hw` under `layout`; also the tensor-parallel
    size of one inference replica. Generation terms are per replica of `tp` GPUs."""
    P, W = model.params, 2 * model.params
    tp = tensor_parallel(model, hw)
    mean_ctx = w.prompt_tokens + w.response.mean / 2
    gen_step = W / (tp * hw.hbm_Bps * hw.decode_hbm_eff)  # every decode step reads the weights
    gen_token = (2 * P / (tp * hw.bf16_flops * hw.decode_flops_eff)
                 + model.kv_bytes_per_token * mean_ctx / (tp * hw.hbm_Bps * hw.decode_hbm_eff))
    # KV cache room: colocated samplers share the device with the (offloaded) trainer
    share = 0.5 if layout.mode != "disaggregated" else 0.9
    kv_room = max(share * hw.memory_bytes * tp - W, 0.05 * hw.memory_bytes)
    cap = w.response.cap or w.response.quantile(0.999)
    concurrency = max(1.0, kv_room / (model.kv_bytes_per_token * (w.prompt_tokens + cap)))
    T = layout.train_pool
    intra = T <= hw.gpus_per_node
    ar_bw = (hw.nvlink_Bps / 2 if intra else hw.net_Bps) * hw.link_eff / hw.exposed_comm
    flops_train = hw.bf16_flops * hw.train_mfu
    reward_s = 2e-5  # a rule reward: microseconds of Python per sample
    if reward_model is not None:
        reward_s = 2 * reward_model.params * (w.prompt_tokens + w.response.mean) / flops_train
    # colocate: FSDP-sharded training state (16 bytes/param) leaves and comes back over PCIe,
    # and the sampler's weights wake from host memory
    offload = 0.0
    if layout.mode != "disaggregated":
        offload = 2 * (16 * P / T) / (hw.pcie_Bps / 2) + 2 * (W / tp) / (hw.pcie_Bps / 2)
    params = CostParams(
        gen_fixed_s=0.05, gen_step_s=gen_step, gen_token_s=gen_token, gen_concurrency=concurrency,
        reward_sample_s=reward_s, ref_token_s=2 * P / flops_train, train_token_s=6 * P / flops_train,
        train_fixed_s=0.1, allreduce_Bps=ar_bw, sync_fixed_s=0.05,
        sync_local_Bps=hw.nvlink_Bps / 2 * hw.link_eff, sync_link_Bps=hw.net_Bps * hw.link_eff,
        offload_s=offload, overhead_s=0.5,
    )
    return params, tp


def default_workload(model: ModelSpec, *, prompts: int = 512, n: int = 16, prompt_tokens: float = 512,
                     mean_response: float = 2000, sigma: float = 0.8, max_response: float = 8192,
                     reference: bool = True) -> Workload:
    """A DAPO-sized step (512 prompts × 16 samples) with long-tailed responses."""
    return Workload(prompts=prompts, n=n, response=LengthDist(mean_response, sigma, max_response),
                    prompt_tokens=prompt_tokens, param_bytes=2 * model.params, reference=reference)
