"""A run's metric points as CSV, streamed page by page (`GET /runs/{id}/metrics.csv`).

Each page is read in its own short read session by keyset (key, step, id), so a series of any
length is exported with bounded memory and no session held while the client reads."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import and_, or_, select

from backend.db import Database
from backend.metrics.models import MetricPoint

PAGE = 10_000
HEADER = ("key", "step", "value", "time")


def _page(db: Database, run_id: int, keys: Sequence[str], after: tuple[str, int, int] | None) -> list[Any]:
    mp = MetricPoint
    stmt = select(mp.key, mp.step, mp.id, mp.value, mp.time).where(mp.run_id == run_id)
    if keys:
        stmt = stmt.where(mp.key.in_(list(keys)))
    if after is not None:
        key, step, point_id = after
        stmt = stmt.where(
            or_(
                mp.key > key,
                and_(mp.key == key, mp.step > step),
                and_(mp.key == key, mp.step == step, mp.id > point_id),
            )
        )
    with db.read_session() as s:
        return list(s.execute(stmt.order_by(mp.key, mp.step, mp.id).limit(PAGE)))


def csv_pages(db: Database, run_id: int, keys: Sequence[str] = ()) -> Iterator[str]:
    """The header, then one CSV chunk per page of points in (key, step) order; an empty value
    is a point stored as non-finite."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(HEADER)
    yield buffer.getvalue()
    after: tuple[str, int, int] | None = None
    while True:
        rows = _page(db, run_id, keys, after)
        if not rows:
            return
        buffer.seek(0)
        buffer.truncate()
        for key, step, _, value, time in rows:
            writer.writerow((key, step, "" if value is None else repr(value), repr(time)))
        yield buffer.getvalue()
        last = rows[-1]
        after = (last[0], last[1], last[2])
        if len(rows) < PAGE:
            return
