"""`GET /runs/{id}/logs` (stored or live, optionally followed) and `GET /cluster`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from backend.db import Database
from backend.deps import DatabaseDep, ReadableRun, Reader, ReadSessionDep, SettingsDep
from backend.dispatch import service
from backend.dispatch.ray_cluster import RayCluster, RayUnavailable
from backend.runs import service as run_service
from backend.runs.models import Run
from backend.runs.state import TERMINAL, RunState
from backend.settings import Settings

router = APIRouter(tags=["dispatch"])


def _cluster_or_none(settings: Settings) -> RayCluster | None:
    try:
        return RayCluster.from_settings(settings)
    except RayUnavailable:
        return None


def _read_log(db: Database, settings: Settings, run_id: int, attempt: int) -> tuple[str, bool, str]:
    cluster = _cluster_or_none(settings)
    try:
        with db.read_session() as s:
            run = s.get(Run, run_id)
            assert run is not None
            text, live = service.attempt_log(s=s, cluster=cluster, run=run, attempt=attempt)
            return text, live, run.state
    finally:
        if cluster is not None:
            cluster.close()


@router.get(
    "/runs/{run_id}/logs",
    response_class=PlainTextResponse,
    summary="The trainer's log of one attempt",
    responses={200: {"content": {"text/plain": {"example": "step 1 reward=0.41 …\n"}}}},
)
async def run_logs(
    run: ReadableRun,
    db: DatabaseDep,
    settings: SettingsDep,
    attempt: Annotated[int | None, Query(ge=1, description="Default: the current attempt.")] = None,
    follow: Annotated[bool, Query(description="Stream new lines until the attempt ends.")] = False,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Only the last N lines.")] = None,
) -> Any:
    """Ray's live copy while the job exists, the stored copy after it ends (Ray forgets logs)."""
    number = attempt or run.attempt
    if number > run.attempt:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"run {run.id} has {run.attempt} attempt(s), not {number}"
        )
    run_id = run.id
    text, live, state = await run_in_threadpool(_read_log, db, settings, run_id, number)
    if tail:
        text = "\n".join(text.splitlines()[-tail:]) + ("\n" if text else "")
    if not follow:
        return PlainTextResponse(text)

    async def stream() -> AsyncIterator[str]:
        sent = text
        yield sent
        current_state, current_live = state, live
        while current_live or RunState(current_state) not in TERMINAL:
            await asyncio.sleep(1.0)
            full, current_live, current_state = await run_in_threadpool(
                _read_log, db, settings, run_id, number
            )
            if len(full) > len(sent) and full.startswith(sent[: max(0, len(sent) - 1)]):
                yield full[len(sent):]
                sent = full
            elif not current_live and RunState(current_state) in TERMINAL:
                break

    return StreamingResponse(stream(), media_type="text/plain")


@router.get("/cluster", summary="Nodes, devices and the runs on them")
def cluster(principal: Reader, db_session: ReadSessionDep, settings: SettingsDep) -> dict[str, Any]:
    """Devices are GPUs, or slices of cores (`yatt_device`) on a CPU-only cluster. The caller's
    project's active runs are listed; other projects' appear only as `other_projects.devices`,
    the devices they hold, with no ids, names or counts of runs."""
    ray = _cluster_or_none(settings)
    try:
        view = service.cluster_view(s=db_session, cluster=ray)
    finally:
        if ray is not None:
            ray.close()
    queued = run_service.queued_runs(db_session=db_session, limit=10_000)
    view["queued"] = sum(1 for r in queued if r.project_id == principal.project_id)
    return project_view(view, project_id=principal.project_id)


def project_view(view: dict[str, Any], *, project_id: int) -> dict[str, Any]:
    """The cluster view as one project may see it: its runs in full, the others' as a device count."""
    own = [r for r in view.get("runs", []) if r.get("project_id") == project_id]
    others = sum(int(r.get("devices") or 0) for r in view.get("runs", []) if r.get("project_id") != project_id)
    return {**view, "runs": own, "other_projects": {"devices": others}}


def install(app: Any) -> None:
    """Enqueue dispatch tasks after state changes, unless YATT_DISPATCH=false (API-only tests)."""
    if app.state.settings.dispatch:
        from backend.dispatch import install_hooks

        install_hooks()
