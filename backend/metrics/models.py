"""Metric points (one value per run, key and step), per-block extremes for downsampled reads,
applied batch ids, and a latest/min/max summary per (run, key)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from backend.db import Base, BigId, utcnow

# Steps per block in `metric_blocks`: a 1,000,000-step series has 15,625 blocks to merge on a read.
BLOCK_STEPS = 64


class MetricPoint(Base):
    """One reported value per (run, key, step). A non-finite value (NaN, ±inf) is stored as NULL.

    A later attempt that reports a step again overwrites it (last writer wins, per attempt);
    `attempt` is the attempt that wrote the stored value.
    """

    __tablename__ = "metric_points"
    __table_args__ = (
        Index("ix_metric_points_run_id_key_step", "run_id", "key", "step", unique=True),
        Index("ix_metric_points_run_id_id", "run_id", "id"),  # the live stream: a run's points after an id
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(200))
    step: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[float | None] = mapped_column(Float)
    time: Mapped[float] = mapped_column(Float, doc="Unix seconds.")
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class MetricBlock(Base):
    """Extremes of one key over `BLOCK_STEPS` consecutive steps (block = step // BLOCK_STEPS):
    what lets a downsampled read keep every spike and every non-finite step without reading
    the whole series."""

    __tablename__ = "metric_blocks"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    block: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    min_value: Mapped[float | None] = mapped_column(Float)
    min_step: Mapped[int | None] = mapped_column(BigInteger)
    max_value: Mapped[float | None] = mapped_column(Float)
    max_step: Mapped[int | None] = mapped_column(BigInteger)
    nonfinite_step: Mapped[int | None] = mapped_column(BigInteger, doc="First step with no finite value.")


class AppliedBatch(Base):
    """A metric batch id already applied to a run: a retried batch is a no-op."""

    __tablename__ = "metric_batches"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    points: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MetricSummary(Base):
    """Latest (at the highest step), min and max of one run's key, for listing and sorting;
    `count` is the number of stored points (distinct steps)."""

    __tablename__ = "metric_summaries"
    __table_args__ = (Index("ix_metric_summaries_key_latest", "key", "latest"),)

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    latest: Mapped[float | None] = mapped_column(Float)
    latest_step: Mapped[int] = mapped_column(BigInteger)
    latest_time: Mapped[float] = mapped_column(Float)
    min: Mapped[float | None] = mapped_column(Float)
    max: Mapped[float | None] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)
