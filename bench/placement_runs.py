"""Measured runs for the placement cost model and the memory estimate: `yatt train` per mode.

    PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py --out .yatt/placement-runs

Runs `configs/demo-arithmetic.yaml` once per placement mode (one at a time), samples the resident
memory of every process of the run twice a second (peak RSS per Ray actor: controllers, rollout
workers), and writes `<out>/<mode>/rss.json` beside the run's own metrics.jsonl. The figures are
then fitted and compared by `bench/placement_calibration.py`, which writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def _role(proc: psutil.Process) -> str | None:
    try:
        text = " ".join(proc.cmdline()) + " " + proc.name()
    except psutil.Error:  # it ended while we looked
        return None
    for role in ("ControllerActor", "RolloutWorker"):
        if f"ray::{role}" in text:
            return role
    return None


def _hwm_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_mode(config: str, mode: str, out: Path, sets: list[str]) -> dict:
    run_dir = out / mode
    cmd = [sys.executable, "-m", "backend.cli", "train", config, "--out", str(run_dir),
           "--set", f"placement.mode={mode}", *[a for s in sets for a in ("--set", s)]]
    log = (out / f"{mode}.log").open("w")
    t0 = time.time()
    load_start = os.getloadavg()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    peaks: dict[int, dict] = {}
    stop = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                kids = root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in kids:
                role = _role(p)
                if role is None:
                    continue
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                rec = peaks.setdefault(p.pid, {"role": role, "rss_peak": 0, "hwm": 0})
                rec["rss_peak"] = max(rec["rss_peak"], rss)
                rec["hwm"] = max(rec["hwm"], _hwm_bytes(p.pid))
            stop.wait(0.5)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    finally:
        stop.set()
        th.join()
    result = {"mode": mode, "rc": rc, "wall_s": time.time() - t0,
              "load_start": load_start, "load_end": os.getloadavg(),
              "processes": sorted(peaks.values(), key=lambda r: r["role"])}
    (run_dir / "rss.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/demo-arithmetic.yaml")
    ap.add_argument("--modes", default="colocate,disaggregated")
    ap.add_argument("--out", default=".yatt/placement-runs")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        r = run_mode(args.config, mode, out, args.sets)
        peaks = ", ".join(f"{p['role']} {p['hwm'] / 2**30:.2f} GiB" for p in r["processes"])
        print(f"{mode}: rc={r['rc']} {r['wall_s']:.0f}s; peak RSS {peaks}", flush=True)


if __name__ == "__main__":
    main()
