"""A run's timeline: events appended by the trainer (a batch id applied once) and read in order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import Session

from backend.db import utcnow
from backend.runs.models import AppliedEventBatch, Run, RunEvent
from backend.runs.schemas import EventIn


@dataclass(frozen=True)
class EventsAdded:
    """What one events post did: the events it stored, and whether the batch id was seen before."""

    accepted: int
    replayed: bool = False


# the same SQL on SQLite and PostgreSQL; a concurrent twin waits for the first to commit
_CLAIM_EVENT_BATCH = text(
    "INSERT INTO event_batches (run_id, batch_id, attempt, events, created_at) "
    "VALUES (:run_id, :batch_id, :attempt, :events, :created_at) ON CONFLICT DO NOTHING RETURNING batch_id"
).bindparams(bindparam("created_at", type_=AppliedEventBatch.__table__.c.created_at.type))


def add_events(
    *, db_session: Session, run: Run, events: Sequence[EventIn], batch_id: str | None = None
) -> EventsAdded:
    """Append timeline events to a run. A batch whose `batch_id` this run has already applied
    changes nothing (`replayed`, with the number of events it stored then)."""
    now = utcnow()
    if batch_id is not None:
        claimed = db_session.execute(
            _CLAIM_EVENT_BATCH,
            {"run_id": run.id, "batch_id": batch_id, "attempt": run.attempt, "events": len(events),
             "created_at": now},
        ).scalar()
        if claimed is None:
            stored = db_session.scalar(
                select(AppliedEventBatch.events).where(
                    AppliedEventBatch.run_id == run.id, AppliedEventBatch.batch_id == batch_id
                )
            )
            return EventsAdded(int(stored or 0), replayed=True)
    db_session.add_all(
        RunEvent(
            run_id=run.id,
            attempt=run.attempt,
            time=e.time or now,
            kind=e.kind,
            message=e.message,
            data=e.data,
        )
        for e in events
    )
    db_session.flush()
    return EventsAdded(len(events))


def list_events(
    *,
    db_session: Session,
    run_id: int,
    after_id: int = 0,
    kinds: Sequence[str] = (),
    limit: int = 1000,
) -> list[RunEvent]:
    """A run's events in order, after event id `after_id`."""
    stmt = select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.id > after_id)
    if kinds:
        stmt = stmt.where(RunEvent.kind.in_(list(kinds)))
    return list(db_session.scalars(stmt.order_by(RunEvent.id).limit(limit)))


def last_event_id(*, db_session: Session, run_id: int) -> int:
    """The id of the run's newest event (0 when it has none)."""
    return int(db_session.scalar(select(func.max(RunEvent.id)).where(RunEvent.run_id == run_id)) or 0)
