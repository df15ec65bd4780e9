"""Where a colocated step loses time against the limit of trainer_vs_trl, measured piece by piece.

    PYTHONPATH=. .venv/bin/python bench/colocate_gaps.py

Same `small` model and workload as bench/trainer_vs_trl.py's generation-heavy case (16 rows per
controller, up to 256 new tokens), on this machine's default precision (fp32 where the CPU has no
native bf16). Two questions, each answered side by side in this one run:

1. Training pass: one rank's `rl_step` (reference pass + training, 16 rows with responses of
   1-256 tokens, one thread) for each `train.micro_batch_tokens` cap, against no cap ("none": every
   row padded to the batch's longest); alone, and two ranks at once as a colocated step runs them.
2. Generation: each controller's vLLM engine on its own core (two processes at once, 16 samples
   each), against one engine on both cores generating all 32 samples (the limit's engine).

Writes its section of docs/benchmarks.md (`--no-docs` to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".yatt" / "models" / "bench-small"
TOKENS = 256
ROWS = 16  # one controller's rows: 2 prompts x 8 samples


def _config(micro_batch_tokens: int | None = None, n: int = 8) -> dict:
    return {
        "model": {"path": str(MODEL), "preset": "small"},
        "data": {"task": "arithmetic", "arithmetic": {"digits": 2, "ops": ["+"]}},
        "algorithm": {"name": "grpo", "kl_coef": 0.04},
        "train": {"lr": 1e-4, "batch_size": 2, "micro_batch_size": 64, "micro_batch_tokens": micro_batch_tokens},
        "rollout": {"engine": "vllm", "n": n, "max_new_tokens": TOKENS, "temperature": 1.0},
        "placement": {"mode": "colocate", "devices": 2, "device_type": "cpu"},
        "seed": 0,
    }


def child_train(cap: int | None, steps: int) -> dict:
    """Median seconds of one rank's rl_step on a fixed synthetic batch shape, one thread."""
    import torch

    from trainer.config import parse_config
    from trainer.learner import Learner, RLBatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = Learner(parse_config(_config(cap)), str(MODEL))
    g = torch.Generator().manual_seed(0)
    vocab = learner.policy.config.vocab_size
    lengths = torch.randint(1, TOKENS + 1, (ROWS,), generator=g).tolist()
    times = []
    for _ in range(steps + 1):
        batch = RLBatch(
            prompt_ids=[torch.randint(2, vocab, (12,), generator=g).tolist() for _ in range(ROWS)],
            response_ids=[torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths],
            scores=torch.rand(ROWS, generator=g).round().tolist(), n=8, truncated=[False] * ROWS,
            sample_logprobs=[(-torch.rand(n, generator=g) * 4).tolist() for n in lengths],
            staleness=[0] * ROWS)
        t0 = time.perf_counter()
        learner.rl_step(batch)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times[1:]), "padded_rows": sum(lengths) / (max(lengths) * ROWS)}


