"""create_app(): routers, middleware, error handlers — nothing else."""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.auth.routes import router as auth_router
from backend.db import Database
from backend.dispatch import routes as dispatch_routes
from backend.metrics.routes import router as metrics_router
from backend.metrics.schemas import MetricBatch
from backend.problems import COMMON_RESPONSES
from backend.runs.creation import IdempotencyConflict
from backend.runs.lifecycle import RunNotFound
from backend.runs.listing import InvalidQuery
from backend.runs.routes import router as runs_router
from backend.runs.state import IllegalTransition
from backend.settings import Settings, get_settings
from trainer.config import ConfigError

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"


class BodySizeLimit:
    """Answer 413 to request bodies over `max_bytes`, declared or streamed.

    The rest of an oversize body is read and dropped before the answer (up to `drain_bytes`):
    a server that answers and closes while the client still sends makes the client see a
    reset connection instead of the 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, drain_bytes: int = 256 * 1024 * 1024):
        self.app, self.max_bytes, self.drain_bytes = app, max_bytes, drain_bytes
        self._message = f"request body larger than {max_bytes} bytes (YATT_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._drain(receive, 0)
                await self._too_large(send)
                return
        seen = 0
        started = False
        too_large = False

        async def limited_receive() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    if message.get("more_body", False):
                        await self._drain(receive, seen)
                    # an HTTPException is what FastAPI lets through while it reads a body
                    raise HTTPException(413, self._message)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as exc:
            if exc.status_code != 413 or not too_large or started:
                raise
            await self._too_large(send)

    async def _drain(self, receive: Receive, seen: int) -> None:
        while seen <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _too_large(self, send: Send) -> None:
        response = JSONResponse({"detail": self._message}, status_code=413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _request_invalid(request: Request, exc: Exception) -> Response:
    """FastAPI's 422, rendered so that any input can be echoed back: bytes that are not UTF-8
    and lone surrogates would otherwise turn the 422 into a 500 while encoding it."""
    assert isinstance(exc, RequestValidationError)
    errors = []
    for error in exc.errors():
        error = dict(error)
        if isinstance(error.get("input"), bytes):
            error["input"] = error["input"].decode("utf-8", "replace")
        errors.append(error)
    body = json.dumps({"detail": jsonable_encoder(errors)}, ensure_ascii=True, default=str)
    return Response(body, status_code=422, media_type="application/json")


def _unstorable(request: Request, exc: Exception) -> JSONResponse:
    # The last line of defence: input validation should have refused this with a named field.
    log.warning("the database refused a value: %s", exc)
    return JSONResponse(
        {"detail": "a value in this request cannot be stored (out of range or invalid characters)"},
        status_code=422,
    )


DATABASE_UNAVAILABLE = "database unavailable; retry shortly"


def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # Down, restarting or out of connections: the client may retry, so 503, not 500.
    log.warning("database unavailable during %s %s: %s", request.method, request.url.path, exc)
    return JSONResponse({"detail": DATABASE_UNAVAILABLE}, status_code=503, headers={"Retry-After": "1"})


def _config_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ConfigError)
    detail = [
        {
            "loc": ["body", "config", *path.split(".")] if path else ["body", "config"],
            "path": path,
            "msg": msg,
            "type": "config",
        }
        for path, msg in exc.errors
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def _status(code: int) -> Any:
    def handler(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=code)

    return handler


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the bodies routes parse by hand (MetricBatch), so every
    `$ref` resolves."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary,
            description=app.description, routes=app.routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (MetricBatch,):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in body.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(settings: Settings | None = None, database: Database | None = None) -> FastAPI:
    """The yatt API. Without arguments it reads YATT_* settings and opens their database."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = database is None
        app.state.db = database or Database.from_settings(settings)
        # Everything alive at startup (modules, models, schemas: ~120,000 objects) lives as long
        # as the process: frozen out of the collector's sight, a full collection during a request
        # scans only what came after, not a 40-100 ms pass over all of it (the p95 of big lists).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if owned:
                app.state.db.dispose()

    app = FastAPI(
        title="yatt",
        version="0.1.0",
        summary="Managed RLHF training: experiments, runs, live metrics.",
        description="Every route under `/api/v1` needs `Authorization: Bearer <token>`; "
        "`/healthz` and `/readyz` do not.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    if database is not None:
        app.state.db = database
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(ConfigError, _config_error)
    app.add_exception_handler(IllegalTransition, _status(409))
    app.add_exception_handler(IdempotencyConflict, _status(409))
    app.add_exception_handler(RunNotFound, _status(404))
    app.add_exception_handler(InvalidQuery, _status(422))
    app.add_exception_handler(DataError, _unstorable)
    app.add_exception_handler(OverflowError, _unstorable)  # SQLite: an int beyond 64 bits
    app.add_exception_handler(RequestValidationError, _request_invalid)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(PoolTimeout, _database_unavailable)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "Database unreachable."}})
    def readyz(request: Request) -> JSONResponse:
        """The database answers."""
        try:
            request.app.state.db.ping()
        except Exception:  # any failure means not ready; the cause goes to the log, not the caller
            log.warning("readiness check: the database does not answer", exc_info=True)
            return JSONResponse({"status": "unavailable", "detail": "database unavailable"}, status_code=503)
        return JSONResponse({"status": "ready"})

    app.include_router(auth_router, prefix=API_PREFIX, responses=COMMON_RESPONSES)
    app.include_router(runs_router, prefix=API_PREFIX, responses=COMMON_RESPONSES)
    app.include_router(metrics_router, prefix=API_PREFIX, responses=COMMON_RESPONSES)
    app.include_router(dispatch_routes.router, prefix=API_PREFIX, responses=COMMON_RESPONSES)
    dispatch_routes.install(app)
    return app
