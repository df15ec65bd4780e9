"""The metric sort index: one numeric row per (run, key) holding the summary's latest value.

`GET /runs?sort=-reward/mean` walks this table's (project_id, key, value, run_id) index, so a
sort or a range filter by any metric costs a page, not the whole history. The rows follow the
summaries: `sync` runs after every summary upsert (metric ingest), `rebuild` fills the table
from `metric_summaries` in one statement (migration backfill, bulk seeding).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Float, ForeignKey, Index, String, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from backend.db import Base


class RunMetricValue(Base):
    """A run's latest value of one metric key (NULL when the latest point was not finite)."""

    __tablename__ = "run_metric_values"
    __table_args__ = (
        Index("ix_run_metric_values_sort", "project_id", "key", "value", "run_id"),
    )

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    value: Mapped[float | None] = mapped_column(Float)


# INSERT ... SELECT with an upsert: both SQLite (3.24+) and PostgreSQL accept this text.
_UPSERT = """
    INSERT INTO run_metric_values (run_id, key, project_id, value)
    SELECT s.run_id, s.key, r.project_id, s.latest
    FROM metric_summaries s JOIN runs r ON r.id = s.run_id
    WHERE {where}
    ON CONFLICT (run_id, key) DO UPDATE SET value = excluded.value
"""


def sync(*, db_session: Session, run_id: int, keys: Sequence[str]) -> None:
    """Copy the run's summaries of `keys` into the sort index (call after upserting them)."""
    if not keys:
        return
    names = {f"k{i}": key for i, key in enumerate(keys)}
    where = f"s.run_id = :run_id AND s.key IN ({', '.join(':' + n for n in names)})"
    db_session.execute(text(_UPSERT.format(where=where)), {"run_id": run_id, **names})


def rebuild(*, db_session: Session) -> None:
    """Refill the whole sort index from `metric_summaries` (after a bulk load or a migration)."""
    db_session.execute(text("DELETE FROM run_metric_values"))
    db_session.execute(text(_UPSERT.format(where="1 = 1")))
