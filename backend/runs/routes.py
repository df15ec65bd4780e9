"""HTTP routes for experiments, runs, their state, events, checkpoints and live stream. Thin:
each route checks who may call it and hands over to the service modules of `backend/runs/`
(`experiments`, `creation`, `lifecycle`, `listing`, `events`, `checkpoints`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import JSONResponse
from sqlalchemy.exc import IntegrityError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from backend.auth.models import Role
from backend.deps import (
    CurrentPrincipal,
    DatabaseDep,
    ReadableRun,
    Reader,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    StateWritableRun,
    WritableRun,
    Writer,
    not_found,
)
from backend.fields import INT64_MAX, ExperimentIdPath, RunIdPath, StorableStr
from backend.runs import checkpoints, creation, events, experiments, lifecycle, listing, stream
from backend.runs.schemas import (
    Accepted,
    AttemptOut,
    CheckpointIn,
    CheckpointOut,
    Comparison,
    ConfigValid,
    ConfigValidate,
    EventBatch,
    EventOut,
    ExperimentCreate,
    ExperimentOut,
    RunAction,
    RunCreate,
    RunListItem,
    RunOut,
    RunPage,
    StateUpdate,
    Tag,
)
from backend.runs.state import RunState
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


def _in_utc(value: datetime | None, name: str) -> datetime | None:
    """A date-time query bound in UTC (the database compares in UTC); a bound with no zone is
    UTC already. 422 naming the field when its UTC time falls outside the years 1-9999
    (e.g. `0001-01-01T00:01:00+01:02`), which the database layer cannot convert."""
    if value is None or value.tzinfo is None:
        return value
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise HTTPException(422, f"{name} is out of range once converted to UTC "
                                 "(it must fall within the years 1-9999)") from None


# --- experiments -----------------------------------------------------------------------------


@router.get("/experiments", response_model=list[ExperimentOut], tags=["experiments"])
def list_experiments(principal: Reader, db_session: ReadSessionDep) -> list[ExperimentOut]:
    """The project's experiments with their run counts."""
    return [
        ExperimentOut.model_validate(exp)
        for exp in experiments.list_experiments(db_session=db_session, project_id=principal.project_id)
    ]


