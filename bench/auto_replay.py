"""Replay a finished run's measured steps through `placement.mode: auto`'s planner, offline.

The planner is pure (trainer/placement/auto.py): fed the run's metrics.jsonl step by step, on the
plans the run really ran (its `applied` placement events), it makes the run's decisions again and
also shows what the run's events leave out: every drift check (not only those over
`placement.replan_drift`), how much of each drift was the work per step changing and how much the
same work taking a different time, and what other thresholds would have decided on the same
steps (up to the first decision the run did not take: after it, the run measured nothing).

    PYTHONPATH=$PWD .venv/bin/python bench/auto_replay.py RUN_DIR [--drift 0.2,0.3] [--gain 0.05,0.1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import TrainerConfig, parse_config  # noqa: E402
from trainer.placement.auto import AutoPlanner, Decision, candidate_layouts, layout_label  # noqa: E402
from trainer.placement.cost_model import Layout  # noqa: E402


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def param_bytes(cfg: TrainerConfig, run: Path) -> float:
    from trainer.driver import _param_bytes

    return _param_bytes(cfg, str(run / "final"))


def replay(run: Path, cfg: TrainerConfig) -> tuple[AutoPlanner, list[Decision], str | None]:
    """The planner fed `run`'s steps on the plans the run ran; the decisions it made, and the first
    switch it asked for that the run did not make (None when it agrees with the run)."""
    rows = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("step", 0) > 0 and "time/step" in m]
    events = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "placement"]
    applied = {int(e["data"]["step"]): e["data"]["plan"] for e in events
               if e["data"].get("decision") == "applied"}
    by_label: dict[str, Layout] = {layout_label(lay): lay for lay, _ in candidate_layouts(cfg)}
    planner = AutoPlanner(cfg, param_bytes=param_bytes(cfg, run))
    decisions: list[Decision] = []
    for row in rows:
        step = int(row["step"])
        decisions += planner.observe(step, {k: float(v) for k, v in row.items()
                                            if isinstance(v, int | float)}, now=row.get("time"))
        if step in applied:
            ran = by_label[applied[step]]
            if planner.pending != ran:
                asked = layout_label(planner.pending) if planner.pending else "no switch"
                return planner, decisions, f"at step {step} the run switched to {applied[step]}, the replay asked for {asked}"
            planner.stopping(now=row.get("time"))
            planner.switched(ran, step)
        elif planner.pending is not None and not any(s > step for s in applied):
            return planner, decisions, (f"at step {step} the replay asks for "
                                        f"{layout_label(planner.pending)}; the run did not switch")
    return planner, decisions, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--drift", default="", help="other placement.replan_drift values to try")
    ap.add_argument("--gain", default="", help="other placement.replan_min_gain values to try")
    args = ap.parse_args()
    data = json.loads((args.run / "config.json").read_text())
    data["placement"]["mode"] = "auto"
    cfg = parse_config(data)
    planner, decisions, diverged = replay(args.run, cfg)
    print(f"replay of {args.run} (drift {cfg.placement.replan_drift:.0%}, min gain "
          f"{cfg.placement.replan_min_gain:.0%}):")
    for d in decisions:
        print(f"  {d.message()}")
    if diverged:
        print(f"  replay stops: {diverged}")
    checks = planner.checks
    over = [c for c in checks if c["drift"] > cfg.placement.replan_drift]
    print(f"drift checks: {len(checks)}, over {cfg.placement.replan_drift:.0%}: {len(over)}")
    for c in checks:
        print(f"  step {c['step']:4d}: drift {c['drift']:.0%}, work per step changed "
              f"{c['work_change']:.1%}, model off at the work done now "
              f"{c.get('model_error', float('nan')):.0%}")
    if checks:
        print(f"median work change {statistics.median(c['work_change'] for c in checks):.1%}, "
              f"largest {max(c['work_change'] for c in checks):.1%}")
    for drift in [float(x) for x in args.drift.split(",") if x]:
        for gain in [float(x) for x in args.gain.split(",") if x] or [cfg.placement.replan_min_gain]:
            d2 = {**data, "placement": {**data["placement"], "replan_drift": drift, "replan_min_gain": gain}}
            p2, dec2, div2 = replay(args.run, parse_config(d2))
            switches = [d for d in dec2 if d.switch and d.kind in ("replan", "initial")]
            print(f"drift {drift:.0%} gain {gain:.0%}: {sum(c['drift'] > drift for c in p2.checks)} of "
                  f"{len(p2.checks)} checks over; {len(switches)} switch decisions; "
                  f"{div2 or 'agrees with the run'}")


if __name__ == "__main__":
    main()
