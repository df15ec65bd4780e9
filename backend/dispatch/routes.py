"""`GET /runs/{id}/logs` (stored or live, optionally followed) and `GET /cluster`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from backend.db import Database
from backend.deps import DatabaseDep, DetachedReadableRun, Reader, ReadSessionDep, SettingsDep
from backend.dispatch import service
from backend.dispatch.models import RunLog
from backend.dispatch.ray_cluster import RayCluster, RayUnavailable
from backend.runs import lifecycle
from backend.runs.models import Run, RunAttempt
from backend.runs.state import TERMINAL, RunState
from backend.settings import Settings

router = APIRouter(tags=["dispatch"])


def _cluster_or_none(settings: Settings) -> RayCluster | None:
    try:
        return RayCluster.from_settings(settings)
    except RayUnavailable:
        return None


@dataclass
class LogSnapshot:
    """One read of an attempt's log: its text so far, whether Ray still runs it, the attempt's
    state, the Ray job's submission id while it runs, and whether Ray has seen the job end."""

    text: str
    live: bool
    state: str
    submission_id: str | None = None
    ended: bool = False  # Ray knows the job and it has ended: its log is whole

    @property
    def final(self) -> bool:
        """Nothing will be appended to this attempt's log any more."""
        return self.ended or (not self.live and RunState(self.state) in TERMINAL)


def read_log(db: Database, settings: Settings, run_id: int, attempt: int) -> LogSnapshot:
    """Ray's live copy while the job exists, else the stored copy. The database is read in a
    short session that is closed before Ray is asked (no session waits on the network)."""
    with db.read_session() as s:
        run = s.get(Run, run_id)
        if run is None:
            return LogSnapshot("", False, RunState.cancelled.value)
        row = s.execute(
            select(RunAttempt.submission_id, RunAttempt.state)
            .where(RunAttempt.run_id == run_id, RunAttempt.number == attempt)
        ).first()
        # the attempt's own state: an earlier attempt of a retried run has ended though the run goes on
        sid, state = (row.submission_id, row.state) if row is not None else (None, run.state)
        stored = s.get(RunLog, (run_id, attempt))
        stored_text = stored.text if stored else ""
    if sid:
        cluster = _cluster_or_none(settings)
        if cluster is not None:
            try:
                job = cluster.job(sid)
                if job is not None:
                    return LogSnapshot(cluster.logs(sid), not job.terminal, state, sid, ended=job.terminal)
            except (LookupError, RayUnavailable):
                pass
            finally:
                cluster.close()
    return LogSnapshot(stored_text, False, state)


def tail_lines(text: str, n: int | None) -> str:
    """The last `n` lines of `text` (all of it for None)."""
    if not n:
        return text
    return "".join(text.splitlines(keepends=True)[-n:])


# A Ray job's whole log, then what is appended; returns only once the job has ended and its log
# was read to the end, raises LookupError or RayUnavailable otherwise (RayCluster.tail_logs).
LiveTail = Callable[[str], AsyncIterator[str]]


async def follow_log(
    read: Callable[[], Awaitable[LogSnapshot]], *, first: LogSnapshot, tail: int | None,
    live_tail: LiveTail | None = None, poll_s: float = 1.0, max_poll_s: float = 5.0,
) -> AsyncIterator[str]:
    """The log (its last `tail` lines first, when given), then only what is appended, until
    the attempt has ended. While Ray runs the job, one `live_tail` connection carries what is
    appended and ends the stream when the job ends (the log is not fetched again); before the
    job starts, or when the connection fails, the log is re-read by polls that back off to
    `max_poll_s` while nothing new comes."""
    yield tail_lines(first.text, tail)
    sent = len(first.text)
    snap, wait = first, poll_s
    while not snap.final:
        if snap.live and snap.submission_id and live_tail is not None:
            streamed, carried = 0, False  # Ray's tail starts at the log's first character
            try:
                async for chunk in live_tail(snap.submission_id):
                    if streamed + len(chunk) > sent:
                        yield chunk[max(0, sent - streamed):]
                        sent, carried = streamed + len(chunk), True
                    streamed += len(chunk)
            except (LookupError, RayUnavailable):
                if not carried:
                    # broken from the start (a proxy that drops the WebSocket): poll for the rest
                    live_tail = None
                    await asyncio.sleep(wait)
                # one that broke after carrying something new is opened again after this read
            else:
                return  # the job has ended and its tail carried the log to the end
        else:
            await asyncio.sleep(wait)
        snap = await read()
        if len(snap.text) > sent:
            yield snap.text[sent:]
            sent, wait = len(snap.text), poll_s
        else:
            sent = min(sent, len(snap.text))  # a shorter copy: Ray's is gone, the stored one is read
            wait = min(max_poll_s, wait * 1.5)


