"""Experiments, runs, their attempts, events (the timeline) and checkpoints."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from backend.db import Base, BigId, utcnow
from backend.runs.state import RunState


class Experiment(Base):
    """A named group of runs: a question being studied."""

    __tablename__ = "experiments"
    __table_args__ = (UniqueConstraint("project_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str] = mapped_column(Text, default="")
    tags: Mapped[list[Any]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    run_count: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0",
        doc="Runs in the experiment, kept by database triggers (backend/runs/run_counts.py).",
    )


class Run(Base):
    """One training job: a validated TrainerConfig, its state and everything about how it ran."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("project_id", "idempotency_key"),
        Index("ix_runs_project_id_id", "project_id", "id"),
        Index("ix_runs_project_id_experiment_id", "project_id", "experiment_id"),  # ?experiment=
        Index("ix_runs_state_priority", "state", "priority"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    experiment_id: Mapped[int] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str] = mapped_column(Text, default="")
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    state: Mapped[str] = mapped_column(String(16), default=RunState.queued.value)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    max_attempts: Mapped[int] = mapped_column(Integer, default=1)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_duration_s: Mapped[float | None] = mapped_column(Float)
    launched_by: Mapped[str] = mapped_column(String(8), default="user", doc="user or ci")
    launched_by_name: Mapped[str] = mapped_column(String(200), default="")
    ci: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    code_version: Mapped[str | None] = mapped_column(String(200))
    package_versions: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    run_dir: Mapped[str | None] = mapped_column(String(1000))
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    experiment: Mapped[Experiment] = relationship(lazy="joined", innerjoin=True)
    tag_rows: Mapped[list[RunTag]] = relationship(
        lazy="selectin", cascade="all, delete-orphan", order_by="RunTag.tag"
    )

    @property
    def tags(self) -> list[str]:
        return [row.tag for row in self.tag_rows]


class RunTag(Base):
    __tablename__ = "run_tags"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(100), primary_key=True, index=True)


class RunAttempt(Base):
    """One try at a run; the dispatcher records its Ray submission id here."""

    __tablename__ = "run_attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=RunState.queued.value)
    submission_id: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)


class RunEvent(Base):
    """The run's timeline: state changes, placement decisions, restarts, warnings."""

    __tablename__ = "run_events"
    __table_args__ = (Index("ix_run_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(50))
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class AppliedEventBatch(Base):
    """An events batch id already applied to a run: a retried batch is a no-op."""

    __tablename__ = "event_batches"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    events: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    """A saved training state; the newest is the resume point."""

    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_run_id_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    step: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(String(1000))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
