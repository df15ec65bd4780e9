"""GPU check: the `Learner` (FSDP2, bf16) and the HF rollout engine on Qwen2.5-shaped models.

    PYTHONPATH=. python bench/gpu_check.py            # one GPU (H200: under 8 minutes)
    PYTHONPATH=. python bench/gpu_check.py --tiny     # CPU, tiny shapes (what the tests run)
    PYTHONPATH=. python bench/gpu_check.py --profile --only Qwen2.5-0.5B   # where a step's time goes
    PYTHONPATH=. python bench/gpu_check.py --compile  # `train.compile`, beside eager in one run
    PYTHONPATH=. python bench/gpu_check.py --offload-optimizer --only Qwen2.5-0.5B  # likewise

No Ray, no vLLM, no network: each model is built from a config with random weights (the shapes
of Qwen2.5-0.5B and Qwen2.5-1.5B, vocabulary included), saved to a temporary directory, and
trained by the trainer's own `Learner` with ``train.strategy: fsdp2`` over a one-rank process
group (NCCL on a GPU, gloo on CPU), bf16 compute with fp32 master weights. Per model it prints
trained tokens/s (the policy's update and the reference pass together), MFU against the GPU's
dense bf16 peak, generated tokens/s of `HFEngine` after it loaded the trained weights (streamed,
one gathered tensor at a time), the peak device memory of each phase next to the
pre-launch estimate of `trainer/placement/memory.py`, and the device memory the trainer holds
before and after `Learner.release_device` (what colocate frees for the sampler). Without ``--tiny`` it writes its section
of docs/benchmarks.md.

``--compile`` trains with ``train.compile`` (each transformer block compiled before FSDP2 shards
it), ``--offload-optimizer`` with ``train.offload_optimizer`` (shards, gradients and AdamW step in
host memory); with either, the same process first times the plain learner on the same batches: the
table gains the plain step and its peak memory, the speed-up over it, and the first step's time
(compilation included).

``--profile`` skips generation: it runs one training step of each shape under
``torch.profiler`` (CPU and CUDA), prints the GPU's busy fraction of the step, the time per phase
(reference pass, policy forward, backward, optimizer) and the top operators by self CUDA and self
CPU time, then times the step under a few settings (micro-batch size, gradient checkpointing)
so that what the profile suggests is checked by measurement in the same run.

MFU counts model FLOPs only (no recompute): per sequence of ``S`` tokens with ``R`` response
tokens, a forward is ``2·N_blocks·S + 2·H·V·R`` (the LM head runs on response positions only)
``+ 2·L·H·S²`` (causal attention); training is three forwards' worth, the reference pass one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16 Tensor Core (1,979 with 2:4 sparsity),
# https://www.nvidia.com/en-us/data-center/h200/ ; H100 SXM has the same dense figure.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


# From the Qwen2.5 model cards' config.json (tied embeddings in both).
QWEN25_05B = Shape("Qwen2.5-0.5B", hidden=896, layers=24, heads=14, kv_heads=2,
                   intermediate=4864, vocab=151_936)
QWEN25_15B = Shape("Qwen2.5-1.5B", hidden=1536, layers=28, heads=12, kv_heads=2,
                   intermediate=8960, vocab=151_936)
TINY = Shape("tiny", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=512)


@dataclass(frozen=True)
class Workload:
    rows: int  # sequences per training step
    prompt_tokens: int
    response_tokens: int
    micro_batch: int
    steps: int  # timed training steps (after one untimed)
    gen_prompts: int
    gen_n: int
    gen_tokens: int


# micro-batches of 32 rows: at 8 the step was bound by kernel launches (kernels 16% of it, 49k
# launches per step; --profile, docs/benchmarks.md, GPU check), 32 ran the step 2.3x faster.
GPU_WORK = Workload(rows=64, prompt_tokens=128, response_tokens=384, micro_batch=32, steps=4,
                    gen_prompts=32, gen_n=8, gen_tokens=256)
TINY_WORK = Workload(rows=8, prompt_tokens=8, response_tokens=8, micro_batch=4, steps=2,
                     gen_prompts=2, gen_n=2, gen_tokens=4)


def build_model(shape: Shape, out: Path) -> Path:
    """A random-init Qwen2 model of ``shape`` with a small tokenizer (ids below its vocabulary)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.models import EOS_TOKEN, PAD_TOKEN, _train_tokenizer

    tokenizer = _train_tokenizer([f"{a} + {b} = {a + b}" for a in range(50) for b in range(50)], 300)
    eos, pad = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
                         use_sliding_window=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def block_params(shape: Shape) -> int:
    """Parameters inside the transformer blocks (what every token's forward multiplies by)."""
    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    attn = 2 * h * h + 2 * h * kv + h + 2 * kv
    return shape.layers * (attn + 3 * h * shape.intermediate + 2 * h)


