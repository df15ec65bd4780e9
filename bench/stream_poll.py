"""One live-stream poll with and without the (run_id, id) index, SQLite and PostgreSQL side by side.

    .venv/bin/python bench/stream_poll.py            # --points 500000 by default

For each database: two fresh, migrated databases hold the same run of N points (50 keys, one
background run of N/4 points interleaved, as a second training run would). One keeps
`ix_metric_points_run_id_id` (migration 0004), the other has it dropped. Then it
times the query a stream poll makes (`backend/runs/stream.py`), the run's points after a floor
in id order, one page: `live` (the floor 500 points behind the newest, a client keeping up)
and `history` (floor 0, the first page a new stream sends). Median of 30, alternating between
the two databases so load on the machine hits both alike. Prints a table and the ratio, and
writes the `stream_poll` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

from databases import fresh_database  # noqa: E402 (bench/databases.py, beside this script)
from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.db import Database  # noqa: E402
from backend.migrate import upgrade  # noqa: E402
from backend.runs.stream import PAGE, point_rows_after  # noqa: E402


def seed(db: Database, points: int) -> int:
    """A project, an experiment, two runs; `points` points for the first, a quarter as many
    for the second, interleaved. Returns the first run's id."""
    with db.engine.begin() as c:
        pid = c.exec_driver_sql(
            "INSERT INTO projects (name, description, created_at) VALUES ('bench', '', CURRENT_TIMESTAMP) RETURNING id"
        ).scalar()
        eid = c.exec_driver_sql(
            f"INSERT INTO experiments (project_id, name, description, tags, created_at) "
            f"VALUES ({pid}, 'e', '', '[]', CURRENT_TIMESTAMP) RETURNING id"
        ).scalar()
        runs = [
            c.exec_driver_sql(
                "INSERT INTO runs (project_id, experiment_id, name, description, config, seed, state, "
                "attempt, max_attempts, priority, launched_by, launched_by_name, created_at, updated_at) "
                f"VALUES ({pid}, {eid}, 'r{i}', '', '{{}}', 0, 'running', 1, 1, 0, 'user', '', "
                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP) RETURNING id"
            ).scalar()
            for i in range(2)
        ]
    batch: list[tuple[int, str, int, float, float]] = []
    with db.engine.begin() as c:
        for i in range(points + points // 4):
            run = runs[1] if i % 5 == 4 else runs[0]
            batch.append((run, f"k{i % 50}", i // 50, 1.0, 1.0))
            if len(batch) == 10_000:
                c.exec_driver_sql(_INSERT[c.dialect.name], batch)
                batch = []
        if batch:
            c.exec_driver_sql(_INSERT[c.dialect.name], batch)
    return int(runs[0])


_INSERT = {
    "sqlite": "INSERT INTO metric_points (run_id, key, step, value, time) VALUES (?, ?, ?, ?, ?)",
    "postgresql": "INSERT INTO metric_points (run_id, key, step, value, time) VALUES (%s, %s, %s, %s, %s)",
}


def poll_seconds(db: Database, run_id: int, floor: int) -> tuple[float, int]:
    """Seconds for one poll's read (the stream's own query), and the rows it returned."""
    t0 = time.perf_counter()
    with db.read_session() as s:
        rows = point_rows_after(s, run_id, floor)
    return time.perf_counter() - t0, len(rows)


def bench_kind(kind: str, tmp: Path, points: int, repeat: int) -> dict[str, float]:
    with ExitStack() as stack:
        dbs = {label: Database(stack.enter_context(fresh_database(kind, tmp / f"{kind}-{label.split()[0]}.db")))
               for label in ("with index", "without")}
        stack.callback(lambda: [db.dispose() for db in dbs.values()])  # runs before the drops
        floors: dict[str, tuple[int, int]] = {}  # label -> (run id, live floor)
        for label, db in dbs.items():
            upgrade(db.url)
            run_id = seed(db, points)
            with db.engine.begin() as c:
                if label == "without":
                    c.exec_driver_sql("DROP INDEX ix_metric_points_run_id_id")
                if kind == "postgresql":
                    c.exec_driver_sql("ANALYZE metric_points")
                newest = c.exec_driver_sql(
                    f"SELECT id FROM metric_points WHERE run_id = {run_id} ORDER BY id DESC LIMIT 1 OFFSET 500"
                ).scalar()
            floors[label] = (run_id, int(newest))
        times: dict[str, list[float]] = {f"{case} {label}": [] for case in ("live", "history") for label in dbs}
        for _ in range(repeat):  # alternate, so both see the same load
            for label, db in dbs.items():
                run_id, floor = floors[label]
                seconds, rows = poll_seconds(db, run_id, floor)
                assert rows == 500, rows
                times[f"live {label}"].append(seconds)
                seconds, rows = poll_seconds(db, run_id, 0)
                assert rows == PAGE, rows
                times[f"history {label}"].append(seconds)
        return {label: median(ts) for label, ts in times.items()}


def update_doc(section: str) -> None:
    write_section("stream_poll", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=500_000, help="points of the streamed run")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as tmp:
        for kind in args.databases:
            result = bench_kind(kind, Path(tmp), args.points, args.repeat)
            for case in ("live", "history"):
                with_, without = result[f"{case} with index"], result[f"{case} without"]
                ratio = without / with_
                rows.append(f"| {kind} | {case} | {args.points:,} | {with_ * 1e3:.1f} | "
                            f"{without * 1e3:.1f} | {ratio:.1f}x |")
                print(f"{kind} {case}: poll with index {with_ * 1e3:.1f} ms, "
                      f"without {without * 1e3:.1f} ms, ratio: {ratio:.1f}")
    section = (
        "## Live stream poll (`bench/stream_poll.py`)\n\n"
        "One poll of `GET /runs/{id}/stream`: `live` reads the run's 500 newest points after its "
        f"floor, `history` the first page ({PAGE:,} points) of a new stream; median of "
        f"{args.repeat}, with and without `ix_metric_points_run_id_id`, measured alternately in one run "
        f"(load average {load:.1f} on this shared 2-core machine when it started).\n\n"
        "| database | poll | points in the run | with index (ms) | without (ms) | ratio |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print("\n" + section)
    if not args.no_write:
        update_doc(section)
        print("written to docs/benchmarks.md")


if __name__ == "__main__":
    main()
