"""Measured runs for the placement cost model and the memory estimate: `yatt train` per mode.

    PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py --out .yatt/placement-runs
    PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py --out .yatt/placement-runs \
        --two-nodes --modes disaggregated

Runs `configs/demo-arithmetic.yaml` once per placement mode (one at a time), samples the resident
memory of every process of the run twice a second (peak RSS per Ray actor: controllers, rollout
workers), and writes `<out>/<mode>/rss.json` beside the run's own metrics.jsonl. The figures are
then fitted and compared by `bench/placement_calibration.py`, which writes docs/benchmarks.md.

`--two-nodes` runs on a cluster of two Ray nodes on this machine instead of `yatt train`'s own
local head: this process starts a head with `--cpus-per-node` CPUs declared as as many devices,
joins a second raylet with as many (trainer/placement/local_nodes.py, standing in for a second
host), and `yatt train` joins that cluster through RAY_ADDRESS, so a disaggregated plan trains on
one node and generates on the other (trainer/placement/nodes.py). The runs go to
`<out>/<mode>-two-nodes/`, and each run's `placement` event must name two different nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
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


def run_mode(config: str, mode: str, out: Path, sets: list[str], *, name: str | None = None,
             ray_address: str | None = None) -> dict:
    """One `yatt train` of `config` in `mode` into `<out>/<name or mode>`; on the cluster at
    `ray_address` when given (its actors are then this process's descendants: it holds the
    head and the second node), else on the run's own local head."""
    name = name or mode
    run_dir = out / name
    cmd = [sys.executable, "-m", "backend.cli", "train", config, "--out", str(run_dir),
           "--set", f"placement.mode={mode}", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "RAY_ADDRESS": ray_address} if ray_address else None
    log = (out / f"{name}.log").open("w")
    t0 = time.time()
    load_start = os.getloadavg()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    peaks: dict[int, dict] = {}
    stop = threading.Event()

    def sample() -> None:
        root = psutil.Process(os.getpid() if ray_address else proc.pid)
        while not stop.is_set() and proc.poll() is None:
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
              "processes": sorted(peaks.values(), key=lambda r: r["role"]),
              "nodes": placement_nodes(run_dir)}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "rss.json").write_text(json.dumps(result, indent=2))
    return result


def placement_nodes(run_dir: Path) -> list[str] | None:
    """The node of each device from the run's last `placement` event (None on one node)."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return None
    nodes = None
    for line in path.read_text().splitlines():
        event = json.loads(line) if line.strip() else {}
        if event.get("kind") == "placement":
            nodes = event.get("data", {}).get("nodes")
    return nodes


def two_node_cluster(cpus_per_node: int, temp_dir: str) -> tuple[str, subprocess.Popen]:
    """A head in this process and a second raylet, `cpus_per_node` devices each; the head's
    GCS address and the second node's `ray start --block` process."""
    import ray

    from trainer.placement import DEVICE_RESOURCE
    from trainer.placement.local_nodes import start_ray_node

    ctx = ray.init(address="local", num_cpus=cpus_per_node, include_dashboard=False,
                   resources={DEVICE_RESOURCE: float(cpus_per_node)}, logging_level="ERROR")
    gcs = ctx.address_info["gcs_address"]
    try:
        node_b, _node_id = start_ray_node(gcs, temp_dir=temp_dir, cpus=cpus_per_node,
                                          resources={DEVICE_RESOURCE: float(cpus_per_node)})
    except BaseException:
        ray.shutdown()
        raise
    return gcs, node_b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/demo-arithmetic.yaml")
    ap.add_argument("--modes", default="colocate,disaggregated")
    ap.add_argument("--out", default=".yatt/placement-runs")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--two-nodes", action="store_true",
                    help="run on two Ray nodes started here (a head and a second raylet)")
    ap.add_argument("--cpus-per-node", type=int, default=1,
                    help="--two-nodes: CPUs (and devices) of each node")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    address, node_b = None, None
    with tempfile.TemporaryDirectory(prefix="yatt-node-b-") as temp_dir:
        try:
            if args.two_nodes:
                address, node_b = two_node_cluster(args.cpus_per_node, temp_dir)
            for mode in args.modes.split(","):
                name = f"{mode}-two-nodes" if args.two_nodes else mode
                r = run_mode(args.config, mode, out, args.sets, name=name, ray_address=address)
                peaks = ", ".join(f"{p['role']} {p['hwm'] / 2**30:.2f} GiB" for p in r["processes"])
                where = f"; devices on nodes {r['nodes']}" if r["nodes"] else ""
                print(f"{name}: rc={r['rc']} {r['wall_s']:.0f}s; peak RSS {peaks}{where}", flush=True)
                if args.two_nodes and mode == "disaggregated" and len(set(r["nodes"] or [])) < 2:
                    raise SystemExit(f"{name}: the placement event does not put the devices on two "
                                     f"nodes ({r['nodes']})")
        finally:
            if node_b is not None:  # only what this script started
                import ray

                from trainer.placement.local_nodes import stop_ray_node

                stop_ray_node(node_b)
                ray.shutdown()


if __name__ == "__main__":
    main()
