"""A second Ray node on this machine, standing in for a second host (issue 9 item 5).

`ray start --address=<head> --block` with a temp dir of its own joins one more raylet to a
running head; its devices are declared the way a real worker host declares them
(`--resources='{"yatt_device": N}'`), so trainer/placement/nodes.py splits a disaggregated plan
across it and the policy crosses nodes through trainer/weight_sync.py's broadcast. Used by
tests/integration/test_two_nodes.py, bench/weight_sync.py --two-nodes and
bench/placement_runs.py --two-nodes. Only the process started here is stopped afterwards, never
`ray stop`: other clusters run on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["start_ray_node", "stop_ray_node"]


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def start_ray_node(gcs_address: str, *, temp_dir: str, cpus: float, resources: dict[str, float],
                   timeout_s: float = 240.0) -> tuple[subprocess.Popen, str]:
    """Join a raylet with `cpus` CPUs and `resources` to the head at `gcs_address` (this process
    must be connected to it); returns the `ray start --block` process and the new node's id.

    `temp_dir` should be short: Ray's socket paths under it must fit in 107 bytes."""
    before = _alive_nodes()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", f"--address={gcs_address}",
         f"--num-cpus={cpus:g}", f"--resources={json.dumps(resources)}", f"--temp-dir={temp_dir}",
         "--disable-usage-stats", "--block"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while not (new := _alive_nodes() - before):
        if proc.poll() is not None or time.time() > deadline:
            stop_ray_node(proc)
            raise RuntimeError(f"the second Ray node did not join within {timeout_s:.0f}s "
                               f"(ray start exited with {proc.poll()})")
        time.sleep(1)
    return proc, sorted(new)[0]


def stop_ray_node(proc: subprocess.Popen, *, timeout_s: float = 60.0) -> None:
    """Stop a node started by `start_ray_node`: `ray start --block` stops the raylet it started
    when it is terminated."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
