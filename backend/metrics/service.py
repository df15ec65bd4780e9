"""Metric ingest, downsampled reads and the latest/min/max summary per (run, key)."""

from __future__ import annotations

import math
import time as _time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from backend.metrics import sort_index
from backend.metrics.models import MetricPoint, MetricSummary
from backend.metrics.schemas import MetricPointIn


@dataclass
class _KeyStats:
    latest: float | None
    latest_step: int
    latest_time: float
    min: float | None
    max: float | None
    count: int


def finite_or_none(value: float | None) -> float | None:
    """The value, or None when it is missing, NaN or infinite."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _nullable(op: str, a: Any, b: Any) -> Any:
    """SQL min/max of two nullable values that ignores NULLs (portable LEAST/GREATEST)."""
    better = a < b if op == "min" else a > b
    return case((a.is_(None), b), (b.is_(None), a), (better, a), else_=b)


def ingest(*, db_session: Session, run_id: int, points: Sequence[MetricPointIn]) -> int:
    """Append a batch of points to a run and fold it into the run's summaries; returns the count."""
    if not points:
        return 0
    now = _time.time()
    rows: list[tuple[int, str, int, float | None, float]] = []
    stats: dict[str, _KeyStats] = {}
    for p in points:
        value = finite_or_none(p.value)
        t = p.time if p.time is not None else now
        rows.append((run_id, p.key, p.step, value, t))
        s = stats.get(p.key)
        if s is None:
            stats[p.key] = _KeyStats(value, p.step, t, value, value, 1)
            continue
        s.count += 1
        if p.step >= s.latest_step:
            s.latest, s.latest_step, s.latest_time = value, p.step, t
        if value is not None:
            s.min = value if s.min is None else min(s.min, value)
            s.max = value if s.max is None else max(s.max, value)
    _insert_points(db_session, rows)
    _upsert_summaries(
        db_session,
        [{"run_id": run_id, "key": key, **vars(s)} for key, s in stats.items()],
    )
    sort_index.sync(db_session=db_session, run_id=run_id, keys=list(stats))
    return len(rows)


_COLUMNS = "run_id, key, step, value, time"


def _insert_points(db_session: Session, rows: list[tuple[int, str, int, float | None, float]]) -> None:
    # The hot path of ingest: below the ORM, in the session's transaction. PostgreSQL gets
    # COPY (several times faster than executemany), SQLite a plain executemany.
    conn = db_session.connection()
    if conn.dialect.name == "postgresql":
        with conn.connection.driver_connection.cursor() as cur:  # type: ignore[union-attr]
            with cur.copy(f"COPY {MetricPoint.__tablename__} ({_COLUMNS}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
    else:
        conn.exec_driver_sql(
            f"INSERT INTO {MetricPoint.__tablename__} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?)", rows
        )


def _upsert_summaries(db_session: Session, rows: list[dict[str, Any]]) -> None:
    dialect = db_session.get_bind().dialect.name
    if dialect == "postgresql":
        make_insert: Any = pg_insert
    elif dialect == "sqlite":
        make_insert = sqlite_insert
    else:  # pragma: no cover - yatt supports SQLite and PostgreSQL
        raise NotImplementedError(f"metric summaries need an upsert on {dialect}")
    table = MetricSummary.__table__
    for start in range(0, len(rows), 500):
        stmt = make_insert(table).values(rows[start : start + 500])
        new = stmt.excluded
        newer = new.latest_step >= table.c.latest_step
        stmt = stmt.on_conflict_do_update(
            index_elements=[table.c.run_id, table.c.key],
            set_={
                "latest": case((newer, new.latest), else_=table.c.latest),
                "latest_step": case((newer, new.latest_step), else_=table.c.latest_step),
                "latest_time": case((newer, new.latest_time), else_=table.c.latest_time),
                "min": _nullable("min", table.c.min, new.min),
                "max": _nullable("max", table.c.max, new.max),
                "count": table.c.count + new.count,
            },
        )
        db_session.execute(stmt)


def summaries(*, db_session: Session, run_id: int) -> list[MetricSummary]:
    """The run's keys with latest/min/max, sorted by key."""
    return list(
        db_session.scalars(
            select(MetricSummary).where(MetricSummary.run_id == run_id).order_by(MetricSummary.key)
        )
    )


# One index seek per bucket: the first point at or after each bucket's start step. The cost
# grows with max_points, not with the number of points stored, so a run with a million points
# answers as fast as one with ten thousand.
_SAMPLE_SQL = text(
    """
    WITH RECURSIVE buckets(i) AS (
        SELECT CAST(0 AS BIGINT) UNION ALL SELECT i + 1 FROM buckets WHERE i + 1 < CAST(:n AS BIGINT)
    )
    SELECT p.step, p.value, p.time FROM metric_points p
    WHERE p.id IN (
        SELECT (
            SELECT q.id FROM metric_points q
            WHERE q.run_id = CAST(:run_id AS INTEGER) AND q.key = CAST(:key AS VARCHAR) AND q.step >= CAST(:lo AS BIGINT) + (buckets.i * CAST(:span AS BIGINT)) / CAST(:n AS BIGINT)
            ORDER BY q.step LIMIT 1
        ) FROM buckets
    )
    ORDER BY p.step, p.id
    """
)


def _points(rows: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"step": r[0], "value": r[1], "time": r[2]} for r in rows]


