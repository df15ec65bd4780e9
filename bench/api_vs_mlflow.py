"""yatt's metric API against an MLflow tracking server, side by side, on the same SQL backend.

    .venv/bin/pip install -e '.[bench]' && .venv/bin/python bench/api_vs_mlflow.py

For each backend (SQLite, then PostgreSQL) both servers run on this machine as their own
processes (`yatt api`, one uvicorn worker; `mlflow server`, one worker), each on a fresh
database of that kind, and one client measures, alternating between them:

1. ingest over HTTP: the same points (5 keys) in batches of 1,000 and of yatt's batch limit
   (10,000). yatt gets `POST /runs/{id}/metrics` with the run's token and a batch id (idempotent
   ingest on); MLflow gets `runs/log-batch`, which takes at most 1,000 metrics per request, so
   a 10,000 batch is 10 requests there. Bodies are encoded before the clock starts.
2. a downsampled read of one 1,000,000-point series: yatt `GET /runs/{id}/metrics?max_points=500`,
   MLflow `metrics/get-history-bulk-interval?max_results=500` (what its UI's charts call);
   p50/p95 of 20 reads each. The series is seeded below HTTP, to save minutes: through yatt's
   ingest service for yatt, with one bulk INSERT into MLflow's `metrics`/`latest_metrics` tables.

Prints a table, writes the `api_vs_mlflow` section of docs/benchmarks.md, and ends with
`ratio: X` — yatt's ingest rate over MLflow's at batch 1,000, the lower of the two backends.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median
from typing import Any

import httpx
from databases import fresh_database  # noqa: E402 (bench/databases.py, beside this script)
from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)
from metric_ingest import Api, bodies, free_port, ingest  # same folder

KEYS = ["reward/mean", "loss/policy", "kl/mean", "throughput/tokens_per_s", "time/rollout"]
SERIES_KEY = "loss/series"


class MlflowServer:
    """`mlflow server` in a subprocess on a free port, one experiment and run to log into."""

    def __init__(self, backend_uri: str, data_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend_uri = backend_uri
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
             "--default-artifact-root", (data_dir / "artifacts").as_uri(), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            cwd=data_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.http = httpx.Client(base_url=self.url, timeout=300)
        deadline = time.monotonic() + 180
        while True:
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"mlflow did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            time.sleep(0.5)
        r = self.http.post("/api/2.0/mlflow/experiments/create", json={"name": f"bench-{uuid.uuid4().hex[:6]}"})
        r.raise_for_status()
        self.experiment_id = r.json()["experiment_id"]

    def new_run(self) -> str:
        r = self.http.post("/api/2.0/mlflow/runs/create", json={"experiment_id": self.experiment_id})
        r.raise_for_status()
        return str(r.json()["run"]["info"]["run_id"])

    def close(self) -> None:
        self.http.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its workers can take long to stop on a busy machine
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def mlflow_bodies(total: int, batch: int, keys: list[str]) -> list[list[dict[str, Any]]]:
    """The same points as `bodies`, as MLflow metrics; one inner list per 1,000-metric request."""
    out, t0, step = [], int(time.time() * 1000), 0
    for start in range(0, total, batch):
        metrics = []
        for i in range(start, min(total, start + batch)):
            if i % len(keys) == 0:
                step += 1
            metrics.append({"key": keys[i % len(keys)], "value": (i % 1000) / 1000.0,
                            "timestamp": t0 + i, "step": step})
        out += [metrics[j : j + 1000] for j in range(0, len(metrics), 1000)]
    return out


def mlflow_ingest(server: MlflowServer, run_id: str, requests: list[list[dict[str, Any]]]) -> float:
    start = time.perf_counter()
    for metrics in requests:
        r = server.http.post("/api/2.0/mlflow/runs/log-batch", json={"run_id": run_id, "metrics": metrics})
        if r.status_code != 200:
            raise RuntimeError(f"mlflow log-batch: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - start


def series_values(n: int) -> list[float]:
    return [0.5 + 0.1 * math.sin(s / 5000) + (50.0 if s == n * 3 // 5 else 0.0) for s in range(n)]


def seed_yatt(api: Api, run_id: int, n: int) -> None:
    """The series through yatt's own ingest service (blocks and summaries included)."""
    from backend.db import Database
    from backend.metrics.schemas import MetricPointIn
    from backend.metrics.service import ingest as ingest_points

    values, db = series_values(n), Database(api.database_url)
    try:
        for start in range(0, n, 100_000):
            points = [MetricPointIn.model_construct(key=SERIES_KEY, step=s, value=values[s], time=1.0e9 + s)
                      for s in range(start, min(n, start + 100_000))]
            with db.session() as s:
                ingest_points(db_session=s, run_id=run_id, points=points)
    finally:
        db.dispose()


def seed_mlflow(server: MlflowServer, run_id: str, n: int) -> None:
    """The series straight into MLflow's tables (what log-batch would leave there)."""
    from sqlalchemy import create_engine, text

    values = series_values(n)
    engine = create_engine(server.backend_uri)
    try:
        with engine.begin() as conn:
            rows = [{"k": SERIES_KEY, "v": values[s], "t": 1_000_000_000_000 + s, "r": run_id, "s": s}
                    for s in range(n)]
            conn.execute(text("INSERT INTO metrics (key, value, timestamp, run_uuid, step, is_nan) "
                              "VALUES (:k, :v, :t, :r, :s, false)"), rows)
            conn.execute(text("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                              "VALUES (:k, :v, :t, :s, false, :r)"), rows[-1])
    finally:
        engine.dispose()


def timed_reads(get: Any, repeat: int) -> tuple[float, float, int]:
    times, n = [], 0
    for _ in range(repeat):
        t = time.perf_counter()
        n = get()
        times.append(time.perf_counter() - t)
    times.sort()
    return median(times), times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)], n


