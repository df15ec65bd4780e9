"""What a tensor-parallel vLLM engine costs and saves against one engine per device, side by side.

    PYTHONPATH=. .venv/bin/python bench/tensor_parallel.py

Same `small` model and generation-heavy workload as bench/trainer_vs_trl.py (2 prompts × 8
samples × up to 256 new tokens per controller, two controllers), on this machine's default
sampler precision, one core per device. Three layouts, each run as the processes a colocated step
would have:

- `tp=1`: an engine per controller on its own core (today's colocate default), both at once;
- `tp=2`: one engine sharded over the two controllers' cores (`rollout.tensor_parallel_size: 2`),
  each rank handing in its own prompts;
- one engine on both cores (threads, no sharding) generating all 32 samples: the limit's engine.

Per layout: engine start, the best of `--steps` generations, the weights one device holds (the
parameters of that process's model, counted in the engine), and loading a whole new policy into
it (`update_weights`, the colocated weight sync). Writes its section of docs/benchmarks.md
(`--no-docs` to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".yatt" / "models" / "bench-small"
TOKENS = 256
PROMPTS = ["12+34=", "56+7="]  # one controller's prompts; n=8 each: 16 samples


def _config(tp: int = 1) -> dict:
    return {
        "model": {"path": str(MODEL), "preset": "small"},
        "data": {"task": "arithmetic", "arithmetic": {"digits": 2, "ops": ["+"]}},
        "rollout": {"engine": "vllm", "n": 8, "max_new_tokens": TOKENS, "temperature": 1.0,
                    "kv_cache_gb": 0.5, "tensor_parallel_size": tp},
        "placement": {"mode": "colocate", "devices": 2, "device_type": "cpu"},
        "seed": 0,
    }


def _held_bytes(worker) -> int:  # runs inside the engine's worker (collective_rpc)
    """The weight bytes this rank's model holds: each parallel layer's own partition (vLLM-CPU
    repacks linear weights for its GEMM and leaves the parameters empty), other tensors whole."""
    import torch

    size = torch.empty(0, dtype=worker.model_config.dtype).element_size()
    total = 0
    for module in worker.model_runner.get_model().modules():
        if hasattr(module, "input_size_per_partition") and hasattr(module, "output_size_per_partition"):
            total += module.input_size_per_partition * module.output_size_per_partition * size
        elif hasattr(module, "num_embeddings_per_partition"):
            total += module.num_embeddings_per_partition * module.embedding_dim * size
        else:
            total += sum(p.numel() * size for p in module.parameters(recurse=False))
    return total


def child(tp: int, rank: int, port: int, threads: int, copies: int, steps: int) -> dict:
    """One process of a layout: build its engine, time generations and one whole-policy load."""
    import torch

    from trainer.config import parse_config
    from trainer.rollout import make_engine
    from trainer.rollout.vllm_engine import TensorParallelGroup

    torch.set_num_threads(threads)
    cfg = parse_config(_config(tp))
    group = TensorParallelGroup(rank, tp, "127.0.0.1", port) if tp > 1 else None
    t0 = time.perf_counter()
    engine = make_engine(cfg, str(MODEL), threads=threads, seed=0, tensor_parallel=group)
    start_s = time.perf_counter() - t0
    try:
        prompts = PROMPTS * copies
        engine.generate(prompts, n=8)  # warm-up
        best, tokens = float("inf"), 0
        for _ in range(steps):
            t0 = time.perf_counter()
            out = engine.generate(prompts, n=8)
            elapsed = time.perf_counter() - t0
            if elapsed < best:
                best, tokens = elapsed, sum(len(s.response_ids) for s in out)
        from safetensors.torch import load_file

        weights = load_file(str(MODEL / "model.safetensors"))
        t0 = time.perf_counter()
        engine.update_weights(weights.items())
        load_s = time.perf_counter() - t0
        held = sum(engine.llm.collective_rpc(_held_bytes))
        size = torch.empty(0, dtype=getattr(torch, str(engine.llm.llm_engine.model_config.dtype)
                                            .removeprefix("torch."))).element_size()
        whole = sum(t.numel() for t in weights.values()) * size  # (the tied head named once)
    finally:
        engine.close()
    return {"start_s": start_s, "seconds": best, "tokens": tokens, "load_s": load_s,
            "held_bytes": held, "whole_bytes": whole}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], cores: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(["taskset", "-c", cores, sys.executable, __file__, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed with exit {proc.returncode}")
    return json.loads(lines[-1])


def _layout(tp: int, procs: int, threads: int, copies: int, steps: int) -> list[dict]:
    port = _free_port()
    cores = [str(c) for c in range(procs)] if procs > 1 else [",".join(str(c) for c in range(threads))]
    return [_result(p) for p in [
        _spawn(["--child", "--tp", str(tp), "--rank", str(r), "--port", str(port), "--threads",
                str(threads), "--copies", str(copies), "--steps", str(steps)], cores[r])
        for r in range(procs)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--copies", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.tp, a.rank, a.port, a.threads, a.copies, a.steps)))
        return

    from trainer.config import parse_config
    from trainer.models import ensure_model
    from trainer.precision import cpu_native_bf16, sampler_dtype

    cfg = parse_config(_config())
    ensure_model(cfg)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores")
    load = os.getloadavg()
    layouts = {
        "tp=1: an engine per controller, one core each (both at once)": _layout(1, 2, 1, 1, a.steps),
        "tp=2: one engine sharded over both controllers' cores": _layout(2, 2, 1, 1, a.steps),
        "one engine on both cores (threads), all 32 samples": _layout(1, 1, 2, 2, a.steps),
    }
    rows = ["| layout | engine start (s) | generation (best s) | tokens | tok/s | weights per device (MiB) "
            "| of the whole | whole-policy load (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rates = {}
    for name, res in layouts.items():
        seconds = max(r["seconds"] for r in res)
        tokens = sum(r["tokens"] for r in res)  # (a shard returns its own rank's samples only)
        held = max(r["held_bytes"] for r in res)
        rates[name] = tokens / seconds
        rows.append(f"| {name} | {max(r['start_s'] for r in res):.1f} | {seconds:.2f} | {tokens} | "
                    f"{tokens / seconds:.0f} | {held / 2**20:.1f} | {held / res[0]['whole_bytes']:.2f} | "
                    f"{max(r['load_s'] for r in res):.2f} |")
    names = list(layouts)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores "
        f"({'native' if cpu_native_bf16() else 'no native'} bf16; sampler in {sampler_dtype(cfg, 'cpu')}), "
        f"load average {load[0]:.1f} at the start.", "",
        "Command: `PYTHONPATH=. .venv/bin/python bench/tensor_parallel.py`", "",
        *rows, "",
        f"The sharded engine generates {rates[names[1]] / rates[names[0]]:.2f}× the tokens per second of "
        f"an engine per controller and {rates[names[1]] / rates[names[2]]:.2f}× one engine on both cores' "
        "threads, and each device holds the fraction of the weights in the table's sixth column "
        "(the norms are whole on every shard).", ""]
    body = "## Tensor-parallel rollout engine (issue 8 item 4)\n\n" + "\n".join(lines)
    print(body)
    if not a.no_docs:
        docs_section.write_section("tensor_parallel", body)


if __name__ == "__main__":
    main()
