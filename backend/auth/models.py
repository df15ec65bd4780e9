"""Projects and API tokens."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from backend.db import Base, utcnow


class Role(enum.StrEnum):
    """What a token may do. `run` tokens write one run's telemetry and state, nothing else."""

    read = "read"
    write = "write"
    admin = "admin"
    run = "run"


ROLE_RANK = {Role.run: 0, Role.read: 1, Role.write: 2, Role.admin: 3}


class Project(Base):
    """A team's namespace: tokens, experiments and runs belong to one project."""

    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    description: Mapped[str] = mapped_column(String(2000), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """A bearer token; only its SHA-256 is stored (tokens are 256-bit random, so no KDF)."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(10))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16), doc="First characters, to recognise a token.")
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), index=True, doc="Set for run-scoped tokens."
    )
    attempt: Mapped[int | None] = mapped_column(doc="The one attempt a run-scoped token writes for.")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
