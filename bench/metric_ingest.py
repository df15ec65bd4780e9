"""Metric ingest over HTTP, SQLite and PostgreSQL side by side.

    .venv/bin/python bench/metric_ingest.py            # or: make bench

Starts the real API (`yatt api`, one uvicorn worker, its own process) on a fresh database of
each kind, and posts batches of metric points from one client, as a trainer's reporter does:
`POST /api/v1/runs/{id}/metrics` with the run's token and a batch id, one batch at a time. Bodies are encoded before the clock
starts, so the figure is the service's (HTTP + validation + one transaction per batch).
Then it reads a million-point series back with `max_points=1000`. Prints a table and writes
the `metric_ingest` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx
from databases import fresh_database  # noqa: E402 (bench/databases.py, beside this script)
from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["reward/mean", "loss/policy", "kl/mean", "throughput/tokens_per_s", "time/rollout"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    """`yatt api` in a subprocess on a free port, with an admin token."""

    def __init__(self, database_url: str, data_dir: Path):
        self.database_url = database_url
        self.trainers: dict[int, httpx.Client] = {}
        env = {**os.environ, "YATT_DATABASE_URL": database_url, "YATT_DATA_DIR": str(data_dir)}
        token = subprocess.run(
            [sys.executable, "-m", "backend.cli", "token", "create", "--project", "bench", "--role", "admin"],
            env=env, cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "api", "--port", str(self.port), "--no-migrate"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.http = httpx.Client(
            base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=120
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the API did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            time.sleep(0.2)

    def new_run(self) -> int:
        """A run moved to `running` (admin state reports), with a client holding its run token."""
        import backend.models  # noqa: F401 - every table, for the ORM's foreign keys
        from backend.auth.service import create_run_token
        from backend.db import Database

        r = self.http.post("/runs", json={"experiment": "bench", "config": {}})
        r.raise_for_status()
        run_id = int(r.json()["id"])
        for state in ("starting", "running"):
            self.http.post(f"/runs/{run_id}/state", json={"state": state}).raise_for_status()
        db = Database(self.database_url)
        try:
            with db.session() as s:  # minted as the dispatcher does
                token = create_run_token(db_session=s, project_id=int(r.json()["project_id"]), run_id=run_id,
                                         attempt=1, ttl_s=3600)
        finally:
            db.dispose()
        self.trainers[run_id] = httpx.Client(base_url=self.url + "/api/v1", timeout=120,
                                             headers={"Authorization": f"Bearer {token}"})
        return run_id

    def close(self) -> None:
        for client in self.trainers.values():
            client.close()
        self.http.close()
        self.proc.terminate()
        self.proc.wait(timeout=20)


def bodies(total: int, batch: int, keys: list[str]) -> list[bytes]:
    """`total` points in batches of `batch`, steps increasing, keys interleaved."""
    out, t0, step = [], time.time(), 0
    for start in range(0, total, batch):
        points = []
        for i in range(start, min(total, start + batch)):
            key = keys[i % len(keys)]
            if i % len(keys) == 0:
                step += 1
            points.append({"key": key, "step": step, "value": (i % 1000) / 1000.0, "time": t0 + i * 1e-3})
        out.append(json.dumps({"batch_id": f"bench-{start:012d}", "points": points}).encode())
    return out


def ingest(api: Api, run_id: int, payloads: list[bytes]) -> tuple[float, list[float]]:
    """Post each body in turn; (seconds in all, seconds per request)."""
    latencies = []
    start = time.perf_counter()
    for body in payloads:
        t = time.perf_counter()
        r = api.trainers[run_id].post(f"/runs/{run_id}/metrics", content=body,
                                      headers={"Content-Type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        latencies.append(time.perf_counter() - t)
    return time.perf_counter() - start, latencies


def read_back(api: Api, run_id: int, key: str, max_points: int, repeat: int = 5) -> tuple[float, int]:
    times, n = [], 0
    for _ in range(repeat):
        t = time.perf_counter()
        r = api.http.get(f"/runs/{run_id}/metrics", params={"keys": key, "max_points": max_points})
        r.raise_for_status()
        times.append(time.perf_counter() - t)
        n = len(r.json()["series"][key])
    return median(times), n


def bench_database(kind: str, url: str, data_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== {kind}", flush=True)
    api = Api(url, data_dir)
    result: dict[str, Any] = {"kind": kind, "batches": []}
    try:
        for batch in args.batch_sizes:
            run_id = api.new_run()
            payloads = bodies(args.points, batch, KEYS)
            ingest(api, run_id, payloads[:1])  # warm-up (connection, caches), not counted
            run_id = api.new_run()
            seconds, lat = ingest(api, run_id, payloads)
            rate = args.points / seconds
            result["batches"].append(
                {"batch": batch, "points": args.points, "seconds": seconds, "rate": rate, "p50_ms": median(lat) * 1e3}
            )
            print(f"batch {batch:>6}: {rate:>9,.0f} points/s  ({args.points:,} points in {seconds:.2f} s, "
                  f"median request {median(lat) * 1e3:.0f} ms)", flush=True)
        if args.million:
            run_id = api.new_run()
            total = args.million
            t = time.perf_counter()
            ingest(api, run_id, bodies(total, 10_000, ["reward/mean"]))
            print(f"one key, {total:,} points ingested in {time.perf_counter() - t:.1f} s", flush=True)
            seconds, n = read_back(api, run_id, "reward/mean", 1000)
            result["read"] = {"points": total, "max_points": 1000, "seconds": seconds, "returned": n}
            print(f"GET max_points=1000 of {total:,} points: {seconds * 1e3:.0f} ms (median of 5), {n} points",
                  flush=True)
    finally:
        api.close()
    return result


def write_markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_kind = {r["kind"]: r for r in results}
    kinds = [r["kind"] for r in results]
    lines = [
        "## Metric ingest over HTTP",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/metric_ingest.py', *sys.argv[1:]])}` — "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores "
        f"(shared with other work: load average {args.load:.1f} at the start), one `yatt api` "
        "process (1 uvicorn worker), one client posting "
        f"one batch at a time, {args.points:,} points per case over {len(KEYS)} keys.",
        "",
        "| batch | " + " | ".join(f"{k} points/s" for k in kinds) + " |",
        "|---:|" + "---:|" * len(kinds),
    ]
    for i, batch in enumerate(args.batch_sizes):
        cells = [f"{by_kind[k]['batches'][i]['rate']:,.0f} ({by_kind[k]['batches'][i]['p50_ms']:.0f} ms/request)" for k in kinds]
        lines.append(f"| {batch:,} | " + " | ".join(cells) + " |")
    reads = [(k, by_kind[k]["read"]) for k in kinds if "read" in by_kind[k]]
    if reads:
        lines += ["", "Reading one series of "
                  f"{reads[0][1]['points']:,} points back with `max_points=1000` (median of 5): "
                  + ", ".join(f"{k} {r['seconds'] * 1e3:.0f} ms ({r['returned']} points)" for k, r in reads) + "."]
    lines += ["", "Target: ≥ 15,000 points/s on SQLite (an MLflow tracking server manages about "
              "5,000 here with batches of 1,000)."]
    return "\n".join(lines) + "\n"


def update_doc(section: str) -> None:
    write_section("metric_ingest", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=100_000, help="points per case")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1_000, 5_000, 10_000])
    parser.add_argument("--million", type=int, default=1_000_000, help="points for the read-back case (0: skip)")
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = parser.parse_args()
    args.load = os.getloadavg()[0]

    results = []
    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as tmp:
        for kind in args.databases:
            data_dir = Path(tmp) / kind
            data_dir.mkdir()
            with fresh_database(kind, data_dir / "yatt.db") as url:
                results.append(bench_database(kind, url, data_dir, args))
    section = write_markdown(results, args)
    print("\n" + section)
    if not args.no_write:
        update_doc(section)
        print("written to docs/benchmarks.md")


if __name__ == "__main__":
    main()
