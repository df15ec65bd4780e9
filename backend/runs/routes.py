"""HTTP routes for experiments, runs, their state, events, checkpoints and live stream. Thin:
each route checks who may call it and hands over to `backend.runs.service`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from backend.auth.models import Role
from backend.db import Database
from backend.deps import (
    CurrentPrincipal,
    DatabaseDep,
    ReadableRun,
    Reader,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    WritableRun,
    Writer,
    not_found,
)
from backend.metrics import service as metric_service
from backend.runs import service
from backend.runs.schemas import (
    Accepted,
    AttemptOut,
    CheckpointIn,
    CheckpointOut,
    ConfigValid,
    ConfigValidate,
    EventBatch,
    EventOut,
    ExperimentCreate,
    ExperimentOut,
    RunAction,
    RunCreate,
    RunOut,
    RunPage,
    StateUpdate,
)
from backend.runs.state import TERMINAL, RunState
from trainer.config import parse_config
from trainer.placement.memory import check_memory

router = APIRouter()

_CONFIG_422: dict[int | str, dict[str, Any]] = {
    422: {
        "description": "The config (or the body) does not validate; each error names its field path.",
        "content": {
            "application/json": {
                "example": {
                    "detail": [
                        {
                            "loc": ["body", "config", "train", "lr"],
                            "path": "train.lr",
                            "msg": "Input should be greater than 0",
                            "type": "config",
                        }
                    ]
                }
            }
        },
    }
}
_409: dict[int | str, dict[str, Any]] = {409: {"description": "Illegal state move; the message names the run's current state."}}


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


# --- experiments -----------------------------------------------------------------------------


@router.get("/experiments", response_model=list[ExperimentOut], tags=["experiments"])
def list_experiments(principal: Reader, db_session: ReadSessionDep) -> list[ExperimentOut]:
    """The project's experiments with their run counts."""
    return [
        ExperimentOut.model_validate(exp).model_copy(update={"run_count": n})
        for exp, n in service.list_experiments(db_session=db_session, project_id=principal.project_id)
    ]


@router.post(
    "/experiments", response_model=ExperimentOut, status_code=201, tags=["experiments"],
    responses={409: {"description": "An experiment with this name exists."}},
)
def create_experiment(body: ExperimentCreate, principal: Writer, db_session: SessionDep) -> ExperimentOut:
    """Create an experiment (runs also create theirs on first use)."""
    try:
        exp = service.create_experiment(
            db_session=db_session,
            project_id=principal.project_id,
            name=body.name,
            description=body.description,
            tags=body.tags,
        )
        db_session.commit()
    except IntegrityError:
        raise HTTPException(409, f"experiment {body.name!r} already exists") from None
    return ExperimentOut.model_validate(exp)


@router.get("/experiments/{experiment_id}", response_model=ExperimentOut, tags=["experiments"])
def get_experiment(experiment_id: int, principal: Reader, db_session: ReadSessionDep) -> ExperimentOut:
    exp = service.get_experiment(
        db_session=db_session, project_id=principal.project_id, experiment_id=experiment_id
    )
    if exp is None:
        raise HTTPException(404, f"experiment {experiment_id} not found")
    return ExperimentOut.model_validate(exp)


# --- runs --------------------------------------------------------------------------------------


@router.post(
    "/runs", response_model=RunOut, status_code=201, tags=["runs"],
    responses={
        200: {"description": "Replay: a run with this Idempotency-Key exists and is returned."},
        409: {"description": "The Idempotency-Key was used for a different request."},
        **_CONFIG_422,
    },
)
def create_run(
    body: RunCreate,
    principal: Writer,
    db_session: SessionDep,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(max_length=200, description="Retrying with the same key returns the same run."),
    ] = None,
) -> RunOut:
    """Validate the config and queue a run. Creates the experiment if needed."""
    run, created = service.create_run(
        db_session=db_session, principal=principal, run_in=body, idempotency_key=idempotency_key
    )
    db_session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    return RunOut.of(run)


@router.post("/runs/validate", response_model=ConfigValid, tags=["runs"], responses=_CONFIG_422)
def validate_config(body: ConfigValidate, principal: Reader) -> ConfigValid:
    """Check a TrainerConfig (fields, and whether its placement fits in device memory) without
    storing anything; returns it with every default filled in."""
    config = parse_config(body.config)
    check_memory(config)
    return ConfigValid(config=config.model_dump(mode="json"))


