"""The gradient all-reduce of ranks on one host: gloo against shared memory, side by side.

    PYTHONPATH=. .venv/bin/python bench/allreduce.py            # --ranks 2 --rounds 8, --no-docs

`--ranks` processes (default: one per core, each pinned to its core with one torch thread, as
colocated controllers run) join one `DataParallelGroup` (trainer/learner.py) and average a
gradient of every parameter of the `small` policy (bench-small, as bench/trainer_vs_trl.py
builds it: 66 MiB of fp32), the ways in alternation each round after a warm-up of each:

- gloo, a collective per tensor, all in flight (what yatt did for replicated ranks);
- gloo, one flat tensor (every gradient copied into one buffer and back);
- shared memory (trainer/shm_allreduce.py, what yatt does now for ranks on one host).

Prints each way's median seconds on the slowest rank, the ratios, and checks that shared
memory gives every rank the same sums bit for bit, and (2 ranks) the same bits as gloo.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".yatt" / "models" / "bench-small"
SECTION = "allreduce"
WAYS = ("gloo, a collective per tensor", "gloo, one flat tensor", "shared memory")


def rank_main(rank: int, world: int, port: int, rounds: int, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.learner import DataParallelGroup

    torch.set_num_threads(1)
    group = DataParallelGroup("127.0.0.1", port, rank, world, timeout_s=300)
    assert group.shm is not None, "no shared memory between the ranks"
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]

    def per_tensor(ts):
        works = [group.pg.allreduce([t]) for t in ts]
        for w in works:
            w.wait()

    def flat(ts):
        buf = torch.cat([t.view(-1) for t in ts])
        group.all_reduce(buf)
        offset = 0
        for t in ts:
            t.view(-1).copy_(buf[offset : offset + t.numel()])
            offset += t.numel()

    ways = dict(zip(WAYS, (per_tensor, flat, group.shm.all_reduce_), strict=True))
    results, times = {}, {w: [] for w in WAYS}
    for r in range(rounds + 1):
        for name in WAYS if r % 2 == 0 else reversed(WAYS):
            ts = [g.clone() for g in grads]
            group.barrier()
            t = time.perf_counter()
            ways[name](ts)
            elapsed = time.perf_counter() - t
            if r == 0:
                results[name] = ts
            else:
                times[name].append(elapsed)
    # gloo's sums against the shared memory's: the same bits with 2 ranks (a + b == b + a); with
    # more, gloo adds in another order (rounding), so the largest difference is reported
    same = all(torch.equal(a, b) for name in WAYS[1:] for a, b in zip(results[WAYS[0]], results[name], strict=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(results[WAYS[0]], results[WAYS[2]], strict=True))
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in results[WAYS[2]])).hexdigest()
    Path(out).write_text(json.dumps({"times": times, "same": same, "diff": diff, "digest": digest,
                                     "bytes": sum(g.numel() * 4 for g in grads)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.port, args.rounds, args.out)
        return

    from trainer.config import parse_config
    from trainer.models import ensure_model

    ensure_model(parse_config({"model": {"path": str(MODEL), "preset": "small"},
                               "data": {"task": "arithmetic", "arithmetic": {"digits": 2, "ops": ["+"]}}}))
    cores = os.cpu_count() or 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="allreduce-") as tmp:
        outs = [str(Path(tmp) / f"{r}.json") for r in range(args.ranks)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(["taskset", "-c", str(r % cores), sys.executable, __file__,
                                   "--rank", str(r), "--ranks", str(args.ranks), "--port", str(port),
                                   "--rounds", str(args.rounds), "--out", outs[r]], env=env, cwd=ROOT)
                 for r in range(args.ranks)]
        if any(p.wait(timeout=900) != 0 for p in procs):
            raise SystemExit("a rank failed")
        ranks = [json.loads(Path(o).read_text()) for o in outs]
    # per round, the slowest rank's time (the others wait for it at the next collective)
    med = {w: statistics.median(max(r["times"][w][i] for r in ranks) for i in range(args.rounds)) for w in WAYS}
    ranks_agree = len({r["digest"] for r in ranks}) == 1  # shared memory: one result on every rank
    same = all(r["same"] for r in ranks)
    agree = ranks_agree and (same or args.ranks > 2)
    base = med[WAYS[0]]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.ranks} ranks on "
        f"{cores} cores (each pinned to a core, one torch thread), a gradient of every parameter of "
        f"the `small` policy ({ranks[0]['bytes'] / 2**20:.1f} MiB of fp32), {args.rounds} rounds per way "
        f"in alternation (median of the slowest rank). Command: `PYTHONPATH=. .venv/bin/python bench/allreduce.py`.",
        "",
        "| way | median (ms) | speed vs a collective per tensor |",
        "|---|---:|---:|",
        *[f"| {w} | {s * 1e3:.1f} | {base / s:.2f}× |" for w, s in med.items()],
        "",
        f"Shared memory gave every rank the same sums bit for bit: {'yes' if ranks_agree else 'NO'}; "
        + (f"the same bits as gloo's: {'yes' if same else 'NO'}." if same or args.ranks == 2 else
           f"gloo adds {args.ranks} ranks in another order: largest difference "
           f"{max(r['diff'] for r in ranks):.2e}."),
        "",
    ]
    text = "## Gradient all-reduce on one host: gloo vs shared memory (issue 8 item 3)\n\n" + "\n".join(lines)
    print(text)
    if not args.no_docs:
        docs_section.write_section(SECTION, text)
    print(f"ratio: {min(med[WAYS[0]], med[WAYS[1]]) / med[WAYS[2]]:.2f}")
    if not agree:
        raise SystemExit("the ways or the ranks disagree")


if __name__ == "__main__":
    main()
