"""Projects and tokens: create, authenticate, revoke. Keyword-only, one-line docstrings."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend.auth.models import ROLE_RANK, ApiToken, Project, Role
from backend.db import utcnow

TOKEN_PREFIX = "yatt_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's project, role and (for run tokens) run."""

    token_id: int
    token_name: str
    project_id: int
    project_name: str
    role: Role
    run_id: int | None = None
    attempt: int | None = None

    def can(self, role: Role) -> bool:
        """True when this token's role is at least `role` (run tokens only match `run`)."""
        if self.role is Role.run or role is Role.run:
            return self.role is role
        return ROLE_RANK[self.role] >= ROLE_RANK[role]


def hash_token(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token_value() -> str:
    """A fresh random token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def get_project(*, db_session: Session, project_id: int) -> Project | None:
    """A project by id."""
    return db_session.get(Project, project_id)


def get_project_by_name(*, db_session: Session, name: str) -> Project | None:
    """A project by name."""
    return db_session.scalar(select(Project).where(Project.name == name))


def get_or_create_project(*, db_session: Session, name: str, description: str = "") -> Project:
    """The project called `name`, created if it does not exist yet."""
    project = get_project_by_name(db_session=db_session, name=name)
    if project is not None:
        return project
    try:
        with db_session.begin_nested():
            project = Project(name=name, description=description)
            db_session.add(project)
    except IntegrityError:  # created concurrently
        project = get_project_by_name(db_session=db_session, name=name)
        assert project is not None
    return project


def create_token(
    *,
    db_session: Session,
    project_id: int,
    name: str,
    role: Role,
    expires_in_s: float | None = None,
    run_id: int | None = None,
    attempt: int | None = None,
) -> tuple[ApiToken, str]:
    """Store a new token; returns the row and the plain token (shown once, never stored)."""
    if (role is Role.run) != (run_id is not None):
        raise ValueError("run tokens, and only run tokens, name a run")
    value = new_token_value()
    row = ApiToken(
        project_id=project_id,
        name=name,
        role=role.value,
        token_hash=hash_token(value),
        prefix=value[: len(TOKEN_PREFIX) + 6],
        run_id=run_id,
        attempt=attempt,
        expires_at=utcnow() + timedelta(seconds=expires_in_s) if expires_in_s else None,
    )
    db_session.add(row)
    db_session.flush()
    return row, value


def create_run_token(
    *, db_session: Session, project_id: int, run_id: int, attempt: int, ttl_s: float
) -> str:
    """Mint the token the trainer uses to write one attempt's telemetry and state; any token
    the run had before is revoked (a relaunch of the attempt gets a fresh one)."""
    revoke_run_tokens(db_session=db_session, run_id=run_id)
    _, value = create_token(
        db_session=db_session,
        project_id=project_id,
        name=f"run-{run_id}-attempt-{attempt}",
        role=Role.run,
        expires_in_s=ttl_s,
        run_id=run_id,
        attempt=attempt,
    )
    return value


def has_live_run_token(*, db_session: Session, run_id: int, attempt: int) -> bool:
    """Whether the run has an unrevoked, unexpired token for `attempt`."""
    return db_session.scalar(
        select(ApiToken.id).where(
            ApiToken.run_id == run_id, ApiToken.attempt == attempt, ApiToken.revoked_at.is_(None),
            ApiToken.expires_at > utcnow(),
        ).limit(1)
    ) is not None


def authenticate(*, db_session: Session, token: str) -> Principal | None:
    """The principal behind a bearer token, or None when it is unknown, expired or revoked."""
    row = db_session.execute(
        select(ApiToken, Project.name)
        .join(Project, Project.id == ApiToken.project_id)
        .where(ApiToken.token_hash == hash_token(token))
    ).first()
    if row is None:
        return None
    tok, project_name = row
    if tok.revoked_at is not None or (tok.expires_at is not None and tok.expires_at <= utcnow()):
        return None
    return Principal(
        token_id=tok.id,
        token_name=tok.name,
        project_id=tok.project_id,
        project_name=project_name,
        role=Role(tok.role),
        run_id=tok.run_id,
        attempt=tok.attempt,
    )


def list_tokens(*, db_session: Session, project_id: int, include_run_tokens: bool = False) -> list[ApiToken]:
    """A project's tokens, newest last."""
    query = select(ApiToken).where(ApiToken.project_id == project_id).order_by(ApiToken.id)
    if not include_run_tokens:
        query = query.where(ApiToken.run_id.is_(None))
    return list(db_session.scalars(query))


def revoke_token(*, db_session: Session, project_id: int, token_id: int) -> ApiToken | None:
    """Revoke a project's token; None when the project has no such token."""
    tok = db_session.get(ApiToken, token_id)
    if tok is None or tok.project_id != project_id:
        return None
    if tok.revoked_at is None:
        tok.revoked_at = utcnow()
    return tok


def revoke_run_tokens(*, db_session: Session, run_id: int) -> int:
    """Revoke every token scoped to a run (when it ends); returns how many."""
    now = utcnow()
    tokens = db_session.scalars(
        select(ApiToken).where(ApiToken.run_id == run_id, ApiToken.revoked_at.is_(None))
    ).all()
    for tok in tokens:
        tok.revoked_at = now
    return len(tokens)