def step_flops(shape: Shape, work: Workload) -> float:
    """Model FLOPs of one RL step: policy forward+backward (x3) and the reference forward (x1)."""
    seq = work.prompt_tokens + work.response_tokens
    forward = work.rows * (2 * block_params(shape) * seq
                           + 2 * shape.hidden * shape.vocab * work.response_tokens
                           + 2 * shape.layers * shape.hidden * seq * seq)
    return 4.0 * forward


def _config(model_dir: Path, work: Workload, device_type: str, variant: dict | None = None) -> dict:
    return {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "train": {"strategy": "fsdp2", "mixed_precision": "bf16", "gradient_checkpointing": True,
                  "lr": 1e-6, "batch_size": max(1, work.rows // work.gen_n),
                  "micro_batch_size": work.micro_batch, **(variant or {})},
        # the trained batches' responses (what the memory estimate reads); generation below
        # takes gen_tokens
        "rollout": {"engine": "hf", "n": work.gen_n, "max_new_tokens": work.response_tokens,
                    "temperature": 1.0},
        "placement": {"device_type": device_type, "devices": 1, "mode": "colocate"},
    }


def _batch(work: Workload, vocab_ids: int, step: int):
    from trainer.learner import RLBatch

    g = torch.Generator().manual_seed(step)
    prompts = torch.randint(3, vocab_ids, (work.rows, work.prompt_tokens), generator=g).tolist()
    responses = torch.randint(3, vocab_ids, (work.rows, work.response_tokens), generator=g).tolist()
    scores = torch.rand(work.rows, generator=g).round().tolist()
    return RLBatch(prompt_ids=prompts, response_ids=responses, scores=scores, n=work.gen_n,
                   truncated=[True] * work.rows)


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (each variant of a block's forward is one;
    `torch._dynamo.reset` does not zero the count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: torch.device) -> None:
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def check_model(shape: Shape, work: Workload, device: torch.device, root: Path,
                variant: dict | None = None) -> dict:
    """Build, train, load into the sampler, generate: the figures of one model shape.

    ``variant``: `train` settings to check (``{"compile": True}``, say), after timing the plain
    learner's steps on the same batches in this process (``plain_step_s``, ``plain_peak_gib``)."""
    from trainer.config import parse_config
    from trainer.learner import Learner
    from trainer.placement.memory import GiB, estimate_memory
    from trainer.rollout.hf_engine import HFEngine

    t0 = time.time()
    model_dir = build_model(shape, root / shape.name)
    device_type = "gpu" if device.type == "cuda" else "cpu"
    cfg = parse_config(_config(model_dir, work, device_type, variant))
    build_s = time.time() - t0
    compiled = cfg.train.compile
    plain_step_s = plain_peak = None
    graphs_before = _compiled_graphs()
    if compiled:
        torch._dynamo.reset()  # the shape before's compiled variants count against this one's limit
    if variant:
        plain = Learner(parse_config(_config(model_dir, work, device_type)), model_dir, device=str(device))
        _peak_reset(device)
        plain_step_s = _timed_steps(plain, work, device, work.steps)
        plain_peak = _peak(device)
        del plain
        if device.type == "cuda":
            torch.cuda.empty_cache()
    avail = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    est = estimate_memory(cfg, device_type=device_type, available_bytes=avail,
                          prompt_tokens=work.prompt_tokens)
    assert est is not None
    train_parts = ("policy", "gradients", "optimizer", "reference", "activations")
    est_train = sum(v for k, v in est.parts.items() if k in train_parts) / GiB

    _peak_reset(device)
    learner = Learner(cfg, model_dir, device=str(device))
    t = time.time()
    learner.rl_step(_batch(work, 300, 0))  # untimed: lazy init, allocator warm-up, compilation
    _sync(device)
    first_step_s = time.time() - t
    _peak_reset(device)
    t = time.time()
    tokens = 0.0
    step_times = []
    for step in range(1, work.steps + 1):
        started = time.time()
        m = learner.rl_step(_batch(work, 300, step))
        tokens += work.rows * (work.prompt_tokens + work.response_tokens)
        assert math.isfinite(m["loss/total"]), m
        _sync(device)
        step_times.append(time.time() - started)
    train_s = time.time() - t
    train_peak = _peak(device)
    # colocate: the trainer's state leaves the device while the sampler generates, then returns
    held = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    learner.release_device()
    released = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    learner.reclaim_device()
    assert math.isfinite(learner.rl_step(_batch(work, 300, work.steps + 1))["loss/total"])

    gen_cfg = cfg.model_copy(deep=True)
    gen_cfg.rollout.dtype = "bfloat16" if device.type == "cuda" else "float32"
    gen_cfg.rollout.max_new_tokens = work.gen_tokens
    engine = HFEngine(model_dir, gen_cfg, device=str(device), chunk_size=work.gen_prompts * work.gen_n)
    t = time.time()
    engine.update_weights(learner.iter_named_weights())
    sync_s = time.time() - t
    prompts = [f"{i} + {i + 1} =" for i in range(work.gen_prompts)]
    engine.generate(prompts[:1], 1)  # untimed warm-up
    _peak_reset(device)
    t = time.time()
    samples = engine.generate(prompts, work.gen_n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.time() - t
    gen_peak = _peak(device)
    generated = sum(len(s.response_ids) for s in samples)
    flops = step_flops(shape, work) * work.steps
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return {
        "model": shape.name, "params": learner.num_parameters(), "build_s": build_s,
        "train_tokens_per_s": tokens / train_s, "step_s": train_s / work.steps,
        "mfu": (flops / train_s / peak) if peak else None,
        "gen_tokens_per_s": generated / gen_s, "weight_sync_s": sync_s,
        "variant": variant, "plain_step_s": plain_step_s, "plain_peak_gib": plain_peak,
        "first_step_s": first_step_s,
        "median_step_s": sorted(step_times)[len(step_times) // 2],
        "compiled_graphs": _compiled_graphs() - graphs_before if compiled else None,
        "train_peak_gib": train_peak, "gen_peak_gib": gen_peak, "est_train_gib": est_train,
        "est_total_gib": est.peak_bytes / GiB, "held_gib": held, "released_gib": released,
    }


class _ProfileSpans:
    """The learner's phase recorder, as profiler ranges (``rl_step(recorder=...)``)."""

    def span(self, phase: str, *, device: int | None = None) -> Any:
        return torch.profiler.record_function(f"phase/{phase}")


def _timed_steps(learner: Any, work: Workload, device: torch.device, steps: int) -> float:
    """Median wall seconds of ``steps`` RL steps (after one untimed one)."""
    learner.rl_step(_batch(work, 300, 0))
    times = []
    for step in range(1, steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.time()
        learner.rl_step(_batch(work, 300, step))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t)
    return sorted(times)[len(times) // 2]


def profile_model(shape: Shape, work: Workload, device: torch.device, root: Path,
                  out_dir: Path | None) -> dict:
    """One profiled training step of ``shape``, then the step timed under other settings."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.config import parse_config
    from trainer.learner import Learner

    model_dir = build_model(shape, root / shape.name)
    device_type = "gpu" if device.type == "cuda" else "cpu"
    base = _config(model_dir, work, device_type)
    learner = Learner(parse_config(base), model_dir, device=str(device))
    for step in range(2):  # lazy init and allocator warm-up
        learner.rl_step(_batch(work, 300, step))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    batch = _batch(work, 300, 3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.time()
    with profile(activities=activities, record_shapes=False) as prof:
        learner.rl_step(batch, recorder=_ProfileSpans())
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.time() - t
    events = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # the kernels' own rows only: an operator's row repeats the time of the kernels it launched
    busy_us = sum(getattr(e, dev_attr, 0.0) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\n## {shape.name}: profiled step {wall:.2f} s wall (profiler on), "
          f"GPU busy {busy_us / 1e6:.2f} s ({100 * busy_us / 1e6 / wall:.0f}% of the step)", flush=True)
    phases = {e.key: e.cpu_time_total / 1e6 for e in events if e.key.startswith("phase/")}
    print("phases (wall s): " + ", ".join(f"{k[6:]} {v:.2f}" for k, v in phases.items()))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=18, max_name_column_width=60))
    if device.type == "cuda":
        print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    if out_dir is not None:
        prof.export_chrome_trace(str(out_dir / f"profile-{shape.name}.json"))
    del learner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # the same step under other settings: does what the profile suggests move the wall time?
    small = max(1, work.micro_batch // 4)
    variants = {"as profiled": {},
                f"micro-batch {small}": {"train": {"micro_batch_size": small}},
                "no gradient checkpointing": {"train": {"gradient_checkpointing": False}},
                f"micro-batch {small}, no checkpointing": {"train": {"micro_batch_size": small,
                                                                      "gradient_checkpointing": False}}}
    timed: dict[str, float | str] = {}
    for name, change in variants.items():
        cfg = {k: (dict(v, **change.get(k, {})) if isinstance(v, dict) else v) for k, v in base.items()}
        try:
            learner = Learner(parse_config(cfg), model_dir, device=str(device))
            timed[name] = _timed_steps(learner, work, device, work.steps)
            peak = _peak(device)
            print(f"{shape.name} {name}: {timed[name]:.2f} s/step"
                  + (f", peak {peak:.1f} GiB" if peak is not None else ""), flush=True)
        except Exception as exc:  # out of memory without checkpointing, say: recorded, not fatal
            timed[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            print(f"{shape.name} {name}: failed: {timed[name]}", flush=True)
        finally:
            learner = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    return {"model": shape.name, "profiled_wall_s": wall, "gpu_busy_s": busy_us / 1e6,
            "phases": phases, "variants": timed}


def _fmt(v: float | None, spec: str) -> str:
    if v is None:
        return "n/a"
    return format(v, spec[:-1]) + "%" if spec.endswith("%") else format(v, spec)


def _variant_cells(r: dict) -> str:
    if not r.get("variant"):
        return "plain | — | — | — | "
    graphs = f" ({r['compiled_graphs']} graphs)" if r["compiled_graphs"] is not None else ""
    return (f"{r['plain_step_s']:.2f} s | {_fmt(r['plain_peak_gib'], '.1f')} | "
            f"{r['plain_step_s'] / r['median_step_s']:.2f}x | {r['first_step_s']:.1f} s{graphs} | ")


def table(rows: list[dict]) -> str:
    varied = any(r.get("variant") for r in rows)
    head = ("| model | params | trained tok/s | step | MFU | "
            + ("plain step | plain peak (GiB) | speed-up | first step | " if varied else "")
            + "generated tok/s | weight sync | "
            "peak train / estimate (GiB) | peak generate (GiB) | held → released (GiB) |\n"
            "|---|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if varied else "")
            + "---:|---:|---|---:|---|\n")
    body = "".join(
        f"| {r['model']} | {r['params'] / 1e6:,.1f}M | {r['train_tokens_per_s']:,.0f} | "
        f"{r['step_s']:.2f} s | {_fmt(r['mfu'] and 100 * r['mfu'], '.1f%')} | "
        + (_variant_cells(r) if varied else "")
        + f"{r['gen_tokens_per_s']:,.0f} | {r['weight_sync_s']:.2f} s | "
        f"{_fmt(r['train_peak_gib'], '.1f')} / {r['est_train_gib']:.1f} | "
        f"{_fmt(r['gen_peak_gib'], '.1f')} | "
        f"{_fmt(r['held_gib'], '.1f')} → {_fmt(r['released_gib'], '.1f')} |\n" for r in rows)
    return head + body


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU and tiny shapes (a functional check)")
    ap.add_argument("--only", action="append", default=[], metavar="MODEL",
                    help="run only these shapes (e.g. Qwen2.5-1.5B); the tiny one always runs first")
    ap.add_argument("--compile", action="store_true",
                    help="train with train.compile, beside the plain step timed in the same run")
    ap.add_argument("--offload-optimizer", action="store_true",
                    help="train with train.offload_optimizer, beside the plain step timed in the same run")
    ap.add_argument("--profile", action="store_true",
                    help="profile one training step per shape and time it under other settings")
    args = ap.parse_args(argv)
    t0 = time.time()
    variant = {k: True for k, on in (("compile", args.compile),
                                     ("offload_optimizer", args.offload_optimizer)) if on} or None
    if args.tiny:
        device, shapes, work = torch.device("cpu"), [TINY], TINY_WORK
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: run with --tiny for the CPU check")
        torch.cuda.set_device(0)
        # the tiny shape first: the whole path on the GPU in seconds, before the real shapes
        device, shapes, work = torch.device("cuda", 0), [TINY, QWEN25_05B, QWEN25_15B], GPU_WORK
        shapes = [s for s in shapes if s is TINY or not args.only or s.name in args.only]
    if args.profile:
        out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
        with tempfile.TemporaryDirectory(prefix="yatt-gpu-profile-") as tmp:
            found = [profile_model(s, work, device, Path(tmp), out) for s in shapes]
        print(json.dumps(found, indent=1))
        print(f"total {time.time() - t0:.0f} s")
        return found
    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="yatt-gpu-check-") as tmp:
        for shape in shapes:
            try:
                # the tiny shape checks the path in seconds: plain, whatever the flags
                rows.append(check_model(shape, work, device, Path(tmp),
                                        variant=variant if args.tiny or shape is not TINY else None))
            except Exception as exc:  # one shape failing (out of memory, say) keeps the others
                import traceback

                traceback.print_exc()
                failed.append(f"{shape.name}: {type(exc).__name__}: {str(exc)[:300]}")
                if args.tiny or shape is TINY:
                    raise
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(table(rows[-1:]), end="", flush=True)
    print(table(rows), end="")
    print(f"total {time.time() - t0:.0f} s")
    if not args.tiny:
        from bench.docs_section import write_section

        gpu = torch.cuda.get_device_name(0)
        flags = "".join(f" --{k.replace('_', '-')}" for k in variant or {})
        what = {"compile": ", compiled blocks", "offload_optimizer": ", optimizer offloaded"}
        write_section("gpu_check" + flags.replace(" --", "_").replace("-", "_"), (
            "## GPU check: Learner (FSDP2, bf16" + "".join(what[k] for k in variant or {})
            + ") and HF rollout on Qwen2.5 shapes\n\n"
            f"`PYTHONPATH=. python bench/gpu_check.py{flags}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{gpu}, torch {torch.__version__}. Random-init models of the Qwen2.5 shapes; "
            f"{work.rows} sequences × ({work.prompt_tokens} prompt + {work.response_tokens} response) "
            f"tokens per step, micro-batches of {work.micro_batch}, gradient checkpointing; "
            f"generation {work.gen_prompts} prompts × {work.gen_n} × {work.gen_tokens} new tokens. "
            "MFU: model FLOPs (no recompute) against the GPU's dense bf16 peak."
            + (" Plain step and peak: the learner without the flags above, on the same batches,"
               " timed first in this process (medians); first step: the checked learner's first"
               " (compilation included)." if variant else "") + "\n\n" + table(rows) + "\n"
            + "".join(f"- did not run: {f}\n" for f in failed) + ("\n" if failed else "")))
    return rows


if __name__ == "__main__":
    main()