@router.get("/runs", response_model=RunPage, tags=["runs"])
def list_runs(
    principal: Reader,
    db_session: ReadSessionDep,
    state: Annotated[str | None, Query(description="Comma-separated states.", examples=["running,queued"])] = None,
    experiment: Annotated[str | None, Query(description="Experiment name.")] = None,
    tag: Annotated[list[str] | None, Query(description="Runs carrying every given tag.")] = None,
    launched_by: Annotated[str | None, Query(pattern="^(user|ci)$")] = None,
    q: Annotated[str | None, Query(max_length=200, description="Text in name or description.")] = None,
    created_since: datetime | None = None,
    created_until: datetime | None = None,
    sort: Annotated[
        str,
        Query(
            max_length=201,
            description="`created_at`, `priority` or a metric key (by its latest value); "
            "prefix `-` for descending. Runs without the metric come last.",
            examples=["-created_at", "-reward/mean"],
        ),
    ] = "-created_at",
    metrics: Annotated[str | None, Query(description="Comma-separated metric keys to include.")] = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> RunPage:
    """A page of the project's runs, filtered and sorted; follow `next_cursor` for more."""
    try:
        states = [RunState(s) for s in _csv(state)]
    except ValueError:
        raise HTTPException(422, f"state must be among {', '.join(RunState)}") from None
    query = service.RunQuery(
        states=states,
        experiment=experiment,
        tags=tag or [],
        launched_by=launched_by,
        text=q,
        created_since=created_since,
        created_until=created_until,
        sort=sort,
        cursor=cursor,
        limit=limit,
        metric_keys=_csv(metrics),
    )
    runs, summaries, next_cursor = service.list_runs(
        db_session=db_session, project_id=principal.project_id, query=query
    )
    return RunPage(items=[RunOut.of(r, summaries.get(r.id)) for r in runs], next_cursor=next_cursor)


@router.get("/runs/{run_id}", response_model=RunOut, tags=["runs"])
def get_run(run: ReadableRun) -> RunOut:
    return RunOut.of(run)


@router.get("/runs/{run_id}/attempts", response_model=list[AttemptOut], tags=["runs"])
def list_attempts(run: ReadableRun, db_session: ReadSessionDep) -> list[AttemptOut]:
    return [AttemptOut.model_validate(a) for a in service.list_attempts(db_session=db_session, run_id=run.id)]


@router.post("/runs/{run_id}/cancel", response_model=RunOut, tags=["runs"], responses=_409)
def cancel_run(
    run_id: int, principal: Writer, db_session: SessionDep, body: RunAction | None = None
) -> RunOut:
    """Cancel: a queued run is cancelled at once, a started one moves to `cancelling` until
    the dispatcher has stopped it. Cancelling a cancelled run changes nothing."""
    run = service.cancel(
        db_session=db_session,
        run_id=run_id,
        project_id=principal.project_id,
        reason=body.reason if body else None,
    )
    db_session.commit()
    return RunOut.of(run)


@router.post("/runs/{run_id}/retry", response_model=RunOut, tags=["runs"], responses=_409)
def retry_run(
    run_id: int, principal: Writer, db_session: SessionDep, body: RunAction | None = None
) -> RunOut:
    """Queue a failed run again: attempt += 1, resuming from its newest checkpoint."""
    run = service.retry(
        db_session=db_session,
        run_id=run_id,
        project_id=principal.project_id,
        reason=body.reason if body else None,
    )
    db_session.commit()
    return RunOut.of(run)


_TRAINER_STATES = {RunState.running, RunState.succeeded, RunState.failed}


@router.post("/runs/{run_id}/state", response_model=RunOut, tags=["runs"], responses=_409)
def report_state(run: WritableRun, body: StateUpdate, principal: CurrentPrincipal, db_session: SessionDep) -> RunOut:
    """A state report: the trainer's run token may report running, succeeded or failed; an
    admin token (a remote dispatcher) any legal move. Repeating the current state is a no-op,
    so a retried report is safe."""
    if principal.role is not Role.admin and body.state not in _TRAINER_STATES:
        raise HTTPException(
            403, f"only an admin token may set state {body.state.value}; run tokens report "
            "running, succeeded or failed"
        )
    if principal.role is not Role.run and principal.role is not Role.admin:
        raise HTTPException(403, "state reports need the run's token or an admin token")
    run = service.transition(
        db_session=db_session,
        run_id=run.id,
        to_state=body.state,
        reason=body.reason,
        summary=body.summary,
        allow_same=True,
    )
    service.record_environment(
        db_session=db_session,
        run=run,
        code_version=body.code_version,
        package_versions=body.package_versions,
        run_dir=body.run_dir,
    )
    db_session.commit()
    return RunOut.of(run)


# --- events and checkpoints --------------------------------------------------------------------


@router.post("/runs/{run_id}/events", response_model=Accepted, tags=["events"])
def post_events(run: WritableRun, body: EventBatch, db_session: SessionDep) -> Accepted:
    """Append to the run's timeline (placement, phase_spans, restart, warning, eval, checkpoint)."""
    n = service.add_events(db_session=db_session, run=run, events=body.events)
    db_session.commit()
    return Accepted(accepted=n)


@router.get("/runs/{run_id}/events", response_model=list[EventOut], tags=["events"])
def list_events(
    run: ReadableRun,
    db_session: ReadSessionDep,
    kind: Annotated[str | None, Query(description="Comma-separated kinds.")] = None,
    after_id: Annotated[int, Query(ge=0, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[EventOut]:
    """The run's timeline in order."""
    events = service.list_events(
        db_session=db_session, run_id=run.id, after_id=after_id, kinds=_csv(kind), limit=limit
    )
    return [EventOut.model_validate(e) for e in events]


@router.post("/runs/{run_id}/checkpoints", response_model=CheckpointOut, status_code=201, tags=["checkpoints"])
def post_checkpoint(run: WritableRun, body: CheckpointIn, db_session: SessionDep) -> CheckpointOut:
    """Record a checkpoint the trainer saved."""
    ckpt = service.add_checkpoint(db_session=db_session, run=run, checkpoint_in=body)
    db_session.commit()
    return CheckpointOut.model_validate(ckpt)


@router.get("/runs/{run_id}/checkpoints", response_model=list[CheckpointOut], tags=["checkpoints"])
def list_checkpoints(run: ReadableRun, db_session: ReadSessionDep) -> list[CheckpointOut]:
    """The run's checkpoints, newest last."""
    return [CheckpointOut.model_validate(c) for c in service.list_checkpoints(db_session=db_session, run_id=run.id)]


# --- live stream ----------------------------------------------------------------------------------


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n"


class _StreamCursor:
    """Where a stream is: the last metric point and event it sent, the last state."""

    def __init__(self, db: Database, run_id: int):
        self.db, self.run_id = db, run_id
        self.point_id = 0
        self.event_id = 0
        self.state: str | None = None

    def start(self) -> list[str]:
        with self.db.read_session() as s:
            self.point_id = metric_service.max_point_id(db_session=s)
            self.event_id = service.last_event_id(db_session=s, run_id=self.run_id)
        return self.poll()

    def poll(self) -> list[str]:
        out: list[str] = []
        with self.db.read_session() as s:
            run = service.get_any(db_session=s, run_id=self.run_id)
            if run is None:
                return [_sse("state", {"run_id": self.run_id, "state": None, "deleted": True})]
            points = metric_service.points_after(db_session=s, run_id=self.run_id, after_id=self.point_id)
            if points:
                self.point_id = points[-1].id
                out.append(
                    _sse(
                        "metric",
                        {"points": [{"key": p.key, "step": p.step, "value": p.value, "time": p.time} for p in points]},
                    )
                )
            for e in service.list_events(db_session=s, run_id=self.run_id, after_id=self.event_id):
                self.event_id = e.id
                out.append(_sse("event", EventOut.model_validate(e).model_dump(mode="json")))
            if run.state != self.state:
                self.state = run.state
                out.append(
                    _sse("state", {"run_id": run.id, "state": run.state, "attempt": run.attempt, "error": run.error})
                )
        return out


@router.get(
    "/runs/{run_id}/stream", tags=["runs"],
    responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events."}},
)
async def stream_run(run_id: int, request: Request, principal: Reader, db: DatabaseDep, settings: SettingsDep) -> StreamingResponse:
    """Server-Sent Events for live views: `state` (first the current one, then each change),
    `metric` (`{"points": [...]}`, new points only) and `event` (new timeline entries).
    The stream ends once the run is in a final state and everything has been sent."""

    def check() -> bool:
        with db.read_session() as s:
            return service.get(db_session=s, project_id=principal.project_id, run_id=run_id) is not None

    if not await run_in_threadpool(check):
        raise not_found(run_id)
    cursor = _StreamCursor(db, run_id)
    poll_s = settings.stream_poll_s

    async def messages() -> AsyncIterator[str]:
        batch = await run_in_threadpool(cursor.start)
        last_sent = time.monotonic()
        while True:
            for message in batch:
                yield message
            if batch:
                last_sent = time.monotonic()
            if cursor.state in TERMINAL:
                return
            if await request.is_disconnected():
                return
            await asyncio.sleep(poll_s)
            if time.monotonic() - last_sent > 15:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
            batch = await run_in_threadpool(cursor.poll)

    return StreamingResponse(
        messages(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

