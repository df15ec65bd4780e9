"""HTTP routes for metric ingest and reads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from backend.deps import (
    CurrentPrincipal,
    DatabaseDep,
    DetachedReadableRun,
    ReadableRun,
    ReadSessionDep,
    SettingsDep,
    telemetry_run,
)
from backend.fields import MAX_STEP, RunIdPath, StorableStr
from backend.metrics import export, newer, service
from backend.metrics.schemas import MetricBatch, MetricKeyOut, MetricSeries
from backend.runs.schemas import Accepted

router = APIRouter(tags=["metrics"])


@router.post(
    "/runs/{run_id}/metrics", response_model=Accepted,
    responses={413: {"description": "More points than the batch limit (10,000)."}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/MetricBatch"}}},
        }
    },
)
async def post_metrics(
    run_id: RunIdPath, request: Request, response: Response, principal: CurrentPrincipal, db: DatabaseDep,
    settings: SettingsDep,
) -> Accepted:
    """Store a batch of points in one transaction, one value per (key, step): a step sent again
    is overwritten (by the same or a later attempt), and a batch whose `batch_id` was applied
    before changes nothing. Only the run's token of its active attempt may post. Non-finite
    values (NaN, ±Infinity) are stored as null with their key and step kept; min/max ignore them."""
    # The hot path: pydantic parses and validates the raw JSON in one pass (no dicts in between).
    try:
        body = MetricBatch.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False), body=None) from None
    if len(body.points) > settings.max_metric_points:
        raise HTTPException(
            413,
            f"{len(body.points)} points in one batch; the limit is {settings.max_metric_points}: "
            "split the batch",
        )

    def write() -> service.Ingested:
        # the write transaction starts only once the whole body is in memory
        with db.sessionmaker() as db_session:
            run = telemetry_run(run_id=run_id, principal=principal, db_session=db_session)
            done = service.ingest(
                db_session=db_session, run_id=run.id, points=body.points, attempt=run.attempt,
                batch_id=body.batch_id,
            )
            db_session.commit()
            return done

    done = await run_in_threadpool(write)
    if done.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return Accepted(accepted=done.accepted)


MAX_KEYS = 200  # keys in one read
DEFAULT_POINTS = 1000  # points per series unless `max_points` says otherwise
MAX_POINTS = 10_000  # the most `max_points` may ask for; every point: `/metrics.csv`


def _keys(keys: str | None) -> list[str]:
    wanted = list(dict.fromkeys(k.strip() for k in (keys or "").split(",") if k.strip()))
    if len(wanted) > MAX_KEYS:
        raise HTTPException(422, f"{len(wanted)} keys asked for; at most {MAX_KEYS} in one read")
    return wanted


_KEYS_QUERY = Query(
    max_length=20_000,
    description=f"Comma-separated keys (at most {MAX_KEYS}); default: every key, the first "
    f"{MAX_KEYS} in key order.",
    examples=["reward/mean,kl/mean"],
)


@router.get("/runs/{run_id}/metrics", response_model=MetricSeries)
def get_metrics(
    run: ReadableRun,
    db_session: ReadSessionDep,
    keys: Annotated[StorableStr | None, _KEYS_QUERY] = None,
    max_points: Annotated[
        int,
        Query(ge=2, le=MAX_POINTS, description="Downsample each series to at most this many points: "
              "per bucket of steps its first point, its lowest and highest values and its first "
              "non-finite step (null), plus the last point. For every point, use `/metrics.csv`."),
    ] = DEFAULT_POINTS,
    after_step: Annotated[
        int | None,
        Query(ge=-1, le=MAX_STEP, description="Only points with a larger step, the first "
              "`max_points` of each key in step order, not sampled: what a live view lacks."),
    ] = None,
) -> JSONResponse:
    """Each key's series in step order; non-finite values come back as null."""
    wanted = _keys(keys)
    if not wanted:
        wanted = [s.key for s in service.summaries(db_session=db_session, run_id=run.id)][:MAX_KEYS]
    if after_step is not None:
        series = newer.points_after_step(
            db_session=db_session, run_id=run.id, keys=wanted, after_step=after_step, limit=max_points
        )
    else:
        series = service.series(db_session=db_session, run_id=run.id, keys=wanted, max_points=max_points)
    return JSONResponse({"series": series})


@router.get(
    "/runs/{run_id}/metrics.csv",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"},
                                              "example": "key,step,value,time\nloss,1,0.5,1764403200.5\n"}},
                     "description": "Every point, streamed: `key,step,value,time` (empty value: non-finite)."}},
)
def export_metrics(
    run: DetachedReadableRun, db: DatabaseDep, keys: Annotated[StorableStr | None, _KEYS_QUERY] = None
) -> StreamingResponse:
    """Every point of the run (or of `keys`) as CSV in (key, step) order, streamed page by page."""
    wanted = _keys(keys)
    return StreamingResponse(
        iterate_in_threadpool(export.csv_pages(db, run.id, wanted)),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="run-{run.id}-metrics.csv"'},
    )


@router.get("/runs/{run_id}/metric-keys", response_model=list[MetricKeyOut])
def metric_keys(run: ReadableRun, db_session: ReadSessionDep) -> list[MetricKeyOut]:
    """Every key the run reported, with latest (at the highest step), min, max and count."""
    return [
        MetricKeyOut(
            key=s.key, latest=s.latest, latest_step=s.latest_step, latest_time=s.latest_time,
            min=s.min, max=s.max, count=s.count,
        )
        for s in service.summaries(db_session=db_session, run_id=run.id)
    ]
