"""Metric ingest, downsampled reads and the latest/min/max summary per (run, key)."""

from __future__ import annotations

import math
import time as _time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, delete, func, insert, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from backend.db import utcnow
from backend.metrics import sort_index
from backend.metrics.models import (
    BLOCK_STEPS,
    AppliedBatch,
    MetricBlock,
    MetricPoint,
    MetricSummary,
)
from backend.metrics.schemas import MetricPointIn


@dataclass
class _Block:
    count: int = 0
    min_value: float | None = None
    min_step: int | None = None
    max_value: float | None = None
    max_step: int | None = None
    nonfinite_step: int | None = None

    def add(self, step: int, value: float | None) -> None:
        self.count += 1
        if value is None:
            if self.nonfinite_step is None or step < self.nonfinite_step:
                self.nonfinite_step = step
            return
        if self.min_value is None or value < self.min_value:
            self.min_value, self.min_step = value, step
        if self.max_value is None or value > self.max_value:
            self.max_value, self.max_step = value, step


@dataclass(frozen=True)
class Ingested:
    """What one ingest did: the points it accepted, and whether the batch id was seen before."""

    accepted: int
    replayed: bool = False


def finite_or_none(value: float | None) -> float | None:
    """The value, or None when it is missing, NaN or infinite."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _nullable(op: str, a: Any, b: Any) -> Any:
    """SQL min/max of two nullable values that ignores NULLs (portable LEAST/GREATEST)."""
    better = a < b if op == "min" else a > b
    return case((a.is_(None), b), (b.is_(None), a), (better, a), else_=b)


def _make_insert(db_session: Session) -> Any:
    dialect = db_session.get_bind().dialect.name
    if dialect == "postgresql":
        return pg_insert
    if dialect == "sqlite":
        return sqlite_insert
    raise NotImplementedError(f"metric ingest needs an upsert on {dialect}")  # pragma: no cover


def ingest(
    *,
    db_session: Session,
    run_id: int,
    points: Sequence[MetricPointIn],
    attempt: int = 1,
    batch_id: str | None = None,
) -> Ingested:
    """Store a batch of points, one per (key, step), and keep the run's summaries and blocks
    exact. A step stored before is overwritten unless an older attempt sends it (last writer
    wins, per attempt); within a batch the last point of a (key, step) wins. A batch whose
    `batch_id` this run has already applied changes nothing (`replayed`)."""
    if db_session.get_bind().dialect.name == "postgresql":
        # one ingest per run at a time: the overlap check below reads what it then writes
        db_session.execute(text("SELECT pg_advisory_xact_lock(:a, :b)"), {"a": 0x7961, "b": run_id})
    if batch_id is not None:
        claimed = db_session.execute(
            _make_insert(db_session)(AppliedBatch.__table__)
            .values(run_id=run_id, batch_id=batch_id, attempt=attempt, points=len(points), created_at=utcnow())
            .on_conflict_do_nothing()
            .returning(AppliedBatch.batch_id)
        ).scalar()
        if claimed is None:
            stored = db_session.scalar(
                select(AppliedBatch.points).where(AppliedBatch.run_id == run_id, AppliedBatch.batch_id == batch_id)
            )
            return Ingested(int(stored or 0), replayed=True)
    if not points:
        return Ingested(0)
    now = _time.time()
    isfinite = math.isfinite
    by_key: dict[str, dict[int, tuple[float | None, float]]] = {}
    for p in points:  # the last point of a (key, step) wins
        v = p.value
        if v is not None and not isfinite(v):
            v = None
        series_ = by_key.get(p.key)
        if series_ is None:
            series_ = by_key[p.key] = {}
        series_[p.step] = (v, p.time if p.time is not None else now)
    known: dict[str, int] = {
        key: step
        for key, step in db_session.execute(
            select(MetricSummary.key, MetricSummary.latest_step).where(
                MetricSummary.run_id == run_id, MetricSummary.key.in_(list(by_key))
            )
        )
    }
    rows: list[tuple[int, str, int, float | None, float, int]] = []
    stats: list[dict[str, Any]] = []
    blocks: dict[tuple[str, int], _Block] = {}
    overlap: list[tuple[str, int, int]] = []
    for key, series_ in by_key.items():
        rows.extend([(run_id, key, step, v, t, attempt) for step, (v, t) in series_.items()])
        first, last = min(series_), max(series_)
        if key in known and first <= known[key]:
            # the batch reaches back to steps the key already has (a resumed attempt, a resent
            # batch without an id, late points): recompute its blocks and summary from storage
            overlap.append((key, first, last))
            continue
        values = [v for v, _ in series_.values() if v is not None]
        latest, latest_time = series_[last]
        stats.append({"run_id": run_id, "key": key, "latest": latest, "latest_step": last,
                      "latest_time": latest_time, "min": min(values) if values else None,
                      "max": max(values) if values else None, "count": len(series_)})
        for step, (v, _) in series_.items():
            block = blocks.get((key, step // BLOCK_STEPS))
            if block is None:
                block = blocks[(key, step // BLOCK_STEPS)] = _Block()
            block.add(step, v)
    _upsert_points(db_session, rows)
    _merge_blocks(db_session, run_id, blocks)
    _upsert_summaries(db_session, stats)
    for key, first, last in overlap:
        _rebuild(db_session, run_id, key, first // BLOCK_STEPS, last // BLOCK_STEPS)
    sort_index.sync(db_session=db_session, run_id=run_id, keys=list(by_key))
    return Ingested(len(rows))


_COLUMNS = "run_id, key, step, value, time, attempt"


def _overwrite(new_id: str) -> str:
    # An overwritten point takes a new id, so live streams (which read a run's points by id)
    # send it again with its step and attempt, and the chart replaces the old value.
    return (
        f"ON CONFLICT (run_id, key, step) DO UPDATE SET id = {new_id}, value = excluded.value, "
        "time = excluded.time, attempt = excluded.attempt WHERE excluded.attempt >= metric_points.attempt"
    )


_OVERWRITE_POSTGRESQL = _overwrite("DEFAULT")  # the next value of the id sequence
_OVERWRITE_SQLITE = _overwrite("(SELECT max(id) FROM metric_points) + 1")  # writers take turns


def _upsert_points(db_session: Session, rows: list[tuple[int, str, int, float | None, float, int]]) -> None:
    # The hot path of ingest: below the ORM, in the session's transaction, one statement per
    # batch on PostgreSQL (arrays unnested server-side), an executemany on SQLite.
    conn = db_session.connection()
    if conn.dialect.name == "postgresql":
        with conn.connection.driver_connection.cursor() as cur:  # type: ignore[union-attr]
            cur.execute(
                f"INSERT INTO metric_points ({_COLUMNS}) "
                "SELECT %s, k, s, v, t, %s FROM unnest(%s::varchar[], %s::bigint[], %s::float8[], %s::float8[]) "
                f"AS u(k, s, v, t) {_OVERWRITE_POSTGRESQL}",
                (rows[0][0], rows[0][5], [r[1] for r in rows], [r[2] for r in rows],
                 [r[3] for r in rows], [r[4] for r in rows]),
            )
    else:
        conn.exec_driver_sql(
            f"INSERT INTO metric_points ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) {_OVERWRITE_SQLITE}", rows
        )


def _least(a: str, b: str) -> str:
    return f"CASE WHEN {a} IS NULL THEN {b} WHEN {b} IS NULL THEN {a} WHEN {b} < {a} THEN {b} ELSE {a} END"


def _greatest(a: str, b: str) -> str:
    return f"CASE WHEN {a} IS NULL THEN {b} WHEN {b} IS NULL THEN {a} WHEN {b} > {a} THEN {b} ELSE {a} END"


def _step_of(better: str, new: str, old: str) -> str:
    return (f"CASE WHEN excluded.{new}_value IS NULL THEN metric_blocks.{new}_step "
            f"WHEN metric_blocks.{new}_value IS NULL THEN excluded.{new}_step "
            f"WHEN excluded.{new}_value {better} metric_blocks.{new}_value THEN excluded.{new}_step "
            f"ELSE metric_blocks.{old}_step END")


# Plain SQL, the same on SQLite and PostgreSQL, sent as one executemany: compiling a
# multi-row INSERT per batch costs more than the database's work.
_MERGE_BLOCKS = (
    "INSERT INTO metric_blocks (run_id, key, block, count, min_value, min_step, max_value, max_step, "
    "nonfinite_step) VALUES (:run_id, :key, :block, :count, :min_value, :min_step, :max_value, "
    ":max_step, :nonfinite_step) ON CONFLICT (run_id, key, block) DO UPDATE SET "
    "count = metric_blocks.count + excluded.count, "
    f"min_step = {_step_of('<', 'min', 'min')}, "
    f"max_step = {_step_of('>', 'max', 'max')}, "
    f"min_value = {_least('metric_blocks.min_value', 'excluded.min_value')}, "
    f"max_value = {_greatest('metric_blocks.max_value', 'excluded.max_value')}, "
    f"nonfinite_step = {_least('metric_blocks.nonfinite_step', 'excluded.nonfinite_step')}"
)


def _merge_blocks(db_session: Session, run_id: int, blocks: dict[tuple[str, int], _Block]) -> None:
    """Fold new points' extremes into their blocks (new steps only: nothing is replaced)."""
    if blocks:
        db_session.execute(
            text(_MERGE_BLOCKS),
            [{"run_id": run_id, "key": key, "block": block, **vars(b)} for (key, block), b in blocks.items()],
        )


