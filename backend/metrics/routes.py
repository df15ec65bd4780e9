"""HTTP routes for metric ingest and reads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from backend.deps import (
    CurrentPrincipal,
    DatabaseDep,
    ReadableRun,
    ReadSessionDep,
    SettingsDep,
    telemetry_run,
)
from backend.metrics import service
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
    run_id: int, request: Request, response: Response, principal: CurrentPrincipal, db: DatabaseDep,
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
        raise RequestValidationError(exc.errors(include_url=False), body=None) from None
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


@router.get("/runs/{run_id}/metrics", response_model=MetricSeries)
def get_metrics(
    run: ReadableRun,
    db_session: ReadSessionDep,
    keys: Annotated[
        str | None, Query(description="Comma-separated keys; default: every key.", examples=["reward/mean,kl/mean"])
    ] = None,
    max_points: Annotated[
        int | None,
        Query(ge=2, le=1_000_000, description="Downsample each series to at most this many points: "
              "per bucket of steps its first point, its lowest and highest values and its first "
              "non-finite step (null), plus the last point; default: every point."),
    ] = None,
) -> JSONResponse:
    """Each key's series in step order; non-finite values come back as null."""
    wanted = [k.strip() for k in (keys or "").split(",") if k.strip()]
    series = service.series(
        db_session=db_session, run_id=run.id, keys=wanted or None, max_points=max_points or 10**12
    )
    return JSONResponse({"series": series})


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
