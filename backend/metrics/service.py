"""Metric ingest, downsampled reads and the latest/min/max summary per (run, key)."""

from __future__ import annotations

import json
import math
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import asc, case, delete, desc, func, insert, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, aliased

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


def _points(rows: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"step": r[0], "value": r[1], "time": r[2]} for r in rows]


def series(
    *, db_session: Session, run_id: int, keys: Sequence[str] | None = None, max_points: int = 1000
) -> dict[str, list[dict[str, Any]]]:
    """Each key's points in step order, at most `max_points` per key. A longer series is
    downsampled so that nothing a person must see disappears: its step range is cut into
    buckets, and each bucket keeps its first point, its lowest and highest values and its
    first non-finite step (null), plus the series' last point. Keys with no points come back
    empty; no keys means every key the run has."""
    return series_of_runs(db_session=db_session, keys_by_run={run_id: keys}, max_points=max_points)[run_id]


Series = tuple[int, str]  # (run id, key)


def series_of_runs(
    *, db_session: Session, keys_by_run: Mapping[int, Sequence[str] | None], max_points: int = 1000
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """`series` of several runs at once — {run_id: {key: points}} — in three queries whatever the
    number of runs and keys (the Compare page's twenty runs cost what one run does): the series'
    step ranges, the short series whole, the long ones downsampled (on SQLite, after one small
    query per long series for its extremes)."""
    ms = MetricSummary
    run_ids = list(keys_by_run)
    if not run_ids:
        return {}

    def step_at(end: Any) -> Any:  # one index seek: a series' first or last step
        mp = aliased(MetricPoint)
        return (
            select(mp.step).where(mp.run_id == ms.run_id, mp.key == ms.key)
            .order_by(end(mp.step)).limit(1).correlate(ms).scalar_subquery()
        )

    stored = select(ms.run_id, ms.key, ms.count, step_at(asc), step_at(desc)).where(ms.run_id.in_(run_ids))
    if all(keys for keys in keys_by_run.values()):
        stored = stored.where(ms.key.in_(sorted({k for keys in keys_by_run.values() for k in keys or ()})))
    found: dict[Series, tuple[int, int | None, int | None]] = {  # (count, first step, last step)
        (run_id, key): (count, first, last) for run_id, key, count, first, last in db_session.execute(stored)
    }
    wanted = {
        run_id: list(dict.fromkeys(keys)) if keys else sorted(k for r, k in found if r == run_id)
        for run_id, keys in keys_by_run.items()
    }
    stored_points = [s for s in found if s[1] in wanted[s[0]] and found[s][1] is not None]
    short = [s for s in stored_points if found[s][0] <= max_points]
    long = [s for s in stored_points if found[s][0] > max_points]
    points: dict[Series, list[dict[str, Any]]] = {s: [] for s in short}
    if short:
        short_rows, params = _rows_param(db_session, "s", {"run_id": "integer", "key": "varchar"}, short)
        every_point = _points_join(db_session, "q.run_id = s.run_id AND q.key = s.key", first_only=False)
        for run_id, key, *point in db_session.execute(
            text(f"SELECT s.run_id, s.key, p.step, p.value, p.time FROM {short_rows} {every_point} "
                 "ORDER BY s.run_id, s.key, p.step"),
            params,
        ).all():
            points[(run_id, key)].append({"step": point[0], "value": point[1], "time": point[2]})
    if long:
        points.update(_downsample(db_session, {s: (found[s][1] or 0, found[s][2] or 0) for s in long}, max_points))
    return {run_id: {k: points.get((run_id, k), []) for k in keys} for run_id, keys in wanted.items()}


def _rows_param(db_session: Session, name: str, columns: Mapping[str, str], rows: Sequence[tuple[Any, ...]]) -> tuple[str, dict[str, Any]]:
    """A FROM item `name` with `columns` ({column: SQL type}) holding `rows`, and its parameters:
    one array per column on PostgreSQL (unnest), one JSON text on SQLite (json_each). The
    statement's text is the same for any number of rows, so it is parsed once and cached,
    where thousands of bound VALUES cost more to send than the query costs to run."""
    if db_session.get_bind().dialect.name == "postgresql":
        arrays = ", ".join(f"CAST(:{name}_{column} AS {kind}[])" for column, kind in columns.items())
        return (
            f"unnest({arrays}) AS {name}({', '.join(columns)})",
            {f"{name}_{column}": [row[i] for row in rows] for i, column in enumerate(columns)},
        )
    cells = ", ".join(f"json_extract(value, '$[{i}]') AS {column}" for i, column in enumerate(columns))
    return f"(SELECT {cells} FROM json_each(:{name})) AS {name}", {name: json.dumps(list(rows))}


def _points_join(db_session: Session, condition: str, first_only: bool = True) -> str:
    """A join clause that adds `p`: the points of `metric_points q` meeting `condition` (with
    `first_only`, the first in step order), found through the (run, key, step) index for each
    outer row: a LATERAL subquery on PostgreSQL, whose planner would rather hash the whole
    table than seek a few thousand times; a plain join on SQLite, which has no LATERAL and
    seeks anyway."""
    if db_session.get_bind().dialect.name == "postgresql":
        limit = " ORDER BY q.step LIMIT 1" if first_only else ""
        return f"CROSS JOIN LATERAL (SELECT q.step, q.value, q.time FROM metric_points q WHERE {condition}{limit}) p"
    if first_only:
        return f"JOIN metric_points p ON p.id = (SELECT q.id FROM metric_points q WHERE {condition} ORDER BY q.step LIMIT 1)"
    return f"JOIN metric_points p ON {condition.replace('q.', 'p.')}"


# Which points a downsampled series keeps first when the budget is tight (lower first).
_LAST, _NONFINITE, _MAX, _MIN, _FIRST = range(5)


def _downsample(
    db_session: Session, ranges: Mapping[Series, tuple[int, int]], max_points: int
) -> dict[Series, list[dict[str, Any]]]:
    """Downsample every series in `ranges` ({series: (first step, last step)}) at once, in one
    statement (on SQLite after one small query per series for its extremes). Buckets are runs
    of `width` steps from a series' first step, at most (max_points - 1) // 4 of them."""
    n = max(1, (max_points - 1) // 4)
    rows = [(i, *s, lo, -(-(last - lo + 1) // n), last) for i, (s, (lo, last)) in enumerate(ranges.items())]
    series, params = _rows_param(
        db_session, "s",
        {"i": "integer", "run_id": "integer", "key": "varchar", "lo": "bigint", "width": "bigint", "last": "bigint"},
        rows,
    )
    if db_session.get_bind().dialect.name == "postgresql":
        statement = _DOWNSAMPLE_POSTGRESQL.format(
            series=series,
            at_steps=_points_join(
                db_session, "q.run_id = s.run_id AND q.key = s.key AND q.step = ANY(a.steps)", first_only=False
            ),
            first_after=_points_join(db_session, "q.run_id = s.run_id AND q.key = s.key AND q.step > b.step"),
        )
        params["block_steps"] = BLOCK_STEPS
    else:
        wanted, wanted_params = _rows_param(
            db_session, "w", {"i": "integer", "step": "bigint", "priority": "integer"},
            _kept_for_values_sqlite(db_session, rows),
        )
        # the first point at or after each bucket's start: one index seek per bucket, so the
        # cost grows with max_points, not with the points stored
        statement = _DOWNSAMPLE_SQLITE.format(
            series=series,
            wanted=wanted,
            first_in_bucket=_points_join(
                db_session, "q.run_id = s.run_id AND q.key = s.key AND q.step >= s.lo + b.i * s.width"
            ),
            at_step=_points_join(db_session, "q.run_id = s.run_id AND q.key = s.key AND q.step = w.step"),
        )
        params.update(wanted_params, n=n)
    held: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in rows]
    for i, step, value, time, priority in db_session.execute(text(statement), params).all():
        held[i].append((priority, {"step": step, "value": value, "time": time}))  # in step order
    return {(row[1], row[2]): _within(kept, max_points) for row, kept in zip(rows, held, strict=True)}


def _within(held: list[tuple[int, dict[str, Any]]], max_points: int) -> list[dict[str, Any]]:
    """The points of a series' (priority, point) pairs, in step order, at most `max_points`:
    the most important. Buckets are few enough that every point fits unless max_points < 5."""
    if len(held) > max_points:
        held = sorted(sorted(held, key=lambda h: (h[0], h[1]["step"]))[:max_points], key=lambda h: h[1]["step"])
    return [point for _, point in held]


# The whole downsample of every series (`s`, numbered by `i`) as one statement. The steps to
# keep: each series' last step; per bucket, the step of its lowest and of its highest value,
# folded from the per-block extremes ((value, step) pairs compare as arrays: min() is the lowest
# value at its earliest step, max() of (value, -step) the highest at its earliest step), its
# first non-finite step and its start (a bucket starting past the last step is left out). They
# are read in one index scan per series (`step = ANY(...)`, several times cheaper than a join
# seeking each step). A bucket whose start has no point keeps the first point after it instead,
# one seek each. Then each step once, with its most important reason to be kept, in order.
_DOWNSAMPLE_POSTGRESQL = f"""
WITH s AS (
    SELECT * FROM {{series}}
), extremes AS (
    SELECT s.i,
        min(CASE WHEN mb.min_value IS NOT NULL THEN ARRAY[mb.min_value, CAST(mb.min_step AS FLOAT8)] END) AS low,
        max(CASE WHEN mb.max_value IS NOT NULL THEN ARRAY[mb.max_value, -CAST(mb.max_step AS FLOAT8)] END) AS high,
        min(mb.nonfinite_step) AS nonfinite
    FROM s JOIN metric_blocks mb ON mb.run_id = s.run_id AND mb.key = s.key
    GROUP BY s.i, CASE WHEN mb.block * :block_steps <= s.lo THEN 0
        ELSE (mb.block * CAST(:block_steps AS BIGINT) - s.lo) / s.width END
), starts AS (
    SELECT s.i, s.lo + b.i * s.width AS step FROM s CROSS JOIN generate_series(0, (s.last - s.lo) / s.width) b(i)
), wanted AS (
    SELECT i, step, min(priority) AS priority FROM (
        SELECT i, last AS step, {_LAST} AS priority FROM s
        UNION ALL SELECT i, nonfinite, {_NONFINITE} FROM extremes WHERE nonfinite IS NOT NULL
        UNION ALL SELECT i, CAST(-high[2] AS BIGINT), {_MAX} FROM extremes WHERE high IS NOT NULL
        UNION ALL SELECT i, CAST(low[2] AS BIGINT), {_MIN} FROM extremes WHERE low IS NOT NULL
        UNION ALL SELECT i, step, {_FIRST} FROM starts
    ) w GROUP BY i, step
), found AS (
    SELECT s.i, p.step, p.value, p.time
    FROM (SELECT i, array_agg(step) AS steps FROM wanted GROUP BY i) a JOIN s ON s.i = a.i
    {{at_steps}}
), candidates AS (
    SELECT f.i, f.step, f.value, f.time, w.priority FROM found f JOIN wanted w ON w.i = f.i AND w.step = f.step
    UNION ALL
    SELECT s.i, p.step, p.value, p.time, {_FIRST}
    FROM starts b JOIN s ON s.i = b.i {{first_after}}
    WHERE NOT EXISTS (SELECT FROM found f WHERE f.i = b.i AND f.step = b.step)
)
SELECT DISTINCT ON (i, step) i, step, value, time, priority FROM candidates ORDER BY i, step, priority
"""

# The same on SQLite, with the steps kept for their values (`w`) found beforehand; a bare
# column beside min() comes from the row holding it.
_DOWNSAMPLE_SQLITE = f"""
WITH RECURSIVE buckets(i) AS (
    SELECT 0 UNION ALL SELECT i + 1 FROM buckets WHERE i + 1 < :n
), s AS (
    SELECT * FROM {{series}}
), candidates AS (
    SELECT s.i, p.step, p.value, p.time, w.priority FROM {{wanted}} JOIN s ON s.i = w.i {{at_step}}
    UNION ALL
    SELECT s.i, p.step, p.value, p.time, {_FIRST}
    FROM s JOIN buckets b ON b.i <= (s.last - s.lo) / s.width {{first_in_bucket}}
)
SELECT i, step, value, time, min(priority) FROM candidates GROUP BY i, step ORDER BY i, step
"""

# A series' extremes per bucket on SQLite: one grouped pass per extreme, a series at a time with
# its bounds as constants (a join to the series rows makes each pass several times slower).
_BUCKET = ("CASE WHEN block * :block_steps <= :lo THEN 0 "
           "ELSE (block * CAST(:block_steps AS BIGINT) - :lo) / CAST(:width AS BIGINT) END")
_EXTREMES_SQLITE = " UNION ALL ".join(
    f"SELECT {select_}, {priority} FROM metric_blocks WHERE run_id = :run_id AND key = :key "
    f"AND {only} GROUP BY {_BUCKET}"
    for select_, only, priority in (
        ("min(min_value), min_step", "min_value IS NOT NULL", _MIN),
        ("max(max_value), max_step", "max_value IS NOT NULL", _MAX),
        ("0, min(nonfinite_step)", "nonfinite_step IS NOT NULL", _NONFINITE),
    )
)


def _kept_for_values_sqlite(
    db_session: Session, rows: list[tuple[int, int, str, int, int, int]]
) -> list[tuple[int, int, int]]:
    """(series number, step, priority) for the steps each bucket keeps for its values: the step
    of its lowest min and of its highest max (the earliest on ties) and its first non-finite
    step, folded from the per-block extremes (a million-point series has 15,625 blocks; one row
    per bucket comes back), and each series' last step. `rows` are (series number, run_id, key,
    first step, bucket width, last step); a block counts in the bucket of its first step."""
    wanted: dict[tuple[int, int], int] = {}
    conn = db_session.connection()
    for i, run_id, key, lo, width, last in rows:
        wanted[(i, last)] = _LAST
        bounds = {"run_id": run_id, "key": key, "lo": lo, "width": width, "block_steps": BLOCK_STEPS}
        for _, step, priority in conn.exec_driver_sql(_EXTREMES_SQLITE, bounds):
            if priority < wanted.get((i, step), _FIRST):
                wanted[(i, step)] = priority
    return [(i, step, priority) for (i, step), priority in wanted.items()]


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