def series(
    *, db_session: Session, run_id: int, keys: Sequence[str] | None = None, max_points: int = 1000
) -> dict[str, list[dict[str, Any]]]:
    """Each key's points in step order; a series longer than `max_points` is sampled evenly
    over its step range (always keeping the last point), so the answer has at most
    `max_points` points. Keys with no points come back empty."""
    counts = {
        s.key: s.count
        for s in db_session.scalars(select(MetricSummary).where(MetricSummary.run_id == run_id))
    }
    wanted = list(dict.fromkeys(keys)) if keys else sorted(counts)
    out: dict[str, list[dict[str, Any]]] = {}
    mp = MetricPoint
    for key in wanted:
        count = counts.get(key, 0)
        where = (mp.run_id == run_id, mp.key == key)
        if count == 0:
            out[key] = []
        elif count <= max_points:
            rows = db_session.execute(
                select(mp.step, mp.value, mp.time).where(*where).order_by(mp.step, mp.id)
            )
            out[key] = _points(rows)
        else:
            # two index seeks; SQLite would scan the whole series for min() and max() together
            lo = db_session.execute(select(mp.step).where(*where).order_by(mp.step).limit(1)).scalar_one()
            last = db_session.execute(
                select(mp.step, mp.value, mp.time)
                .where(*where)
                .order_by(mp.step.desc())
                .limit(1)
            ).one()
            n = max(1, max_points - 1)
            sampled = _points(
                db_session.execute(
                    _SAMPLE_SQL,
                    {"n": n, "run_id": run_id, "key": key, "lo": lo, "span": last[0] - lo + 1},
                )
            )
            if not sampled or sampled[-1]["step"] != last[0]:
                sampled.append({"step": last[0], "value": last[1], "time": last[2]})
            out[key] = sampled[:max_points]
    return out


def max_point_id(*, db_session: Session) -> int:
    """The highest metric point id so far (streams start after it)."""
    return int(db_session.scalar(select(func.max(MetricPoint.id))) or 0)


def points_after(
    *, db_session: Session, run_id: int, after_id: int, limit: int = 10_000
) -> list[MetricPoint]:
    """A run's points with id > after_id, in arrival order (for live streams)."""
    return list(
        db_session.scalars(
            select(MetricPoint)
            .where(MetricPoint.id > after_id, MetricPoint.run_id == run_id)
            .order_by(MetricPoint.id)
            .limit(limit)
        )
    )
