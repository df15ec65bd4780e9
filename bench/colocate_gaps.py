"""Where a colocated step loses time against the limit of trainer_vs_trl, measured piece by piece.

    PYTHONPATH=. .venv/bin/python bench/colocate_gaps.py

Same `small` model and workload as bench/trainer_vs_trl.py's generation-heavy case (16 rows per
controller, up to 256 new tokens), on this machine's default precision (fp32 where the CPU has no
native bf16). Three questions, each answered side by side in this one run:

1. Training pass: one rank's `rl_step` (reference pass + training, 16 rows with responses of
   1-256 tokens, one thread) for each `train.micro_batch_tokens` cap, against no cap ("none": every
   row padded to the batch's longest); alone, and two ranks at once as a colocated step runs them.
2. Training beside an engine (`--engine-cap`): the same rl_step, two ranks at once, in a bare
   process and beside an in-process vLLM engine that generates before every step and takes the
   new weights after it, as a colocated controller runs; alternated over `--engine-rounds`.
3. Generation: each controller's vLLM engine on its own core (two processes at once, 16 samples
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


def child_train(cap: int | None, steps: int, engine: bool = False) -> dict:
    """Median seconds of one rank's rl_step on a fixed synthetic batch shape, one thread.

    ``engine``: as a colocated controller runs it, beside an in-process vLLM engine that generates
    this rank's samples before every step and takes the updated weights in place after it (only
    the rl_step is timed). The process holds its heap steady as a controller's does.
    """
    import torch

    from trainer.config import parse_config
    from trainer.host_memory import steady_heap
    from trainer.learner import Learner, RLBatch
    from trainer.weight_sync import load_in_place

    steady_heap()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = parse_config(_config(cap))
    sampler = None
    if engine:  # built first, as a controller builds it (it reseeds torch)
        from trainer.rollout import make_engine

        sampler = make_engine(cfg, str(MODEL), threads=1, seed=0)
        torch.manual_seed(0)
    learner = Learner(cfg, str(MODEL))
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
        if sampler is not None:
            sampler.generate(["12+34=", "56+7="], n=ROWS // 2)
        t0 = time.perf_counter()
        learner.rl_step(batch)
        times.append(time.perf_counter() - t0)
        if sampler is not None:
            load_in_place(sampler, learner.iter_named_weights(), len(times))
    if sampler is not None:
        sampler.close()
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
    ap.add_argument("--engine-cap", default="1024",
                    help="cap of the training-beside-an-engine comparison ('' to skip it)")
    ap.add_argument("--engine-rounds", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cap", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "train":
        print(json.dumps(child_train(None if a.cap == "none" else int(a.cap), a.steps, a.engine)))
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

    if a.engine_cap:
        # the same rl_step with and without an engine beside it, alternated so that a drift of the
        # machine's speed falls on both; two ranks at once, as a colocated step trains
        print(f"== training beside an engine: rl_step at cap {a.engine_cap}, two ranks at once", flush=True)
        runs: dict[str, list[float]] = {"alone": [], "engine": []}
        for _ in range(a.engine_rounds):
            for kind in runs:
                args = ["--child", "train", "--cap", a.engine_cap, "--steps", str(a.steps),
                        *(["--engine"] if kind == "engine" else [])]
                pair = [_result(p) for p in [_spawn(args) for _ in range(min(cores, 2))]]
                runs[kind].append(max(r["median_s"] for r in pair))
                print(f"   {kind}: {runs[kind][-1]:.2f} s", flush=True)
        alone, beside = statistics.median(runs["alone"]), statistics.median(runs["engine"])
        lines += ["### Training beside an engine", "",
                  f"One rank's rl_step (`train.micro_batch_tokens` {a.engine_cap}), two ranks at once, "
                  "each in a process of its own: in a bare process, and beside an in-process vLLM "
                  f"engine that generates the rank's {ROWS} samples before every step and takes the "
                  "new weights in place after it, as a colocated controller runs (only the rl_step "
                  f"timed; the slower rank's median over {a.steps} steps, {a.engine_rounds} rounds "
                  "in alternating order).", "",
                  "| process | rl_step per round (s) | median s |", "|---|---|---:|",
                  f"| bare | {', '.join(f'{x:.2f}' for x in runs['alone'])} | {alone:.2f} |",
                  f"| beside an engine | {', '.join(f'{x:.2f}' for x in runs['engine'])} | {beside:.2f} |",
                  "", f"Beside an engine the step takes {beside / alone:.2f}× the bare one.", ""]

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
