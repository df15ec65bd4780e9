"""placement.mode=auto against fixed placements on a workload that shifts mid-run.

One command: trains the demo (`configs/demo-arithmetic.yaml --set placement.mode=auto`) with a
slower decoder from step `--shift` on (`YATT_SLOW_DECODE`, docs/placement.md), then runs
colocate and disaggregated from that run's final model (no warm start) with the same shift
after `--fixed-shift` steps, and prints, side by side, each run's measured step time before and
after the shift, auto's decisions (predicted vs measured) and whether auto settled on the mode
that measured fastest (or within 5%). Writes the `auto_placement` section of docs/benchmarks.md.

    PYTHONPATH=$PWD .venv/bin/python bench/auto_placement.py --out .yatt/auto-placement
    # reuse an auto run already made: --auto-run DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo-arithmetic.yaml"
SLOW_S = 0.15  # seconds per decode step of the longest response, from the shift on
WARMUP = 2  # steps after every gang start left out of the means (engine warm-up, empty prefetch)


def load_avg() -> float:
    return os.getloadavg()[0]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def train(out: Path, sets: list[str], shift: int) -> float:
    cmd = [str(Path(sys.executable).parent / "yatt"), "train", str(CONFIG), "--out", str(out),
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "YATT_SLOW_DECODE": f"{shift}:{SLOW_S}"}
    t0 = time.perf_counter()
    with (out.parent / f"{out.name}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return time.perf_counter() - t0


def segments(run: Path) -> list[tuple[int, int, str]]:
    """(first step, last step, plan) of each gang of a run, from its placement events."""
    events = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "placement"]
    start = events[0]["data"]
    plan = start.get("plan") or start.get("mode", "?")
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl") if m["step"] > 0]
    out, first = [], 1
    for e in events:
        if e["data"].get("decision") == "applied":
            out.append((first, int(e["data"]["step"]), plan))
            first, plan = int(e["data"]["step"]) + 1, e["data"]["plan"]
    out.append((first, max(steps) if steps else first, plan))
    return out


def mean_step(run: Path, lo: int, hi: int) -> float | None:
    """Mean measured step time over steps lo..hi, leaving out each gang's warm-up steps."""
    starts = {a for a, _b, _p in segments(run)}
    warm = {s + k for s in starts for k in range(WARMUP)}
    xs = [m["time/step"] for m in read_jsonl(run / "metrics.jsonl")
          if lo <= m["step"] <= hi and m["step"] not in warm and "time/step" in m]
    return sum(xs) / len(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".yatt" / "auto-placement")
    ap.add_argument("--auto-run", type=Path, default=None, help="an auto run already made")
    ap.add_argument("--shift", type=int, default=40, help="first slow step of the auto run")
    ap.add_argument("--fixed-steps", type=int, default=36)
    ap.add_argument("--fixed-shift", type=int, default=10)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loads = [load_avg()]
    auto = args.auto_run
    if auto is None:
        auto = args.out / "auto"
        train(auto, ["placement.mode=auto"], args.shift)
        loads.append(load_avg())
    summary = json.loads((auto / "summary.json").read_text())
    fixed: dict[str, Path] = {}
    for mode in ("colocate", "disaggregated"):
        fixed[mode] = args.out / mode
        train(fixed[mode], [f"placement.mode={mode}", f"model.path={auto / 'final'}",
                            "algorithm.warm_start.steps=0", "algorithm.warm_start.target_accuracy=null",
                            f"train.max_steps={args.fixed_steps}"],
              args.fixed_shift)
        loads.append(load_avg())
    rows = []
    for mode, run in fixed.items():
        rows.append((mode, mean_step(run, 1, args.fixed_shift - 1),
                     mean_step(run, args.fixed_shift, args.fixed_steps)))
    after = {mode: a for mode, _b, a in rows if a is not None}
    fastest = min(after, key=lambda m: after[m]) if after else None
    segs = segments(auto)
    final_plan = segs[-1][2]
    final_mode = final_plan.split()[0]
    lines = [f"`PYTHONPATH=$PWD .venv/bin/python bench/auto_placement.py` — "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average (1 min) "
             f"{' → '.join(f'{x:.1f}' for x in loads)}. Slow decoder: {SLOW_S} s per decode step "
             f"of a call's longest response from step {args.shift} (auto) / {args.fixed_shift} "
             "(fixed runs, from the auto run's final model, no warm start).", "",
             "| run | steps | plan | mean step s before the shift | after |", "|---|---|---|---:|---:|"]
    for a, b, plan in segs:
        before = mean_step(auto, a, min(b, args.shift - 1)) if a < args.shift else None
        aft = mean_step(auto, max(a, args.shift), b) if b >= args.shift else None
        lines.append(f"| auto | {a}–{b} | {plan} | {_s(before)} | {_s(aft)} |")
    for mode, before, aft in rows:
        lines.append(f"| {mode} | 1–{args.fixed_steps} | {mode} | {_s(before)} | {_s(aft)} |")
    lines.append("")
    decisions = [e for e in read_jsonl(auto / "events.jsonl") if e["kind"] == "placement"]
    for e in decisions:
        d = e["data"]
        if d.get("decision") in ("profile", "initial", "replan", "kept", "measured"):
            lines.append(f"- {e['message']}")
    lines.append("")
    verdict = "no fixed run measured"
    if fastest is not None:
        gap = (after.get(final_mode, float("inf")) - after[fastest]) / after[fastest]
        verdict = (f"after the shift {fastest} measured fastest ({after[fastest]:.3f} s/step); auto "
                   f"ended on {final_plan}, {'the same mode' if final_mode == fastest else f'{gap:+.1%}'}"
                   f" — {'within' if gap <= 0.05 else 'not within'} 5%")
    lines.append(f"Verdict: {verdict}. Auto run: held-out accuracy "
                 f"{summary.get('eval/accuracy_start', 0):.1%} → {summary.get('eval/accuracy_end', 0):.1%}, "
                 f"{len(summary.get('placement_switches', []))} switches, wall {summary.get('wall_time_s', 0):.0f} s.")
    body = "## placement.mode=auto on a workload that shifts\n\n" + "\n".join(lines) + "\n"
    print(body)
    write_section("auto_placement", body)


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