def _rebuild(db_session: Session, run_id: int, key: str, first_block: int, last_block: int) -> None:
    """Recompute a key's blocks in [first_block, last_block] from the stored points, then its
    summary from all its blocks and its highest step."""
    mp, mb = MetricPoint, MetricBlock
    blocks: dict[int, _Block] = {}
    for step, value in db_session.execute(
        select(mp.step, mp.value).where(
            mp.run_id == run_id, mp.key == key,
            mp.step >= first_block * BLOCK_STEPS, mp.step < (last_block + 1) * BLOCK_STEPS,
        )
    ):
        blocks.setdefault(step // BLOCK_STEPS, _Block()).add(step, value)
    db_session.execute(
        delete(mb).where(mb.run_id == run_id, mb.key == key, mb.block >= first_block, mb.block <= last_block)
    )
    if blocks:
        db_session.execute(
            insert(mb), [{"run_id": run_id, "key": key, "block": i, **vars(b)} for i, b in blocks.items()]
        )
    count, lo, hi = db_session.execute(
        select(func.sum(mb.count), func.min(mb.min_value), func.max(mb.max_value))
        .where(mb.run_id == run_id, mb.key == key)
    ).one()
    last = db_session.execute(
        select(mp.step, mp.value, mp.time).where(mp.run_id == run_id, mp.key == key)
        .order_by(mp.step.desc()).limit(1)
    ).one()
    summary = db_session.get(MetricSummary, (run_id, key))
    values = {"latest": last[1], "latest_step": last[0], "latest_time": last[2],
              "min": lo, "max": hi, "count": int(count or 0)}
    if summary is None:
        db_session.add(MetricSummary(run_id=run_id, key=key, **values))
    else:
        for name, value in values.items():
            setattr(summary, name, value)
    db_session.flush()


def _upsert_summaries(db_session: Session, rows: list[dict[str, Any]]) -> None:
    table = MetricSummary.__table__
    for start in range(0, len(rows), 500):
        stmt = _make_insert(db_session)(table).values(rows[start : start + 500])
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


# Which points a downsampled series keeps first when the budget is tight (lower first).
_LAST, _NONFINITE, _MAX, _MIN, _FIRST = range(5)


# Buckets are runs of `width` steps from the series' first step. Per bucket: its first point
# (one index seek per bucket, so the cost grows with max_points, not with the points stored;
# PostgreSQL gets a LATERAL join, SQLite a correlated min() per bucket, both run as seeks).
_FIRSTS_POSTGRESQL = text(
    """
    SELECT f.step, f.value, f.time
    FROM generate_series(CAST(0 AS BIGINT), CAST(:buckets AS BIGINT) - 1) AS b(i)
    CROSS JOIN LATERAL (
        SELECT q.step, q.value, q.time FROM metric_points q
        WHERE q.run_id = :run_id AND q.key = :key AND q.step >= CAST(:lo AS BIGINT) + b.i * CAST(:width AS BIGINT)
        ORDER BY q.step LIMIT 1
    ) AS f
    """
)
_FIRSTS_SQLITE = text(
    """
    WITH RECURSIVE buckets(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM buckets WHERE i + 1 < :buckets),
    firsts(step) AS (
        SELECT (SELECT min(q.step) FROM metric_points q
                WHERE q.run_id = :run_id AND q.key = :key AND q.step >= :lo + buckets.i * :width)
        FROM buckets
    )
    SELECT p.step, p.value, p.time FROM firsts
    JOIN metric_points p ON p.run_id = :run_id AND p.key = :key AND p.step = firsts.step
    """
)
# The points at given steps. On PostgreSQL a plain `step IN (...)` can be planned as a scan of
# the whole series when the table's statistics are stale (a fresh bulk load): a LATERAL seek
# per step in index order cannot.
_POINTS_AT_POSTGRESQL = text(
    """
    SELECT f.step, f.value, f.time FROM unnest(CAST(:steps AS BIGINT[])) AS w(step)
    CROSS JOIN LATERAL (
        SELECT q.step, q.value, q.time FROM metric_points q
        WHERE q.run_id = :run_id AND q.key = :key AND q.step >= w.step
        ORDER BY q.step LIMIT 1
    ) AS f
    WHERE f.step = w.step
    """
)
# ...and its extremes, folded from the per-block extremes inside the database in one grouped
# pass (a million-point series has 15,625 blocks; one row per bucket comes back): the steps of
# its lowest min and highest max and its first non-finite step. A block counts in the bucket
# of its first step.
_BUCKET_OF_BLOCK = (
    "CASE WHEN block * :block_steps <= :lo THEN 0 "
    "ELSE (block * CAST(:block_steps AS BIGINT) - :lo) / CAST(:width AS BIGINT) END"
)
_OF_SERIES = "FROM metric_blocks WHERE run_id = :run_id AND key = :key"
# PostgreSQL: (value, step) pairs compare as arrays, so min() of them is the lowest value at its
# earliest step, and max() of (value, -step) the highest value at its earliest step.
_BUCKET_EXTREMES_POSTGRESQL = text(
    "SELECT min(CASE WHEN min_value IS NOT NULL THEN ARRAY[min_value, CAST(min_step AS FLOAT8)] END), "
    "max(CASE WHEN max_value IS NOT NULL THEN ARRAY[max_value, -CAST(max_step AS FLOAT8)] END), "
    f"min(nonfinite_step) {_OF_SERIES} GROUP BY {_BUCKET_OF_BLOCK}"
)
# SQLite: a bare column beside a single min() or max() comes from the row holding it, so one
# grouped pass per extreme.
_BUCKET_EXTREMES_SQLITE = [
    text(f"SELECT min(min_value), min_step {_OF_SERIES} AND min_value IS NOT NULL GROUP BY {_BUCKET_OF_BLOCK}"),
    text(f"SELECT max(max_value), max_step {_OF_SERIES} AND max_value IS NOT NULL GROUP BY {_BUCKET_OF_BLOCK}"),
    text(f"SELECT min(nonfinite_step) {_OF_SERIES} AND nonfinite_step IS NOT NULL GROUP BY {_BUCKET_OF_BLOCK}"),
]


def _bucket_extremes(db_session: Session, params: dict[str, Any]) -> dict[int, int]:
    """The steps worth keeping for their values, each with its priority (see `_downsample`)."""
    wanted: dict[int, int] = {}

    def want(step: Any, priority: int) -> None:
        if step is not None and priority < wanted.get(int(step), _FIRST + 1):
            wanted[int(step)] = priority

    if db_session.get_bind().dialect.name == "postgresql":
        for low, high, nonfinite in db_session.execute(_BUCKET_EXTREMES_POSTGRESQL, params):
            want(low[1] if low else None, _MIN)
            want(-high[1] if high else None, _MAX)
            want(nonfinite, _NONFINITE)
        return wanted
    lows, highs, nonfinites = _BUCKET_EXTREMES_SQLITE
    for _, step in db_session.execute(lows, params):
        want(step, _MIN)
    for _, step in db_session.execute(highs, params):
        want(step, _MAX)
    for (step,) in db_session.execute(nonfinites, params):
        want(step, _NONFINITE)
    return wanted


def _points(rows: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"step": r[0], "value": r[1], "time": r[2]} for r in rows]