async def ray_live_tail(settings: Settings, submission_id: str) -> AsyncIterator[str]:
    """`RayCluster.tail_logs` of the configured cluster (LookupError/RayUnavailable pass through)."""
    cluster = RayCluster.from_settings(settings)
    try:
        async for chunk in cluster.tail_logs(submission_id):
            yield chunk
    finally:
        cluster.close()


@router.get(
    "/runs/{run_id}/logs",
    response_class=PlainTextResponse,
    summary="The trainer's log of one attempt",
    responses={200: {
        "content": {"text/plain": {"example": "step 1 reward=0.41 …\n"}},
        "headers": {"Log-Length": {"description": "Characters in this copy of the log: pass it as "
                                   "`offset` next time to get only what follows.",
                                   "schema": {"type": "integer"}}},
    }},
)
async def run_logs(
    run: DetachedReadableRun,
    db: DatabaseDep,
    settings: SettingsDep,
    attempt: Annotated[int | None, Query(ge=1, description="Default: the current attempt.")] = None,
    follow: Annotated[bool, Query(description="Stream new lines until the attempt ends.")] = False,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Only the last N lines.")] = None,
    offset: Annotated[
        int | None,
        Query(ge=0, le=2**62, description="Only the text after this many characters (a live view's "
              "`Log-Length` from its last read); `tail` then applies to that part."),
    ] = None,
) -> Any:
    """Ray's live copy while the job exists, the stored copy after it ends (Ray forgets logs)."""
    number = attempt or run.attempt
    if number > run.attempt:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"run {run.id} has {run.attempt} attempt(s), not {number}"
        )
    run_id = run.id

    async def read() -> LogSnapshot:
        return await run_in_threadpool(read_log, db, settings, run_id, number)

    first = await read()
    if not follow:
        text = first.text[offset:] if offset is not None and offset <= len(first.text) else first.text
        return PlainTextResponse(tail_lines(text, tail), headers={"Log-Length": str(len(first.text))})
    return StreamingResponse(
        follow_log(read, first=first, tail=tail, live_tail=lambda sid: ray_live_tail(settings, sid)),
        media_type="text/plain",
    )


@router.get("/cluster", summary="Nodes, devices and the runs on them")
def cluster(principal: Reader, db_session: ReadSessionDep, settings: SettingsDep) -> dict[str, Any]:
    """Devices are GPUs, or slices of cores (`yatt_device`) on a CPU-only cluster. The caller's
    project's active runs are listed, and in `assignments` the roles (train / rollout / reward)
    on each of their devices, from each run's newest `placement` event; other projects' appear
    only as `other_projects.devices`, the devices they hold, with no ids, names, roles or counts
    of runs."""
    ray = _cluster_or_none(settings)
    try:
        view = service.cluster_view(s=db_session, cluster=ray)
    finally:
        if ray is not None:
            ray.close()
    queued = lifecycle.queued_runs(db_session=db_session, limit=10_000)
    view["queued"] = sum(1 for r in queued if r.project_id == principal.project_id)
    return project_view(view, project_id=principal.project_id)


def project_view(view: dict[str, Any], *, project_id: int) -> dict[str, Any]:
    """The cluster view as one project may see it: its runs in full, the others' as a device count.
    `assignments` lists the roles on each device of its own runs only (node, device, roles, run)."""
    own = [{k: v for k, v in r.items() if k != "assignments"}
           for r in view.get("runs", []) if r.get("project_id") == project_id]
    assignments = [
        {**a, "run_id": r["id"], "run_name": r.get("name")}
        for r in view.get("runs", []) if r.get("project_id") == project_id
        for a in r.get("assignments") or []
    ]
    others = sum(int(r.get("devices") or 0) for r in view.get("runs", []) if r.get("project_id") != project_id)
    return {**view, "runs": own, "assignments": assignments, "other_projects": {"devices": others}}


def install(app: Any) -> None:
    """Enqueue dispatch tasks after state changes, unless YATT_DISPATCH=false (API-only tests)."""
    if app.state.settings.dispatch:
        from backend.dispatch import install_hooks

        install_hooks()