def child_generate(samples: int, threads: int, steps: int) -> dict:
    """Best of `steps` calls of one engine generating `samples` responses on `threads` threads."""
    import torch

    from trainer.config import parse_config
    from trainer.rollout import make_engine

    torch.set_num_threads(threads)
    cfg = parse_config(_config(n=samples // 2))
    engine = make_engine(cfg, str(MODEL), threads=threads, seed=0)
    try:
        prompts = ["12+34=", "56+7="]
        engine.generate(prompts, n=samples // 2)  # warm-up
        best, tokens = float("inf"), 0
        for _ in range(steps):
            t0 = time.perf_counter()
            out = engine.generate(prompts, n=samples // 2)
            elapsed = time.perf_counter() - t0
            if elapsed < best:
                best, tokens = elapsed, sum(len(s.response_ids) for s in out)
    finally:
        engine.close()
    return {"seconds": best, "tokens": tokens}


def _spawn(args: list[str], cores: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, *args]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed with exit {proc.returncode}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="none,1024,512,256", help="train.micro_batch_tokens values")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cap", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "train":
        print(json.dumps(child_train(None if a.cap == "none" else int(a.cap), a.steps)))
        return
    if a.child == "generate":
        print(json.dumps(child_generate(a.samples, a.threads, a.steps)))
        return

    from trainer.config import parse_config
    from trainer.models import ensure_model
    from trainer.precision import cpu_native_bf16

    ensure_model(parse_config(_config()))
    cores = os.cpu_count() or 1
    load = os.getloadavg()
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cores} cores "
             f"({'native' if cpu_native_bf16() else 'no native'} bf16), load average {load[0]:.1f} at the start.",
             "", "Command: `PYTHONPATH=. .venv/bin/python bench/colocate_gaps.py`", ""]

    print("== training pass: one rank's rl_step, 16 rows, responses 1-256 tokens, 1 thread", flush=True)
    caps = a.caps.split(",")
    rows = ["| `train.micro_batch_tokens` | one rank alone (median s) | vs " + caps[0]
            + " | two ranks at once, one core each (the slower rank's median s) | at once / alone |",
            "|---|---:|---:|---:|---:|"]
    base = None
    for cap in caps:
        args = ["--child", "train", "--cap", cap, "--steps", str(a.steps)]
        res = _result(_spawn(args))
        # as a colocated step trains: both controllers at once, neither pinned to a core
        pair = [_result(p) for p in [_spawn(args) for _ in range(min(cores, 2))]]
        both = max(r["median_s"] for r in pair)
        base = base or res["median_s"]
        print(f"   {cap}: {res['median_s']:.2f} s alone, {both:.2f} s two at once", flush=True)
        rows.append(f"| {cap} | {res['median_s']:.2f} | {res['median_s'] / base:.2f}× | {both:.2f} | "
                    f"{both / res['median_s']:.2f}× |")
    lines += ["### Training pass: micro-batch token caps", "", *rows, "",
              f"Unpadded tokens are {res['padded_rows']:.0%} of the batch padded to its longest row. "
              "The last column is what the other controller's pass costs this one: the two cores "
              "share the last-level cache and memory bandwidth, which a cap whose micro-batches fit "
              "one core's own caches would lean on less (a likely reason, not measured directly).", ""]

    print("== generation: an engine per core at once against one engine on all cores", flush=True)
    procs = [_spawn(["--child", "generate", "--samples", str(ROWS), "--threads", "1", "--steps", str(a.steps)],
                    cores=str(c)) for c in range(min(cores, 2))]
    split = [_result(p) for p in procs]
    one = _result(_spawn(["--child", "generate", "--samples", str(ROWS * len(split)),
                          "--threads", str(len(split)), "--steps", str(a.steps)]))
    split_rate = sum(r["tokens"] for r in split) / max(r["seconds"] for r in split)
    one_rate = one["tokens"] / one["seconds"]
    lines += ["### Generation: an engine per controller against one engine", "",
              "| layout | seconds | tokens | tok/s |", "|---|---:|---:|---:|"]
    for i, r in enumerate(split):
        lines.append(f"| engine {i} on core {i} ({ROWS} samples, at the same time) | {r['seconds']:.2f} | "
                     f"{r['tokens']} | {r['tokens'] / r['seconds']:.0f} |")
    lines += [f"| one engine on {len(split)} cores ({ROWS * len(split)} samples) | {one['seconds']:.2f} | "
              f"{one['tokens']} | {one_rate:.0f} |", "",
              f"One engine on all cores generates {one_rate / split_rate:.2f}× the tokens per second of "
              f"{len(split)} per-core engines together ({split_rate:.0f} tok/s).", ""]
    body = "## Colocated step against its limit, piece by piece (issue 8)\n\n" + "\n".join(lines)
    print(body)
    if not a.no_docs:
        docs_section.write_section("colocate_gaps", body)


if __name__ == "__main__":
    main()
