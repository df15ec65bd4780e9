"""The live stream of one run (`GET /runs/{id}/stream`), as Server-Sent Events on sse-starlette.

What a client can rely on:
- every event carries an `id:`; reconnecting with `Last-Event-ID` resumes after it, and a
  stream opened without one starts with the run's whole history (metric points and events),
  so there is no gap between "what I fetched" and "what is new";
- commit order is not id order on PostgreSQL (a transaction holding id 100 can commit after
  one holding id 101). Rows are therefore read from a *floor* that trails the newest row by a
  lag window: rows above the floor are re-read each poll and sent once, and the floor only
  passes a row once it has been seen for `LAG_S` seconds. After a resume, rows in that window
  may come again: `(key, step)` identifies a point, `id` an event;
- a point is sent again when it is overwritten (a resumed attempt repeats steps it reported, or
  a batch is resent without its id): the row takes a new id, so it comes again with its key,
  step and the `attempt` that wrote it. A client keeps one value per (key, step) and replaces
  the one it holds: the series never holds a step twice;
- the stream follows the run across retries (a `failed` attempt with attempts left is not the
  end; each new attempt is a `state` event) and ends after a final state has been sent.

A stream holds no database session between polls: each poll opens a read session, reads,
and closes it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from backend.db import Database
from backend.metrics.models import MetricPoint
from backend.runs import lifecycle
from backend.runs.models import Run, RunEvent
from backend.runs.schemas import EventOut
from backend.runs.state import is_over as state_is_over

LAG_S = 10.0  # how long a row may commit after a higher id became visible and still be sent
WINDOW_ROWS = 50_000  # at most this many ids are remembered above the floor
PAGE = 5_000  # rows per read; a full page is followed at once by the next read
PING_S = 15  # keep-alive comments for proxies that close idle connections

_EVENT_ID = re.compile(r"^(\d{1,19})-(\d{1,19})$")


class BadLastEventId(ValueError):
    """A Last-Event-ID this API did not send."""


def parse_event_id(value: str | None) -> tuple[int, int]:
    """(points floor, events floor) from a Last-Event-ID; (0, 0) for none."""
    if value is None or value.strip() == "":
        return 0, 0
    match = _EVENT_ID.match(value.strip())
    if match is None or max(int(match[1]), int(match[2])) > 2**63 - 1:
        raise BadLastEventId("Last-Event-ID is not one this stream sent (expected '<n>-<n>')")
    return int(match[1]), int(match[2])


@dataclass
class RowTail:
    """The rows of one run read by id, each handed out once, safe against late commits."""

    floor: int = 0
    lag_s: float = LAG_S
    seen: dict[int, float] = field(default_factory=dict)  # id above the floor -> first seen

    def take(self, rows: Sequence[Any]) -> list[Any]:
        """The rows not handed out before, in id order; then move the floor."""
        now = time.monotonic()
        fresh = [r for r in rows if r.id > self.floor and r.id not in self.seen]
        for r in fresh:
            self.seen[r.id] = now
        settled = [i for i, t in self.seen.items() if now - t >= self.lag_s]
        if len(self.seen) > WINDOW_ROWS:
            settled = sorted(self.seen)[: len(self.seen) - WINDOW_ROWS // 2] + settled
        if settled:
            self.floor = max(self.floor, max(settled))
            self.seen = {i: t for i, t in self.seen.items() if i > self.floor}
        return fresh


def point_rows_after(db_session: Session, run_id: int, floor: int, limit: int = PAGE) -> list[Any]:
    """A run's points with id > floor, in id order: plain rows (no ORM objects, a page is 5,000)."""
    mp = MetricPoint
    return list(
        db_session.execute(
            select(mp.id, mp.key, mp.step, mp.value, mp.time, mp.attempt)
            .where(mp.run_id == run_id, mp.id > floor).order_by(mp.id).limit(limit)
        )
    )


def event_rows_after(db_session: Session, run_id: int, floor: int, limit: int = PAGE) -> list[RunEvent]:
    """A run's events with id > floor, in id order."""
    return list(
        db_session.scalars(
            select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.id > floor).order_by(RunEvent.id).limit(limit)
        )
    )


def _sse(event: str, data: Any, event_id: str) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data, separators=(",", ":"), default=str), event=event, id=event_id)


def _point(p: Any) -> dict[str, Any]:
    return {"key": p.key, "step": p.step, "value": p.value, "time": p.time, "attempt": p.attempt}


def _state(run: Run) -> dict[str, Any]:
    return {"run_id": run.id, "state": run.state, "attempt": run.attempt, "error": run.error}


def is_over(run: Run) -> bool:
    """Final, and no retry will follow (a failed attempt with attempts left is not the end)."""
    return state_is_over(run.state, run.attempt, run.max_attempts)


@dataclass
class RunStream:
    """Where one client's stream is; `poll()` returns the events to send next."""

    db: Database
    run_id: int
    points: RowTail
    events: RowTail
    last_state: tuple[str, int] | None = None
    over: bool = False
    full_page: bool = False

    @classmethod
    def resume(cls, db: Database, run_id: int, last_event_id: str | None, lag_s: float = LAG_S) -> RunStream:
        point_floor, event_floor = parse_event_id(last_event_id)
        return cls(db, run_id, RowTail(point_floor, lag_s), RowTail(event_floor, lag_s))

    def event_id(self) -> str:
        return f"{self.points.floor}-{self.events.floor}"

    def poll(self) -> list[ServerSentEvent]:
        out: list[ServerSentEvent] = []
        with self.db.read_session() as s:
            # the state first: whatever committed before it is visible to the reads below
            run = lifecycle.get_any(db_session=s, run_id=self.run_id)
            if run is None:
                self.over = True
                return [_sse("state", {"run_id": self.run_id, "state": None, "deleted": True}, self.event_id())]
            point_rows = point_rows_after(s, self.run_id, self.points.floor)
            event_rows = event_rows_after(s, self.run_id, self.events.floor)
            new_points = self.points.take(point_rows)
            new_events = self.events.take(event_rows)
            self.full_page = len(point_rows) == PAGE or len(event_rows) == PAGE
            state = (run.state, run.attempt)
            first = self.last_state is None
            if first:  # a stream opens with the current state, before any history
                self.last_state = state
                out.append(_sse("state", _state(run), self.event_id()))
            if new_points:
                out.append(_sse("metric", {"points": [_point(p) for p in new_points]}, self.event_id()))
            for e in new_events:
                out.append(_sse("event", EventOut.model_validate(e).model_dump(mode="json"), self.event_id()))
            if state != self.last_state:
                self.last_state = state
                out.append(_sse("state", _state(run), self.event_id()))
            self.over = is_over(run) and not self.full_page
        return out


def response(
    *, db: Database, run_id: int, request: Request, last_event_id: str | None, poll_s: float,
    lag_s: float = LAG_S,
) -> EventSourceResponse:
    """The SSE response for `run_id` (the caller has checked that it may read the run)."""
    stream = RunStream.resume(db, run_id, last_event_id, lag_s)

    async def events() -> AsyncIterator[ServerSentEvent]:
        while True:
            for message in await run_in_threadpool(stream.poll):
                yield message
            if stream.over:
                return
            if not stream.full_page:
                await asyncio.sleep(poll_s)
            if await request.is_disconnected():
                return

    return EventSourceResponse(
        events(), ping=PING_S, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