def series(
    *, db_session: Session, run_id: int, keys: Sequence[str] | None = None, max_points: int = 1000
) -> dict[str, list[dict[str, Any]]]:
    """Each key's points in step order, at most `max_points` per key. A longer series is
    downsampled so that nothing a person must see disappears: its step range is cut into
    buckets, and each bucket keeps its first point, its lowest and highest values and its
    first non-finite step (null), plus the series' last point. Keys with no points come back
    empty."""
    summary_of = {
        s.key: s for s in db_session.scalars(select(MetricSummary).where(MetricSummary.run_id == run_id))
    }
    wanted = list(dict.fromkeys(keys)) if keys else sorted(summary_of)
    out: dict[str, list[dict[str, Any]]] = {}
    mp = MetricPoint
    for key in wanted:
        summary = summary_of.get(key)
        where = (mp.run_id == run_id, mp.key == key)
        if summary is None or summary.count == 0:
            out[key] = []
        elif summary.count <= max_points:
            rows = db_session.execute(select(mp.step, mp.value, mp.time).where(*where).order_by(mp.step))
            out[key] = _points(rows)
        else:
            out[key] = _downsample(db_session, run_id, key, max_points, summary)
    return out


def _points_at(db_session: Session, run_id: int, key: str, steps: list[int]) -> list[dict[str, Any]]:
    """The stored points of `key` at `steps` (those that exist)."""
    if db_session.get_bind().dialect.name == "postgresql":
        params = {"run_id": run_id, "key": key, "steps": steps}
        return _points(db_session.execute(_POINTS_AT_POSTGRESQL, params))
    mp, out = MetricPoint, []
    for start in range(0, len(steps), 500):  # SQLite's limit on bound parameters
        at = (mp.run_id == run_id, mp.key == key, mp.step.in_(steps[start : start + 500]))
        out += _points(db_session.execute(select(mp.step, mp.value, mp.time).where(*at)))
    return out