def bench_backend(kind: str, yatt_url: str, mlflow_uri: str, data_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== {kind}", flush=True)
    (data_dir / "yatt").mkdir()
    (data_dir / "mlflow").mkdir()
    api = Api(yatt_url, data_dir / "yatt")
    server = MlflowServer(mlflow_uri, data_dir / "mlflow")
    out: dict[str, Any] = {"kind": kind, "ingest": [], "read": {}}
    try:
        for batch in args.batch_sizes:
            payloads, requests = bodies(args.points, batch, KEYS), mlflow_bodies(args.points, batch, KEYS)
            ingest(api, api.new_run(), payloads[:1])  # warm-up, not counted
            mlflow_ingest(server, server.new_run(), requests[:1])
            y_s, _ = ingest(api, api.new_run(), payloads)
            m_s = mlflow_ingest(server, server.new_run(), requests)
            row = {"batch": batch, "yatt": args.points / y_s, "mlflow": args.points / m_s}
            out["ingest"].append(row)
            print(f"batch {batch:>6}: yatt {row['yatt']:>9,.0f} points/s, mlflow {row['mlflow']:>8,.0f} "
                  f"points/s, ratio {row['yatt'] / row['mlflow']:.1f}", flush=True)
        n = args.series_points
        y_run, m_run = api.new_run(), server.new_run()
        t = time.perf_counter()
        seed_yatt(api, y_run, n)
        seed_mlflow(server, m_run, n)
        print(f"seeded {n:,} points in each ({time.perf_counter() - t:.0f} s)", flush=True)

        def yatt_read() -> int:
            r = api.trainers[y_run].get(f"/runs/{y_run}/metrics",
                                        params={"keys": SERIES_KEY, "max_points": args.max_points})
            r.raise_for_status()
            return len(r.json()["series"][SERIES_KEY])

        def mlflow_read() -> int:
            r = server.http.get("/ajax-api/2.0/mlflow/metrics/get-history-bulk-interval",
                                params={"run_ids": m_run, "metric_key": SERIES_KEY, "max_results": args.max_points})
            r.raise_for_status()
            return len(r.json().get("metrics", []))

        yatt_read(), mlflow_read()  # warm-up
        out["read"] = {"points": n, "yatt": timed_reads(yatt_read, args.reads),
                       "mlflow": timed_reads(mlflow_read, args.reads)}
        for who in ("yatt", "mlflow"):
            p50, p95, got = out["read"][who]
            print(f"read {n:,} → {args.max_points}: {who} p50 {p50 * 1e3:.0f} ms, p95 {p95 * 1e3:.0f} ms "
                  f"({got} points)", flush=True)
    finally:
        api.close()
        server.close()
    return out


def write_markdown(results: list[dict[str, Any]], args: argparse.Namespace, ratio: float) -> str:
    import mlflow

    lines = [
        "## yatt vs MLflow: ingest and downsampled reads over HTTP",
        "",
        f"`.venv/bin/python bench/api_vs_mlflow.py {' '.join(sys.argv[1:])}`".replace(" `", "`") + " — "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores shared "
        f"with other work (load average {args.load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end); "
        f"MLflow {mlflow.__version__} (`mlflow server`, 1 worker) and `yatt api` (1 uvicorn worker), "
        "same machine, same SQL backend, one client alternating between them.",
        "",
        "| backend | batch | yatt points/s | MLflow points/s | yatt / MLflow |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for row in r["ingest"]:
            lines.append(f"| {r['kind']} | {row['batch']:,} | {row['yatt']:,.0f} | {row['mlflow']:,.0f} | "
                         f"{row['yatt'] / row['mlflow']:.1f}× |")
    lines += ["", f"Downsampled read of one {args.series_points:,}-point series to {args.max_points} points "
              f"({args.reads} reads each; yatt keeps per-bucket min/max, MLflow samples steps):", "",
              "| backend | yatt p50 / p95 | MLflow p50 / p95 |", "|---|---:|---:|"]
    for r in results:
        y, m = r["read"]["yatt"], r["read"]["mlflow"]
        lines.append(f"| {r['kind']} | {y[0] * 1e3:.0f} / {y[1] * 1e3:.0f} ms | {m[0] * 1e3:.0f} / {m[1] * 1e3:.0f} ms |")
    lines += ["", f"ratio: {ratio:.1f} (yatt's ingest rate over MLflow's at batch 1,000, the lower of the "
              "backends; goal ≥ 3, with idempotent ingest on)."]
    return "\n".join(lines) + "\n"


def update_doc(section: str) -> None:
    write_section("api_vs_mlflow", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=100_000, help="points per ingest case")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--series-points", type=int, default=1_000_000)
    parser.add_argument("--max-points", type=int, default=500)
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = parser.parse_args()
    args.load = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="yatt-vs-mlflow-") as tmp:
        for kind in args.databases:
            data_dir = Path(tmp) / kind
            data_dir.mkdir()
            with fresh_database(kind, data_dir / "yatt.db", prefix="yatt_vs") as yatt_url, \
                    fresh_database(kind, data_dir / "mlflow.db", prefix="mlflow_vs") as mlflow_url:
                results.append(bench_backend(kind, yatt_url, mlflow_url, data_dir, args))
    ratio = min(r["ingest"][0]["yatt"] / r["ingest"][0]["mlflow"] for r in results)
    section = write_markdown(results, args, ratio)
    print("\n" + section)
    if not args.no_write:
        update_doc(section)
        print("written to docs/benchmarks.md")
    print(f"ratio: {ratio:.1f}")


if __name__ == "__main__":
    main()
