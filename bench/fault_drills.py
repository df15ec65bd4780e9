"""Run the fault drills (tests/integration/test_fault_drills.py) and print their figures as a
table: faults injected, points lost, runs doubled, runs stuck, time to recover. The table also
goes into docs/reliability.md (between its `fault_drills` markers).

    python bench/fault_drills.py            # all three drills (minutes; the table at the end)
    python bench/fault_drills.py -k redis_restarted   # one of them (pytest's -k on the test name)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RELIABILITY = ROOT / "docs" / "reliability.md"

FAULTS = {
    "postgres_restart": "PostgreSQL stopped (`pg_ctl stop -m fast`) mid-run, started again",
    "redis_restart": "Redis (broker) SIGKILLed with 2 runs training, 2 queued, 2 posted while down; restarted",
    "ray_node_killed": "Ray worker node holding the run's controller SIGKILLed (every process); a new node joins",
}


def _recovery(fig: dict[str, Any]) -> str:
    if fig["drill"] == "postgres_restart":
        return (f"API ready {fig['api_ready_after_s']} s, spool drained {fig['spool_drained_after_s']} s "
                f"after the restart")
    if fig["drill"] == "redis_restart":
        return (f"worker reconnected {fig['worker_reconnected_after_s']} s after the restart; "
                f"all runs done {fig['all_runs_done_after_s']} s after it")
    return (f"training past the step of the kill {fig['recovered_after_s']} s after it "
            f"(resumed from step {', '.join(map(str, fig['resumed_from_steps']))}, attempt {fig['attempts']})")


def _lost_doubled(fig: dict[str, Any], what: str) -> str:
    if f"{what}_reported" not in fig:
        return "—"
    return f"{fig[f'{what}_lost']} / {fig[f'{what}_doubled']} of {fig[f'{what}_reported']}"


def table(figures: list[dict[str, Any]]) -> str:
    """The markdown table of the drills' figures."""
    lines = [
        "| fault injected | outage | points lost / doubled | events lost / doubled | "
        "checkpoints lost / doubled | runs | doubled | stuck | time to recover |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fig in figures:
        outage = f"{fig['outage_s']} s" if "outage_s" in fig else "node replaced"
        lines.append(
            f"| {FAULTS[fig['drill']]} | {outage} | {_lost_doubled(fig, 'points')} | "
            f"{_lost_doubled(fig, 'events')} | {_lost_doubled(fig, 'checkpoints')} | {fig['runs']} | "
            f"{fig['runs_doubled']} | {fig['runs_stuck']} | {_recovery(fig)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="yatt-drills-") as tmp:
        out = Path(tmp) / "figures.jsonl"
        env = {**os.environ, "YATT_DRILL_FIGURES": str(out), "PYTHONPATH": str(ROOT)}
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/integration/test_fault_drills.py", "-q", "-p",
             "no:cacheprovider", *sys.argv[1:]], cwd=ROOT, env=env,
        )
        wall = time.monotonic() - t0
        figures = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if not figures:
        print("no drill reported figures", file=sys.stderr)
        return 1
    body = table(figures)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    stamp = f"{time.strftime('%Y-%m-%d')}, {wall:.0f} s for the drills, load average {' '.join(load)}"
    print(body)
    print(stamp)
    status = "every drill passed" if proc.returncode == 0 else f"pytest exited {proc.returncode}: a drill failed"
    print(status)
    if proc.returncode == 0 and len(figures) == len(FAULTS):
        write_section("fault_drills", f"Measured {stamp} (`python bench/fault_drills.py`):\n\n{body}", RELIABILITY)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
