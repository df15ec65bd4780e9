"""Following a running job's log against a real Ray head: `RayCluster.tail_logs` (Ray's Jobs
API WebSocket) carries the whole log and then what is appended and ends with the job, and
`follow_log` and `GET /runs/{id}/logs?follow=true` send the tail and then each new line once,
without reading the whole log again.

Ray 2.60's dashboard dropped the tail WebSocket of a client that offers permessage-deflate (its
proxy forwards the offer, the JobHead process compresses, the proxy's own aiohttp client cannot
read that: "Unknown msg type: 258"); `tail_logs` does not offer it."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.dispatch.local_ray import LocalHead, stop_head
from backend.dispatch.ray_cluster import JobNotFound, RayCluster
from backend.dispatch.routes import LogSnapshot, follow_log, tail_lines
from backend.settings import Settings
from tests.stack import start_test_head

pytestmark = pytest.mark.slow

PRINTER = (
    "import time\n"
    "for i in range(12):\n"
    "    print(f'line {i}', flush=True)\n"
    "    time.sleep(0.5)\n"
)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHead]:
    root = tmp_path_factory.mktemp("ray")
    settings = Settings(data_dir=root, database_url="sqlite://")
    started = start_test_head(settings, devices=1, log_path=root / "ray-head.log", timeout_s=300)
    try:
        yield started
    finally:
        stop_head(started)


def submit_printer(cluster: RayCluster) -> str:
    (script := Path(f"/tmp/yatt-printer-{uuid.uuid4().hex[:8]}.py")).write_text(PRINTER)
    return cluster.submit(submission_id=f"yatt-test-{uuid.uuid4().hex[:8]}",
                          entrypoint=f"{sys.executable} {script}", env_vars={})


def wait_for_text(cluster: RayCluster, sid: str, text: str, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (log := cluster.logs(sid)):
        assert time.monotonic() < deadline, log
        time.sleep(0.2)
    return log


def test_tail_logs_carries_the_whole_log_then_what_is_appended_and_ends_with_the_job(head: LocalHead) -> None:
    with RayCluster(head.dashboard_url) as cluster:
        sid = submit_printer(cluster)
        wait_for_text(cluster, sid, "line 1\n")

        async def collect() -> list[str]:
            return [chunk async for chunk in cluster.tail_logs(sid)]

        chunks = asyncio.run(collect())
        # the tail ended because the job did, and carried its whole log
        assert (job := cluster.job(sid)) is not None and job.terminal
        assert [f"line {i}" for i in range(12)] == [x for x in "".join(chunks).splitlines() if x.startswith("line")]
        assert "".join(chunks) == cluster.logs(sid)
        assert len(chunks) > 2  # pieces came as they were printed, not in one read at the end

        async def missing() -> None:
            async for _ in cluster.tail_logs("yatt-no-such-job"):
                pass

        with pytest.raises(JobNotFound):
            asyncio.run(missing())


def test_follow_sends_the_tail_then_each_new_line_once(head: LocalHead) -> None:
    with RayCluster(head.dashboard_url) as cluster:
        sid = submit_printer(cluster)
        first_text = wait_for_text(cluster, sid, "line 2\n")
        reads = 0

        async def read() -> LogSnapshot:
            nonlocal reads
            reads += 1
            job = cluster.job(sid)
            assert job is not None
            return LogSnapshot(cluster.logs(sid), not job.terminal, "succeeded" if job.terminal else "running", sid)

        first = LogSnapshot(first_text, True, "running", sid)

        async def follow() -> list[str]:
            return [c async for c in follow_log(read, first=first, tail=1, live_tail=cluster.tail_logs)]

        sent = asyncio.run(follow())
        whole = cluster.logs(sid)
        assert sent[0] == tail_lines(first_text, 1)
        assert "".join(sent[1:]) == whole[len(first_text):]  # every later character once, in order
        assert "line 11\n" in whole
        assert reads == 0  # the live tail carried the rest and ended with the job: no re-read


def test_follow_over_http_sends_the_tail_then_new_lines_and_ends_with_the_job(
    head: LocalHead, tmp_path: Path
) -> None:
    from backend.client import YattClient
    from backend.runs import lifecycle
    from backend.runs.models import Run
    from tests.conftest import start_api

    server = start_api(f"sqlite:///{tmp_path / 'yatt.db'}", tmp_path, ray_address=head.dashboard_url)
    try:
        token = server.make_token("logs")
        run = YattClient(server.url, token, retries=0).create_run(
            experiment="follow", config={"train": {"max_steps": 5, "batch_size": 4}, "placement": {"devices": 1}}
        )
        with RayCluster(head.dashboard_url) as cluster:
            sid = submit_printer(cluster)
            with server.database.session() as s:  # as the dispatcher records it
                lifecycle.transition(db_session=s, run_id=run["id"], to_state="starting")
                lifecycle.set_attempt_submission(db_session=s, run_id=run["id"], attempt=1, submission_id=sid)
                lifecycle.transition(db_session=s, run_id=run["id"], to_state="running")
                s.commit()
            wait_for_text(cluster, sid, "line 2\n")
            with httpx.Client(base_url=server.url + "/api/v1", headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx.Timeout(30, read=60)) as http:
                with http.stream("GET", f"/runs/{run['id']}/logs", params={"follow": True, "tail": 1}) as r:
                    assert r.status_code == 200
                    chunks = list(r.iter_text())
            whole = cluster.logs(sid)
        text = "".join(chunks)
        # the last line of the log as the request found it, then every later character once, in order
        numbers = [int(line.removeprefix("line ")) for line in text.splitlines()]
        assert whole.endswith(text) and numbers == list(range(numbers[0], 12)) and 2 <= numbers[0] < 11
        with server.database.read_session() as s:  # the stream ended with the Ray job, not the run row
            assert (row := s.get(Run, run["id"])) is not None and row.state == "running"
    finally:
        server.stop()