def _downsample(
    db_session: Session, run_id: int, key: str, max_points: int, last: MetricSummary
) -> list[dict[str, Any]]:
    mp = MetricPoint
    where = (mp.run_id == run_id, mp.key == key)
    # one index seek; SQLite would scan the whole series for min() and max() together
    lo = db_session.execute(select(mp.step).where(*where).order_by(mp.step).limit(1)).scalar_one()
    span = last.latest_step - lo + 1
    width = -(-span // max(1, (max_points - 1) // 4))  # up to 4 points a bucket, plus the last
    params = {"run_id": run_id, "key": key, "lo": lo, "width": width, "buckets": -(-span // width),
              "block_steps": BLOCK_STEPS}
    keep: dict[int, tuple[int, dict[str, Any]]] = {}

    def offer(priority: int, point: dict[str, Any]) -> None:
        held = keep.get(point["step"])
        if held is None or priority < held[0]:
            keep[point["step"]] = (priority, point)

    firsts = _FIRSTS_POSTGRESQL if db_session.get_bind().dialect.name == "postgresql" else _FIRSTS_SQLITE
    for p in _points(db_session.execute(firsts, params)):
        offer(_FIRST, p)
    offer(_LAST, {"step": last.latest_step, "value": last.latest, "time": last.latest_time})

    wanted = _bucket_extremes(db_session, params)
    for p in _points_at(db_session, run_id, key, sorted(wanted)):
        offer(wanted[p["step"]], p)
    chosen = sorted(keep.values(), key=lambda held: (held[0], held[1]["step"]))[:max_points]
    return sorted((p for _, p in chosen), key=lambda p: p["step"])


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