@router.post(
    "/experiments", response_model=ExperimentOut, status_code=201, tags=["experiments"],
    responses={409: {"description": "An experiment with this name exists."}},
)
def create_experiment(body: ExperimentCreate, principal: Writer, db_session: SessionDep) -> ExperimentOut:
    """Create an experiment (runs also create theirs on first use)."""
    try:
        exp = experiments.create_experiment(
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
def get_experiment(experiment_id: ExperimentIdPath, principal: Reader, db_session: ReadSessionDep) -> ExperimentOut:
    exp = experiments.get_experiment(
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
        StorableStr | None,
        Header(max_length=200, description="Retrying with the same key returns the same run."),
    ] = None,
) -> RunOut:
    """Validate the config and queue a run. Creates the experiment if needed."""
    run, created = creation.create_run(
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
    state: Annotated[StorableStr | None, Query(description="Comma-separated states.", examples=["running,queued"])] = None,
    experiment: Annotated[StorableStr | None, Query(max_length=200, description="Experiment name.")] = None,
    tag: Annotated[list[Tag] | None, Query(max_length=50, description="Runs carrying every given tag.")] = None,
    launched_by: Annotated[str | None, Query(pattern="^(user|ci)$")] = None,
    q: Annotated[
        StorableStr | None,
        Query(
            max_length=200,
            description="Words to find in name, experiment, tags or description (all "
            "required, the last one as a prefix); ranked by relevance unless `sort` is given.",
        ),
    ] = None,
    created_since: datetime | None = None,
    created_until: datetime | None = None,
    sort: Annotated[
        StorableStr | None,
        Query(
            max_length=201,
            description="`created_at`, `priority`, `relevance` (with `q`) or a metric key (by "
            "its latest value); prefix `-` for descending. Runs without the metric come last "
            "either way. Default: `-relevance` with `q`, else `-created_at`.",
            examples=["-created_at", "-reward/mean"],
        ),
    ] = None,
    where: Annotated[
        list[StorableStr] | None,
        Query(
            max_length=250,
            description="Metric filters `KEY OP NUMBER` (OP: > >= < <= =) on the latest value; "
            "repeat for several (all must hold). Runs without the metric do not match.",
            examples=["reward/mean>=0.5"],
        ),
    ] = None,
    metrics: Annotated[
        StorableStr | None, Query(max_length=10_000, description="Comma-separated metric keys to include.")
    ] = None,
    cursor: Annotated[StorableStr | None, Query(max_length=2000)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> RunPage:
    """A page of the project's runs as the History table shows them (no config: see
    `GET /runs/{id}`), filtered and sorted; follow `next_cursor` for more."""
    try:
        states = [RunState(s) for s in _csv(state)]
    except ValueError:
        raise HTTPException(422, f"state must be among {', '.join(RunState)}") from None
    query = listing.RunQuery(
        states=states,
        experiment=experiment,
        tags=tag or [],
        launched_by=launched_by,
        text=q,
        created_since=_in_utc(created_since, "created_since"),
        created_until=_in_utc(created_until, "created_until"),
        sort=sort,
        cursor=cursor,
        limit=limit,
        metric_keys=_csv(metrics),
        metric_filters=[listing.parse_metric_filter(w) for w in where or []],
    )
    runs, summaries, next_cursor, scores = listing.list_runs(
        db_session=db_session, project_id=principal.project_id, query=query
    )
    return RunPage(
        items=[RunListItem.of(r, summaries.get(r.id), scores.get(r.id)) for r in runs],
        next_cursor=next_cursor,
    )


@router.get("/runs/compare", response_model=Comparison, tags=["runs"])
def compare_runs(
    principal: Reader,
    db_session: ReadSessionDep,
    runs: Annotated[str, Query(description="Comma-separated run ids, 1 to 20.", examples=["12,15,19"])],
    keys: Annotated[str | None, Query(description="Comma-separated metric keys to return as series.")] = None,
    max_points: Annotated[int, Query(ge=2, le=5000, description="Points per series at most.")] = 500,
) -> JSONResponse:
    """Runs side by side in one request: each run's row, config and metric keys, and the
    chosen metrics' series, downsampled. A run not in the project is a 404."""
    try:
        run_ids = [int(v) for v in _csv(runs)]
    except ValueError:
        raise HTTPException(422, "runs must be comma-separated run ids") from None
    compared = listing.compare_runs(
        db_session=db_session,
        project_id=principal.project_id,
        run_ids=run_ids,
        keys=_csv(keys),
        max_points=max_points,
    )
    # thousands of points: serialized as they are (like GET /runs/{id}/metrics), not validated again
    return JSONResponse(
        {
            "runs": [
                {"run": RunListItem.of(c.run).model_dump(mode="json"), "config": c.run.config,
                 "keys": c.keys, "series": c.series}
                for c in compared
            ]
        }
    )


@router.get("/runs/{run_id}", response_model=RunOut, tags=["runs"])
def get_run(run: ReadableRun) -> RunOut:
    return RunOut.of(run)


@router.get("/runs/{run_id}/attempts", response_model=list[AttemptOut], tags=["runs"])
def list_attempts(run: ReadableRun, db_session: ReadSessionDep) -> list[AttemptOut]:
    return [AttemptOut.model_validate(a) for a in lifecycle.list_attempts(db_session=db_session, run_id=run.id)]


@router.post("/runs/{run_id}/cancel", response_model=RunOut, tags=["runs"], responses=_409)
def cancel_run(
    run_id: RunIdPath, principal: Writer, db_session: SessionDep, body: RunAction | None = None
) -> RunOut:
    """Cancel: a queued run is cancelled at once, a started one moves to `cancelling` until
    the dispatcher has stopped it. Cancelling a cancelled run changes nothing."""
    run = lifecycle.cancel(
        db_session=db_session,
        run_id=run_id,
        project_id=principal.project_id,
        reason=body.reason if body else None,
    )
    db_session.commit()
    return RunOut.of(run)


@router.post("/runs/{run_id}/retry", response_model=RunOut, tags=["runs"], responses=_409)
def retry_run(
    run_id: RunIdPath, principal: Writer, db_session: SessionDep, body: RunAction | None = None
) -> RunOut:
    """Queue a failed run again: attempt += 1, resuming from its newest checkpoint."""
    run = lifecycle.retry(
        db_session=db_session,
        run_id=run_id,
        project_id=principal.project_id,
        reason=body.reason if body else None,
    )
    db_session.commit()
    return RunOut.of(run)


_TRAINER_STATES = {RunState.running, RunState.succeeded, RunState.failed}


@router.post("/runs/{run_id}/state", response_model=RunOut, tags=["runs"], responses=_409)
def report_state(run: StateWritableRun, body: StateUpdate, principal: CurrentPrincipal, db_session: SessionDep) -> RunOut:
    """A state report: the trainer's run token may report running, succeeded or failed; an
    admin token (a remote dispatcher) any legal move. Repeating the current state is a no-op,
    so a retried report is safe."""
    if principal.role is not Role.admin and body.state not in _TRAINER_STATES:
        raise HTTPException(
            403, f"only an admin token may set state {body.state.value}; run tokens report "
            "running, succeeded or failed"
        )
    run = lifecycle.transition(
        db_session=db_session,
        run_id=run.id,
        to_state=body.state,
        reason=body.reason,
        summary=body.summary,
        allow_same=True,
    )
    lifecycle.record_environment(
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
def post_events(run: WritableRun, body: EventBatch, db_session: SessionDep, response: Response) -> Accepted:
    """Append to the run's timeline (placement, phase_spans, restart, warning, eval, checkpoint).
    A batch whose `batch_id` the run has applied before changes nothing."""
    done = events.add_events(db_session=db_session, run=run, events=body.events, batch_id=body.batch_id)
    db_session.commit()
    if done.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return Accepted(accepted=done.accepted)


@router.get("/runs/{run_id}/events", response_model=list[EventOut], tags=["events"])
def list_events(
    run: ReadableRun,
    db_session: ReadSessionDep,
    kind: Annotated[StorableStr | None, Query(max_length=2000, description="Comma-separated kinds.")] = None,
    after_id: Annotated[int, Query(ge=0, le=INT64_MAX, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[EventOut]:
    """The run's timeline in order."""
    found = events.list_events(
        db_session=db_session, run_id=run.id, after_id=after_id, kinds=_csv(kind), limit=limit
    )
    return [EventOut.model_validate(e) for e in found]


@router.post("/runs/{run_id}/checkpoints", response_model=CheckpointOut, status_code=201, tags=["checkpoints"])
def post_checkpoint(run: WritableRun, body: CheckpointIn, db_session: SessionDep) -> CheckpointOut:
    """Record a checkpoint the trainer saved."""
    ckpt = checkpoints.add_checkpoint(db_session=db_session, run=run, checkpoint_in=body)
    db_session.commit()
    return CheckpointOut.model_validate(ckpt)


@router.get("/runs/{run_id}/checkpoints", response_model=list[CheckpointOut], tags=["checkpoints"])
def list_checkpoints(run: ReadableRun, db_session: ReadSessionDep) -> list[CheckpointOut]:
    """The run's checkpoints, newest last."""
    return [CheckpointOut.model_validate(c) for c in checkpoints.list_checkpoints(db_session=db_session, run_id=run.id)]


# --- live stream ----------------------------------------------------------------------------------


@router.get(
    "/runs/{run_id}/stream", tags=["runs"], response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                     "description": "Server-Sent Events."}},
)
async def stream_run(
    run_id: RunIdPath,
    request: Request,
    principal: Reader,
    db: DatabaseDep,
    settings: SettingsDep,
    last_event_id: Annotated[
        str | None,
        Header(alias="Last-Event-ID", max_length=60, description="Resume after this event (sent by "
               "EventSource on reconnect); without it the stream starts with the run's history."),
    ] = None,
) -> EventSourceResponse:
    """Server-Sent Events for live views, each with an `id:`: `state` (first the current one,
    then each change, a retry's new attempt included), `metric` (`{"points": [...]}`) and `event`
    (timeline entries). Starts with the run's history unless `Last-Event-ID` says where to
    resume; follows the run across retries and ends once it is final with no retry to come."""

    def check() -> bool:
        with db.read_session() as s:
            return lifecycle.get(db_session=s, project_id=principal.project_id, run_id=run_id) is not None

    try:
        stream.parse_event_id(last_event_id)
    except stream.BadLastEventId as exc:
        raise HTTPException(422, str(exc)) from None
    if not await run_in_threadpool(check):
        raise not_found(run_id)
    lag_s = 0.0 if db.engine.dialect.name == "sqlite" else stream.LAG_S  # SQLite commits in id order
    return stream.response(
        db=db, run_id=run_id, request=request, last_event_id=last_event_id,
        poll_s=settings.stream_poll_s, lag_s=lag_s,
    )
