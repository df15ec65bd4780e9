"""The run history at scale: 100,000 runs listed, filtered, searched, sorted and compared.

    .venv/bin/python bench/history_scale.py            # --before /work/main to time main's code too
    .venv/bin/python bench/history_scale.py --before /work/main --only compare --no-write

For each database (a SQLite file, a fresh PostgreSQL database) it migrates, seeds 100,000 runs
over 1,000 experiments (bench/history_seed.py: tags, summaries, realistic names, configs), starts
the real API (`yatt api`, one uvicorn worker, its own process) and times every request of
issue 12's table, compare-of-10 and the History page's own calls (`--only`: those whose label
holds a word): one warm-up, then `--repeat` timed requests each, one at a time; p50 and p95 per
database. With `--before DIR` the same requests also go to an API started from the code in DIR
(the tree before this change) on the same seeded database, the two APIs taking turns request
by request, so that other work on the machine weighs on both alike.
Prints a table and writes the `history_scale` section of docs/benchmarks.md; the last line is
the worst p95.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import httpx
from databases import fresh_database  # noqa: E402 (bench/databases.py, beside this script)
from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402

from backend.db import Database  # noqa: E402
from backend.migrate import upgrade  # noqa: E402
from backend.runs import search  # noqa: E402
from backend.runs.listing import _encode_cursor  # noqa: E402
from bench.history_seed import Seeded, seed_history  # noqa: E402

TARGET_MS = 100.0
SEARCHES = ("gsm8k grpo kl-sweep", "reward hacking")  # a precise search and a broad one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    """`yatt api` from the code in `tree`, in a subprocess on a free port."""

    def __init__(self, database_url: str, data_dir: Path, token: str, tree: Path = ROOT):
        env = {**os.environ, "YATT_DATABASE_URL": database_url, "YATT_DATA_DIR": str(data_dir),
               "PYTHONPATH": str(tree)}
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "api", "--port", self.url.rsplit(":", 1)[1], "--no-migrate"],
            env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.http = httpx.Client(
            base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=120
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the API did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            time.sleep(0.2)

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path} {params}: {r.status_code} {r.text[:300]}")
        return r.json()

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(timeout=20)


def requests(seeded: Seeded) -> list[tuple[str, Callable[[Api], Any]]]:
    """(label, call) for every timed request."""
    exp = seeded.experiments[len(seeded.experiments) // 2]
    tag = min(seeded.tag_counts, key=lambda t: abs(seeded.tag_counts[t] - len(seeded.run_ids) // 20))
    ten = seeded.series_run_ids[:10]
    # the first page of runs that never reported reward/mean (past every run that did)
    tail = _encode_cursor("-reward/mean", 1, None, seeded.run_ids[-1] + 1)
    out: list[tuple[str, Callable[[Api], Any]]] = [
        ("list (limit=50)", lambda a: a.get("/runs", limit=50)),
        ("filter state=failed", lambda a: a.get("/runs", limit=50, state="failed")),
        ("filter experiment", lambda a: a.get("/runs", limit=50, experiment=exp)),
        (f"filter tag={tag}", lambda a: a.get("/runs", limit=50, tag=tag)),
        *((f"search q={q}", lambda a, q=q: a.get("/runs", limit=50, q=q)) for q in SEARCHES),
        ("sort=-reward/mean", lambda a: a.get("/runs", limit=50, sort="-reward/mean")),
        ("sort=reward/mean (ascending)", lambda a: a.get("/runs", limit=50, sort="reward/mean")),
        ("sort=-reward/mean, page of runs without it", lambda a: a.get("/runs", limit=50, sort="-reward/mean", cursor=tail)),
        ("where=reward/mean>=0.9", lambda a: a.get("/runs", limit=50, where="reward/mean>=0.9")),
        ("compare 10 runs (1 request)", lambda a: a.get(
            "/runs/compare", runs=",".join(map(str, ten)), keys="reward/mean,kl/mean", max_points=800)),
        ("History page: whoami", lambda a: a.get("/whoami")),
        ("History page: experiments", lambda a: a.get("/experiments")),
        ("History page: runs (limit=25)", lambda a: a.get("/runs", limit=25, sort="-created_at")),
    ]
    return out


def time_requests(
    apis: dict[str, Api], calls: list[tuple[str, Callable[[Api], Any]]], repeat: int
) -> dict[str, dict[str, tuple[float, float]]]:
    """{api name: {label: (p50 ms, p95 ms)}}; the APIs take turns, request by request."""
    out: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in apis}
    for label, call in calls:
        times: dict[str, list[float]] = {name: [] for name in apis}
        answers = [call(api) for api in apis.values()]  # warm-up
        if any(a != answers[0] for a in answers):
            print(f"  {label}: the APIs answer differently", flush=True)
        for _ in range(repeat):
            for name, api in apis.items():
                t = time.perf_counter()
                call(api)
                times[name].append((time.perf_counter() - t) * 1e3)
        for name, ts in times.items():
            ts.sort()
            p95 = ts[min(len(ts) - 1, int(round(0.95 * (len(ts) - 1))))]
            out[name][label] = (median(ts), p95)
            print(f"  {name:<7} {label:<46} p50 {median(ts):8.1f} ms   p95 {p95:8.1f} ms", flush=True)
    return out


def bench_database(kind: str, url: str, data_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== {kind}", flush=True)
    upgrade(url)
    db = Database(url)
    t = time.perf_counter()
    seeded = seed_history(db, runs=args.runs, experiments=args.experiments)
    seed_s = time.perf_counter() - t
    with db.read_session() as s:  # a ranked search costs with its matches: say how many
        matches = {
            q: s.scalar(select(func.count()).select_from(search.matches(db.dialect, q).subquery()))
            for q in SEARCHES
        }
    print(f"matches: {matches}", flush=True)
    db.dispose()
    print(f"seeded {args.runs:,} runs over {args.experiments:,} experiments in {seed_s:.1f} s", flush=True)
    result: dict[str, Any] = {"kind": kind, "seed_s": seed_s, "matches": matches}
    calls = [(label, call) for label, call in requests(seeded) if not args.only or any(w in label for w in args.only)]
    apis: dict[str, Api] = {}
    try:
        apis["after"] = Api(url, data_dir, seeded.token)
        if args.before:
            print(f"before: the code in {args.before}", flush=True)
            apis["before"] = Api(url, data_dir, seeded.token, tree=Path(args.before))
        result.update(time_requests(apis, calls, args.repeat))
    finally:
        for api in apis.values():
            api.close()
    return result


def _cell(fig: tuple[float, float] | None) -> str:
    return "—" if fig is None else f"{fig[0]:,.0f} / {fig[1]:,.0f}"


def write_markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str]:
    kinds = [r["kind"] for r in results]
    labels = list(dict.fromkeys(label for r in results for label in r["after"]))
    cols = []
    for k in kinds:
        cols.append(f"{k} p50 / p95 ms")
        if args.before:
            cols.append(f"{k} before p50 / p95 ms")
    lines = [
        "## History at scale (100,000 runs)",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/history_scale.py', *sys.argv[1:]])}` — "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores "
        f"(shared with other work: load average {args.load:.1f} at the start, {args.load_end:.1f} at the end), "
        f"{args.runs:,} runs over {args.experiments:,} experiments in one project, one `yatt api` process "
        f"(1 uvicorn worker), one request at a time, {args.repeat} timed requests each after a warm-up. "
        + ("`before` is the same database served by the code before this change (" + args.before
           + "), the two APIs taking turns request by request. " if args.before else "")
        + "Seeding took " + ", ".join(f"{r['kind']} {r['seed_s']:.0f} s" for r in results) + ".",
        "",
        "| request | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for label in labels:
        cells = []
        for r in results:
            cells.append(_cell(r["after"].get(label)))
            if args.before:
                cells.append(_cell(r.get("before", {}).get(label)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    worst_label, worst = "", (0.0, 0.0)
    for r in results:
        for label, fig in r["after"].items():
            if fig[1] > worst[1]:
                worst_label, worst = f"{r['kind']}: {label}", fig
    last = f"worst p95: {worst[1]:.0f} ms ({worst_label}); target < {TARGET_MS:.0f} ms"
    if args.before:
        ratios = []
        for r in results:
            for label in ("search q=gsm8k grpo kl-sweep", "sort=-reward/mean", "compare 10 runs (1 request)"):
                b, a = r.get("before", {}).get(label), r["after"].get(label)
                if a and b:
                    ratios.append(f"{r['kind']} {label}: {b[0] / a[0]:.1f}× faster at p50")
        if ratios:
            lines += ["", "Before → after: " + "; ".join(ratios) + "."]
    lines += ["", "Searches are ranked, so their cost grows with the runs they match: "
              + "; ".join(f"{r['kind']} " + ", ".join(f"`{q}` {n:,}" for q, n in r["matches"].items())
                          for r in results) + " matching runs."]
    lines += ["", last]
    return "\n".join(lines) + "\n", last


def update_doc(section: str) -> None:
    write_section("history_scale", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--experiments", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=15, help="timed requests per case")
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--before", default="", help="a tree with the code to compare against (e.g. /work/main)")
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--only", nargs="+", default=[], help="time only requests whose label holds one of these")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below when killed
    args.load = os.getloadavg()[0]
    print(f"load average at start: {args.load:.1f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="yatt-history-") as tmp:
        for kind in args.databases:
            data_dir = Path(tmp) / kind
            data_dir.mkdir()
            with fresh_database(kind, data_dir / "yatt.db", prefix="yatt_hist") as url:
                results.append(bench_database(kind, url, data_dir, args))
    args.load_end = os.getloadavg()[0]
    section, last = write_markdown(results, args)
    print("\n" + section)
    if not args.no_write:
        update_doc(section)
    print(last)


if __name__ == "__main__":
    main()
