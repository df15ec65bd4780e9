"""Listing runs (filters, sort by column, relevance or summary metric, keyset cursor) and
comparing a few side by side."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, null, or_, select
from sqlalchemy.orm import Session, aliased, load_only

from backend.metrics import service as metric_service
from backend.metrics.models import MetricSummary
from backend.metrics.sort_index import RunMetricValue
from backend.runs import search
from backend.runs.lifecycle import RunNotFound
from backend.runs.models import Experiment, Run, RunTag
from backend.runs.state import RunState


class InvalidQuery(ValueError):
    """A list query the service cannot answer (bad cursor or sort)."""


SORT_COLUMNS = {"created_at", "priority"}


RELEVANCE = "relevance"


METRIC_OPS = {">": "__gt__", ">=": "__ge__", "<": "__lt__", "<=": "__le__", "=": "__eq__"}


_METRIC_FILTER = re.compile(r"^(?P<key>.+?)(?P<op>>=|<=|>|<|=)(?P<value>[^<>=]+)$")


@dataclass
class RunQuery:
    """What `GET /runs` asks for. With `text` and no `sort`, the best matches come first."""

    states: list[RunState] = field(default_factory=list)
    experiment: str | None = None
    tags: list[str] = field(default_factory=list)
    launched_by: str | None = None
    text: str | None = None
    created_since: datetime | None = None
    created_until: datetime | None = None
    sort: str | None = None
    cursor: str | None = None
    limit: int = 50
    metric_keys: list[str] = field(default_factory=list)
    metric_filters: list[tuple[str, str, float]] = field(default_factory=list)


def parse_metric_filter(expression: str) -> tuple[str, str, float]:
    """`"reward/mean>=0.5"` → `("reward/mean", ">=", 0.5)`; raises InvalidQuery."""
    match = _METRIC_FILTER.match(expression.strip())
    try:
        if match is None:
            raise ValueError
        value = float(match["value"])
        if not math.isfinite(value):
            raise ValueError
    except ValueError:
        raise InvalidQuery(
            f"metric filter {expression!r} must read KEY OP NUMBER with OP one of > >= < <= ="
        ) from None
    return match["key"].strip(), match["op"], value


def _encode_cursor(sort: str, is_null: int, value: Any, run_id: int) -> str:
    raw = json.dumps([sort, is_null, value, run_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str, sort: str) -> tuple[int, Any, int]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        cur_sort, is_null, value, run_id = json.loads(raw)
    except (ValueError, binascii.Error, TypeError) as exc:
        raise InvalidQuery("cursor is not one this API returned") from exc
    if cur_sort != sort:
        raise InvalidQuery(f"cursor was made for sort={cur_sort!r}, not sort={sort!r}")
    # a tampered cursor must not reach the SQL: every part has the type and range we wrote
    number = (int, float)
    if (
        is_null not in (0, 1) or isinstance(is_null, bool)
        or not isinstance(run_id, int) or isinstance(run_id, bool) or not 0 <= run_id < 2**31
        or not (value is None or (isinstance(value, number) and not isinstance(value, bool)
                                  and math.isfinite(value) and abs(value) < 2**63))
    ):
        raise InvalidQuery("cursor is not one this API returned")
    return int(is_null), value, int(run_id)


# What a listing loads of each run: the History table's columns, not the config.
_LIST_COLUMNS = (
    Run.id, Run.project_id, Run.experiment_id, Run.name, Run.state, Run.attempt,
    Run.max_attempts, Run.priority, Run.launched_by, Run.launched_by_name, Run.ci, Run.summary,
    Run.created_at, Run.updated_at, Run.started_at, Run.finished_at,
)


def list_runs(
    *, db_session: Session, project_id: int, query: RunQuery
) -> tuple[list[Run], dict[int, dict[str, dict[str, Any]]], str | None, dict[int, float]]:
    """One page of a project's runs: (runs, {run_id: {key: summary}}, next cursor or None,
    {run_id: relevance score} when searching). Raises InvalidQuery.

    Every sort pages by keyset on (sort value, run id). A metric sort walks the metric sort
    index in the direction asked, then the runs without a value for the key (by id, in the
    same direction): missing values come last both ways."""
    sort = query.sort or ("-" + RELEVANCE if query.text else "-created_at")
    desc = sort.startswith("-")
    sort_key = sort.lstrip("-+")
    if not sort_key:
        raise InvalidQuery("sort must name a column, relevance or a metric key")
    dialect = db_session.get_bind().dialect.name

    base = select(Run).where(Run.project_id == project_id).options(load_only(*_LIST_COLUMNS))
    if query.states:
        base = base.where(Run.state.in_([s.value for s in query.states]))
    if query.experiment:
        base = base.where(
            Run.experiment_id.in_(
                select(Experiment.id).where(
                    Experiment.project_id == project_id, Experiment.name == query.experiment
                )
            )
        )
    for tag in query.tags:
        base = base.where(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
    if query.launched_by:
        base = base.where(Run.launched_by == query.launched_by)
    if query.created_since:
        base = base.where(Run.created_at >= query.created_since)
    if query.created_until:
        base = base.where(Run.created_at < query.created_until)
    for key, op, number in query.metric_filters:
        rmv = aliased(RunMetricValue)
        base = base.where(
            Run.id.in_(
                select(rmv.run_id).where(
                    rmv.project_id == project_id, rmv.key == key, getattr(rmv.value, METRIC_OPS[op])(number)
                )
            )
        )
    hits = None
    if query.text:
        try:
            hits = search.matches(dialect, query.text).subquery("hits")
        except ValueError as exc:
            raise InvalidQuery(f"q: {exc}") from None
        base = base.join(hits, hits.c.run_id == Run.id)

    def beyond(a: Any, b: Any) -> ColumnElement[bool]:
        return a < b if desc else a > b

    def ordered(expr: Any) -> Any:
        return expr.desc() if desc else expr.asc()

    cursor = _decode_cursor(query.cursor, sort) if query.cursor else None
    want = query.limit + 1
    rows: list[Any]
    if sort_key in SORT_COLUMNS or sort_key == RELEVANCE:
        if sort_key == RELEVANCE:
            if hits is None:
                raise InvalidQuery("sort=relevance needs a search text (q)")
            sort_expr: Any = hits.c.score
        else:
            sort_expr = Run.id if sort_key == "created_at" else Run.priority  # ids grow with time
        stmt = base.add_columns(sort_expr)
        if cursor is not None:
            _, value, last_id = cursor
            stmt = stmt.where(or_(beyond(sort_expr, value), and_(sort_expr == value, beyond(Run.id, last_id))))
        order = [ordered(sort_expr)] + ([ordered(Run.id)] if sort_key != "created_at" else [])
        rows = list(db_session.execute(stmt.order_by(*order).limit(want)).unique().all())
    else:
        rmv = aliased(RunMetricValue)
        has_value = and_(
            rmv.run_id == Run.id, rmv.project_id == project_id, rmv.key == sort_key, rmv.value.is_not(None)
        )
        rows = []
        if cursor is None or not cursor[0]:  # the runs with a value, unless the cursor is past them
            stmt = base.join(rmv, has_value).add_columns(rmv.value)
            if cursor is not None:
                _, value, last_id = cursor
                stmt = stmt.where(
                    or_(beyond(rmv.value, value), and_(rmv.value == value, beyond(rmv.run_id, last_id)))
                )
            # ordered by the index's own columns, so the planner walks it (SQLite sorts the
            # whole project when the tie-break names runs.id)
            stmt = stmt.order_by(ordered(rmv.value), ordered(rmv.run_id)).limit(want)
            rows = list(db_session.execute(stmt).unique().all())
        if len(rows) < want:  # then the runs without one
            missing = base.where(~exists().where(has_value)).add_columns(null())
            if cursor is not None and cursor[0]:
                missing = missing.where(beyond(Run.id, cursor[2]))
            missing = missing.order_by(ordered(Run.id)).limit(want - len(rows))
            rows += list(db_session.execute(missing).unique().all())

    next_cursor = None
    if len(rows) > query.limit:
        rows = rows[: query.limit]
        last_run, last_value = rows[-1][0], rows[-1][1]
        next_cursor = _encode_cursor(sort, int(last_value is None), last_value, last_run.id)
    runs: list[Run] = [row[0] for row in rows]
    scores = {row[0].id: float(row[1]) for row in rows} if sort_key == RELEVANCE else {}

    metric_sort = sort_key not in SORT_COLUMNS and sort_key != RELEVANCE
    keys = list(dict.fromkeys(query.metric_keys + ([sort_key] if metric_sort else [])))
    metrics: dict[int, dict[str, dict[str, Any]]] = {r.id: {} for r in runs}
    if keys and runs:
        for s in db_session.scalars(
            select(MetricSummary).where(
                MetricSummary.run_id.in_([r.id for r in runs]), MetricSummary.key.in_(keys)
            )
        ):
            metrics[s.run_id][s.key] = {"latest": s.latest, "min": s.min, "max": s.max, "step": s.latest_step}
    return runs, metrics, next_cursor, scores


MAX_COMPARE = 20


@dataclass
class ComparedRun:
    run: Run
    keys: list[str]
    series: dict[str, list[dict[str, Any]]]


def compare_runs(
    *, db_session: Session, project_id: int, run_ids: Sequence[int], keys: Sequence[str], max_points: int
) -> list[ComparedRun]:
    """Up to MAX_COMPARE runs in the order asked, each with its metric keys and the `keys`
    series it has, downsampled to `max_points`. Raises InvalidQuery, RunNotFound."""
    wanted = list(dict.fromkeys(run_ids))
    if not 1 <= len(wanted) <= MAX_COMPARE:
        raise InvalidQuery(f"runs: compare 1 to {MAX_COMPARE} runs, not {len(wanted)}")
    found = {
        r.id: r
        for r in db_session.scalars(select(Run).where(Run.project_id == project_id, Run.id.in_(wanted)))
    }
    missing = [i for i in wanted if i not in found]
    if missing:
        raise RunNotFound(f"run {', '.join(map(str, missing))} not found")
    keys_by_run: dict[int, list[str]] = {i: [] for i in wanted}
    for run_id, key in db_session.execute(
        select(MetricSummary.run_id, MetricSummary.key)
        .where(MetricSummary.run_id.in_(wanted))
        .order_by(MetricSummary.run_id, MetricSummary.key)
    ):
        keys_by_run[run_id].append(key)
    keys = list(dict.fromkeys(keys))
    have = {run_id: [k for k in keys if k in keys_by_run[run_id]] for run_id in wanted}
    series = metric_service.series_of_runs(  # every run's series in one go, not a round of queries per run
        db_session=db_session, keys_by_run={run_id: ks for run_id, ks in have.items() if ks}, max_points=max_points
    )
    return [ComparedRun(found[run_id], keys_by_run[run_id], series.get(run_id, {})) for run_id in wanted]
