"""Shape buckets (`train.pad_to_multiple`): a trained token's cost when every step's lengths are new.

    PYTHONPATH=. .venv/bin/python bench/shape_buckets.py

Sampled responses differ in length every step, so the micro-batches a learner cuts (rows sorted
by length, each cut to its longest row) come in shapes it has not met before. This measures what
that costs and what rounding the cut up to a multiple buys back: the `Learner`'s reference pass
and one training pass (forward, backward, clip, AdamW; the passes of bench/trainer_vs_trl.py's
limit, through the same `_micro_batches` and `_chunk_logprobs`) over a step of 32 random-token
responses on the `small` model, at the precision yatt runs, on every core. Settings, each in a
fresh process (its heap and kernel caches its own), in alternating order over `--repeat` rounds:

- `same batch, exact`: one draw of lengths trained every step (the limit's way: its shapes repeat);
- `new lengths, exact`: a new draw every step, each micro-batch at its own longest row
  (`train.pad_to_multiple: 1`, yatt before the buckets);
- `new lengths, auto`: a new draw every step, widths rounded up as yatt's default does (a
  multiple of 16, or of a smaller power of two within a sixteenth of the width);
- `new lengths, N`: a new draw every step, widths rounded up to a multiple of N.

Response lengths are drawn uniformly from [`--shortest`, `--longest`] (a seed per step, the same
draws in every setting). Prints ms per response token (median over the steps after
`--warmup`, rounds pooled), the padding the buckets add, page faults a step and glibc's heap at
the end, and writes the `shape_buckets` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
SECTION = "shape_buckets"
ROWS = 32


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_mb() -> dict[str, float] | None:
    """glibc's heap (all arenas): bytes taken from the kernel and in use, in MB (None off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return None
    return {"arena": (m.arena + m.hblkhd) / 2**20, "used": m.uordblks / 2**20}


def child(setting: str, a: argparse.Namespace) -> dict:
    """One setting's steps in this process: per step, ms per response token and page faults."""
    import torch
    from trainer_vs_trl import MODEL, yatt_config

    from trainer.config import parse_config
    from trainer.host_memory import steady_heap
    from trainer.learner import Learner, padded_length
    from trainer.models import ensure_model

    steady_heap()  # as yatt's processes run
    torch.set_num_threads(a.threads)
    last = setting.rsplit(" ", 1)[1]
    multiple: int | str = 1 if last == "exact" else last if last == "auto" else int(last)
    cfg = parse_config(yatt_config(a.longest, 1, "colocate", pad_to_multiple=multiple))
    ensure_model(cfg)
    learner = Learner(cfg, MODEL)
    prompt = learner.tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    vocab = len(learner.tokenizer)

    def draw(seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(a.shortest, a.longest))] for _ in range(ROWS)]

    steps = []
    for step in range(a.warmup + a.steps):
        responses = draw(0 if setting.startswith("same") else step)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        ids, attn, index, mask = learner._layout([prompt] * ROWS, responses)
        chunks = learner._micro_batches(attn.sum(dim=1))
        with torch.no_grad(), learner.autocast():
            for c in chunks:
                learner._chunk_logprobs(learner.reference, ids, attn, index, mask, c)
        learner.optimizer.zero_grad(set_to_none=True)
        for c in chunks:
            with learner.autocast():
                lp, _ = learner._chunk_logprobs(learner.policy, ids, attn, index, mask, c)
            (-(lp * mask[c]).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(learner.policy.parameters(), 1.0)
        learner.optimizer.step()
        seconds = time.perf_counter() - t
        real = int(attn.sum())
        shapes = [(len(c), padded_length(int(attn[c].sum(dim=1).max()), multiple, ids.shape[1])) for c in chunks]
        steps.append({"ms_per_token": 1000 * seconds / float(mask.sum()),
                      "padding": sum(r * w for r, w in shapes) / real - 1,
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                      "shapes": sorted(set(shapes))})
        print(f"  {setting}: step {step} {steps[-1]['ms_per_token']:.3f} ms/token", file=sys.stderr, flush=True)
    return {"steps": steps[a.warmup:], "heap": heap_mb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--multiples", default="auto,16,32",
                    help="`train.pad_to_multiple` settings to measure beside exact widths")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="rounds, each setting once, order alternating")
    ap.add_argument("--shortest", type=int, default=64)
    ap.add_argument("--longest", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a)))
        return

    settings = ["same batch, exact", "new lengths, exact"] + [f"new lengths, {m}" for m in a.multiples.split(",")]
    pooled: dict[str, list[dict]] = {s: [] for s in settings}
    heaps: dict[str, list[dict]] = {s: [] for s in settings}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    for r in range(a.repeat):
        for s in settings if r % 2 == 0 else settings[::-1]:
            print(f"round {r + 1}/{a.repeat}: {s}", file=sys.stderr, flush=True)
            argv = [sys.executable, __file__, "--child", s] + [
                f"--{k}={getattr(a, k)}" for k in ("steps", "warmup", "shortest", "longest", "threads")]
            out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'bench'}"})
            if out.returncode != 0:
                raise SystemExit(f"{s} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            pooled[s] += res["steps"]
            heaps[s].append(res["heap"])

    exact = statistics.median(x["ms_per_token"] for x in pooled["new lengths, exact"])
    rows = ["| setting | ms per response token (median) | vs new lengths, exact | padded tokens over the rows' own "
            "(mean) | distinct micro-batch shapes (rows × width) | page faults a step (median) | glibc heap at the end, taken / in use (MB) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for s in settings:
        steps = pooled[s]
        ms = statistics.median(x["ms_per_token"] for x in steps)
        layouts = {tuple(map(tuple, x["shapes"])) for x in steps}
        flat = {sh for x in steps for sh in map(tuple, x["shapes"])}
        heap = " / ".join(f"{statistics.mean(h[k] for h in heaps[s] if h):.0f}" for k in ("arena", "used")) \
            if all(heaps[s]) else "n/a"
        rows.append(f"| {s} | {ms:.3f} | {ms / exact:.2f}× | {statistics.mean(x['padding'] for x in steps):.1%} | "
                    f"{len(flat)} over {len(steps)} steps ({len(layouts)} distinct steps) | "
                    f"{statistics.median(x['faults'] for x in steps):.0f} | {heap} |")
    lines = ["## Shape buckets: a trained token when every step's lengths are new (`bench/shape_buckets.py`, issue 8)",
             "", f"Measured {started} on {os.cpu_count()} cores ({a.threads} threads), load average "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the start (shared machine: compare within "
             "one run only).", "",
             "Command: `PYTHONPATH=. .venv/bin/python bench/shape_buckets.py`", "",
             f"{ROWS} responses a step of {a.shortest}–{a.longest} random tokens (uniform), the reference pass "
             f"and one training pass; {a.steps} steps after {a.warmup} warm-up steps, {a.repeat} rounds in "
             "alternating order, pooled; each setting in a fresh process.", "", *rows, ""]
    text = "\n".join(lines)
    print(text)
    if not a.no_docs:
        docs_section.write_section(SECTION, text)


if __name__ == "__main__":
    main()
