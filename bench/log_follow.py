"""What `GET /runs/{id}/logs?follow=true` fetches from Ray per second of follow (issue #10).

    .venv/bin/python bench/log_follow.py [--seconds 20] [--preamble-kb 500]

Starts a local Ray head and one job that first prints `--preamble-kb` of log, then one 100-byte
line every 0.1 s (about 1 kB/s). The job's log is followed for `--seconds` three ways, counting
the characters that come from Ray (log reads plus WebSocket messages):

1. `tail_logs` as it was (permessage-deflate offered): does Ray 2.60's dashboard carry anything?
2. polling, what follow did when that WebSocket was dropped: the whole log re-read every second;
3. follow now: one read, then one WebSocket that carries what is appended and ends with the job.

Prints one line per way (what was fetched in the first 3 s, mostly the log so far, then
characters fetched from Ray per second of follow) and writes the `log_follow` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import websockets
from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.dispatch.local_ray import start_head, stop_head  # noqa: E402
from backend.dispatch.ray_cluster import RayCluster, RayUnavailable, ray_auth_token  # noqa: E402
from backend.dispatch.routes import LogSnapshot, follow_log  # noqa: E402
from backend.settings import Settings  # noqa: E402
from tests.stack import free_port  # noqa: E402

START_S = 3.0  # the first read and the tail's replay of the log so far fall in here

PRINTER = (
    "import sys, time\n"
    "sys.stdout.write(('x' * 99 + '\\n') * ({kb} * 10)); sys.stdout.flush()\n"
    "t0 = time.monotonic()\n"
    "i = 0\n"
    "while time.monotonic() - t0 < {seconds}:\n"
    "    print(f'line {{i:06d}} ' + 'y' * 87, flush=True); i += 1\n"
    "    time.sleep(0.1)\n"
)


def submit(cluster: RayCluster, *, kb: int, seconds: float) -> str:
    (script := Path(tempfile.gettempdir()) / f"yatt-bench-printer-{uuid.uuid4().hex[:8]}.py").write_text(
        PRINTER.format(kb=kb, seconds=seconds)
    )
    sid = cluster.submit(submission_id=f"yatt-bench-{uuid.uuid4().hex[:8]}",
                         entrypoint=f"{sys.executable} {script}", env_vars={})
    while "line 000001" not in cluster.logs(sid):
        time.sleep(0.2)
    return sid


async def deflate_tail(cluster: RayCluster, sid: str, seconds: float) -> tuple[int, str]:
    """Characters the old client (compression offered, websockets' default) received, and how it ended."""
    url = "ws" + cluster.address.removeprefix("http") + f"/api/jobs/{sid}/logs/tail"
    got = 0
    try:
        async with asyncio.timeout(seconds):
            token = ray_auth_token()
            headers = {"Authorization": f"Bearer {token}"} if token else None
            async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
                async for message in ws:
                    got += len(message)
        return got, "closed by Ray"
    except TimeoutError:
        return got, "still open at the end"
    except websockets.WebSocketException as exc:
        return got, f"broke: {exc}"


def follow(cluster: RayCluster, sid: str, *, live: bool, seconds: float) -> tuple[list[tuple[float, int]], int]:
    """(seconds since the start, characters) of each fetch from Ray, and characters sent."""
    fetches: list[tuple[float, int]] = []
    sent = 0
    t0 = time.monotonic()

    async def read() -> LogSnapshot:
        job = cluster.job(sid)
        assert job is not None
        text = cluster.logs(sid)
        fetches.append((time.monotonic() - t0, len(text)))
        return LogSnapshot(text, not job.terminal, "running", sid, ended=job.terminal)

    async def tail(submission_id: str) -> AsyncIterator[str]:
        async for chunk in cluster.tail_logs(submission_id):
            fetches.append((time.monotonic() - t0, len(chunk)))
            yield chunk

    async def run() -> None:
        nonlocal sent
        first = await read()
        stream = follow_log(read, first=first, tail=10, live_tail=tail if live else None)
        try:
            async with asyncio.timeout(seconds):
                async for chunk in stream:
                    sent += len(chunk)
        except TimeoutError:
            pass  # asyncio.run closes the stream, and with it the WebSocket

    asyncio.run(run())
    return fetches, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--preamble-kb", type=int, default=500)
    args = parser.parse_args()
    load = Path("/proc/loadavg").read_text().split()[0]
    root = Path(tempfile.mkdtemp(prefix="yatt-bench-logs-"))
    head = start_head(Settings(data_dir=root, database_url="sqlite://"), port=free_port(),
                      dashboard_port=free_port(), devices=1, log_path=root / "ray-head.log", timeout_s=300)
    try:
        with RayCluster(head.dashboard_url) as cluster:
            job_s = 3 * args.seconds + 30
            sid = submit(cluster, kb=args.preamble_kb, seconds=job_s)
            got, how = asyncio.run(deflate_tail(cluster, sid, 5.0))
            print(f"old tail (permessage-deflate offered): {got} chars in 5 s, {how}")
            rows = []
            for name, live in (("polling (before)", False), ("live tail (now)", True)):
                fetches, sent = follow(cluster, sid, live=live, seconds=args.seconds)
                start = sum(n for t, n in fetches if t < START_S)
                steady = sum(n for t, n in fetches if t >= START_S) / (args.seconds - START_S)
                size = len(cluster.logs(sid))
                print(f"{name:16s}: first {START_S:.0f} s {start:>9,} chars fetched; then {steady:>9,.0f} "
                      f"chars/s fetched from Ray in {len(fetches):,} reads/messages; {sent:,} chars sent "
                      f"in {args.seconds:.0f} s; log {size:,} chars")
                rows.append(f"| {name} | {start:,} | {steady:,.0f} | {len(fetches):,} | {sent:,} | {size:,} |\n")
            try:
                cluster.stop(sid)
            except RayUnavailable:
                pass
    finally:
        stop_head(head)
    write_section("log_follow", (
        "## Log follow: what is fetched from Ray (`bench/log_follow.py`, issue 10)\n\n"
        f"One Ray job prints {args.preamble_kb} kB, then about 1,000 chars/s; its log is followed for "
        f"{args.seconds:.0f} s (`tail=10`) by polling (what follow did while Ray 2.60 dropped the tail "
        "WebSocket) and by the live tail. The tail as it was (permessage-deflate offered) carried "
        f"{got} chars in 5 s ({how}). Load average {load} at the start (shared 2-core machine).\n\n"
        f"| follow | chars fetched, first {START_S:.0f} s | chars/s fetched after | reads / messages "
        "| chars sent | log at the end |\n|---|---|---|---|---|---|\n" + "".join(rows)
    ))


if __name__ == "__main__":
    main()
