"""Metric points (append-only history) and a latest/min/max summary per (run, key)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from backend.db import Base, BigId


class MetricPoint(Base):
    """One reported value. A non-finite value (NaN, ±inf) is stored as NULL."""

    __tablename__ = "metric_points"
    __table_args__ = (
        Index("ix_metric_points_run_id_key_step", "run_id", "key", "step"),
        Index("ix_metric_points_run_id_id", "run_id", "id"),  # the live stream: a run's points after an id
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(200))
    step: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[float | None] = mapped_column(Float)
    time: Mapped[float] = mapped_column(Float, doc="Unix seconds.")


class MetricSummary(Base):
    """Latest (at the highest step), min and max of one run's key, for listing and sorting."""

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
