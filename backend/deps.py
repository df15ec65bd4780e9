"""FastAPI dependencies as `Annotated` aliases: the database, sessions, the caller and their rights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from backend.auth import service as auth_service
from backend.auth.models import Role
from backend.auth.service import Principal
from backend.db import Database
from backend.fields import RunIdPath
from backend.runs import lifecycle
from backend.runs.models import Run
from backend.runs.state import ACTIVE, RunState
from backend.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer yatt_…`")


def get_database(request: Request) -> Database:
    return request.app.state.db  # type: ignore[no-any-return]


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


DatabaseDep = Annotated[Database, Depends(get_database)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(db: DatabaseDep) -> Iterator[Session]:
    """A write session; routes commit explicitly, anything uncommitted is rolled back."""
    with db.sessionmaker() as db_session:
        yield db_session


def get_read_session(db: DatabaseDep) -> Iterator[Session]:
    """A read-only session (never waits for writers on SQLite)."""
    with db.read_session() as db_session:
        yield db_session


SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]


def authenticate(
    db: DatabaseDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller behind the bearer token; 401 without a valid one."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    with db.read_session() as db_session:
        principal = auth_service.authenticate(db_session=db_session, token=credentials.credentials)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "invalid, expired or revoked token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


CurrentPrincipal = Annotated[Principal, Depends(authenticate)]


def _require(role: Role) -> object:
    def check(principal: CurrentPrincipal) -> Principal:
        if not principal.can(role):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"this needs a token with role {role.value} or higher; yours is {principal.role.value}",
            )
        return principal

    return Depends(check)


Reader = Annotated[Principal, _require(Role.read)]
Writer = Annotated[Principal, _require(Role.write)]
Admin = Annotated[Principal, _require(Role.admin)]


def not_found(run_id: int) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id} not found")


def readable_run(run_id: RunIdPath, principal: CurrentPrincipal, db_session: ReadSessionDep) -> Run:
    """A run the caller may read: any run of its project for read+ tokens, its own for run tokens."""
    if principal.role is Role.run and principal.run_id != run_id:
        raise not_found(run_id)
    run = lifecycle.get(db_session=db_session, project_id=principal.project_id, run_id=run_id)
    if run is None:
        raise not_found(run_id)
    return run


def readable_run_detached(run_id: RunIdPath, principal: CurrentPrincipal, db: DatabaseDep) -> Run:
    """As `readable_run`, read in a session that is closed at once: for streaming answers, which
    must not keep a session (and on SQLite a read snapshot) open while the client reads."""
    with db.read_session() as db_session:
        run = readable_run(run_id, principal, db_session)
        db_session.expunge(run)  # its loaded columns stay readable after the session ends
        return run


def run_writer(run_id: RunIdPath, principal: CurrentPrincipal, db_session: SessionDep) -> Run:
    """A run whose telemetry the caller may write: only with its run token, while that token's
    attempt is the run's active one."""
    return telemetry_run(run_id=run_id, principal=principal, db_session=db_session)


def telemetry_run(*, run_id: int, principal: Principal, db_session: Session) -> Run:
    """The run, if `principal` is its run token and the token's attempt is still active; 403/404 otherwise."""
    if principal.role is not Role.run:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "only the run's own token (handed to its trainer) may write a run's telemetry",
        )
    if principal.run_id != run_id:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"this run token cannot write run {run_id}")
    run = lifecycle.get(db_session=db_session, project_id=principal.project_id, run_id=run_id)
    if run is None:
        raise not_found(run_id)
    if run.attempt != principal.attempt or RunState(run.state) not in ACTIVE:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"this token's attempt {principal.attempt} of run {run_id} is over "
            f"(the run is {run.state}, attempt {run.attempt})",
        )
    return run


def state_writer(run_id: RunIdPath, principal: CurrentPrincipal, db_session: SessionDep) -> Run:
    """A run whose state the caller may report: an admin token (a remote dispatcher), or the
    run's token while its attempt is active."""
    if principal.role is Role.admin:
        run = lifecycle.get(db_session=db_session, project_id=principal.project_id, run_id=run_id)
        if run is None:
            raise not_found(run_id)
        return run
    if principal.role is not Role.run:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "state reports need the run's token or an admin token")
    return telemetry_run(run_id=run_id, principal=principal, db_session=db_session)


ReadableRun = Annotated[Run, Depends(readable_run)]
DetachedReadableRun = Annotated[Run, Depends(readable_run_detached)]
WritableRun = Annotated[Run, Depends(run_writer)]
StateWritableRun = Annotated[Run, Depends(state_writer)]
