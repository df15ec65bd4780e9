"""A run's life: reading one, its attempts, state changes (`transition` is the one writer
of `Run.state`), cancel and retry, and the queries the dispatcher drives runs by."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.auth.service import revoke_run_tokens
from backend.db import utcnow
from backend.runs.hooks import RunStateChange, notify_after_commit
from backend.runs.models import Run, RunAttempt, RunEvent
from backend.runs.state import TERMINAL, RunState, check_transition


class RunNotFound(LookupError):
    """No such run (or not in the caller's project)."""


def get(*, db_session: Session, project_id: int, run_id: int) -> Run | None:
    """A run in the project, or None (another project's run does not exist for the caller)."""
    run = db_session.get(Run, run_id)
    return run if run is not None and run.project_id == project_id else None


def get_any(*, db_session: Session, run_id: int) -> Run | None:
    """A run by id in any project: for the dispatcher, never for HTTP callers."""
    return db_session.get(Run, run_id)


def current_attempt(*, db_session: Session, run: Run) -> RunAttempt | None:
    """The attempt row of the run's current attempt."""
    return db_session.scalar(
        select(RunAttempt).where(RunAttempt.run_id == run.id, RunAttempt.number == run.attempt)
    )


def list_attempts(*, db_session: Session, run_id: int) -> list[RunAttempt]:
    """A run's attempts, first first."""
    return list(
        db_session.scalars(
            select(RunAttempt).where(RunAttempt.run_id == run_id).order_by(RunAttempt.number)
        )
    )


def set_attempt_submission(*, db_session: Session, run_id: int, attempt: int, submission_id: str) -> None:
    """Record the Ray job submission id of an attempt (the dispatcher's idempotency handle)."""
    row = db_session.scalar(
        select(RunAttempt).where(RunAttempt.run_id == run_id, RunAttempt.number == attempt)
    )
    if row is None:
        raise RunNotFound(f"run {run_id} has no attempt {attempt}")
    row.submission_id = submission_id


def add_state_event(
    db_session: Session, run: Run, old: RunState | None, new: RunState, reason: str | None
) -> None:
    """Record a state change on the run's timeline."""
    message = f"{old.value} → {new.value}" if old else new.value
    if reason:
        message += f": {reason}"
    db_session.add(
        RunEvent(
            run_id=run.id,
            attempt=run.attempt,
            kind="state",
            message=message,
            data={"from": old.value if old else None, "to": new.value, "reason": reason},
        )
    )


def _locked_run(db_session: Session, run_id: int, project_id: int | None) -> Run:
    """The run, row-locked until the transaction ends (FOR UPDATE on PostgreSQL; on SQLite a
    write transaction already holds the database lock)."""
    run = db_session.execute(
        select(Run)
        .where(Run.id == run_id)
        .with_for_update(of=Run)
        .execution_options(populate_existing=True)
    ).scalar_one_or_none()
    if run is None or (project_id is not None and run.project_id != project_id):
        raise RunNotFound(f"run {run_id} not found")
    return run


def transition(
    *,
    db_session: Session,
    run_id: int,
    to_state: RunState | str,
    reason: str | None = None,
    summary: dict[str, Any] | None = None,
    allow_same: bool = False,
    project_id: int | None = None,
) -> Run:
    """Move a run to `to_state` if the state machine allows it; raises IllegalTransition, RunNotFound.

    The row is locked for the check (FOR UPDATE on PostgreSQL; SQLite write transactions
    hold the database lock), so concurrent moves are serialized. With `allow_same`, asking
    for the current state is a no-op, so a retried report does not fail.
    """
    target = RunState(to_state)
    run = _locked_run(db_session, run_id, project_id)
    current = RunState(run.state)
    if allow_same and current is target:
        return run
    check_transition(run.id, current, target)
    now = utcnow()
    attempt = current_attempt(db_session=db_session, run=run)
    run.state = target.value
    run.updated_at = now
    if summary:
        run.summary = {**(run.summary or {}), **summary}
    if target is RunState.running:
        run.started_at = run.started_at or now
        if attempt is not None:
            attempt.started_at = attempt.started_at or now
    if target is RunState.queued:  # retry
        run.attempt += 1
        run.finished_at = None
        run.error = None
        db_session.add(RunAttempt(run_id=run.id, number=run.attempt, created_at=now))
    if target in TERMINAL:
        run.finished_at = now
        revoke_run_tokens(db_session=db_session, run_id=run.id)  # the attempt's token dies with it
        if target is RunState.failed:
            run.error = reason or run.error or "failed"
    if attempt is not None and target is not RunState.queued:
        attempt.state = target.value
        if target in TERMINAL:
            attempt.finished_at = now
            if target is RunState.failed:
                attempt.error = run.error
    add_state_event(db_session, run, current, target, reason)
    db_session.flush()
    notify_after_commit(
        db_session,
        RunStateChange(
            run.id, run.project_id, current, target, run.attempt, reason, priority=run.priority
        ),
    )
    return run


def cancel(*, db_session: Session, run_id: int, project_id: int | None = None, reason: str | None = None) -> Run:
    """Cancel a run: a queued run is cancelled at once, a started one goes to `cancelling`.

    Cancelling a run that is already cancelling or cancelled returns it unchanged.
    """
    run = _locked_run(db_session, run_id, project_id)  # decide on the state nobody else can change
    if run.state in (RunState.cancelling, RunState.cancelled):
        return run
    # a queued run has nothing to stop; a started one may own a Ray job the dispatcher must stop
    target = RunState.cancelled if run.state == RunState.queued else RunState.cancelling
    return transition(
        db_session=db_session, run_id=run_id, to_state=target, reason=reason or "cancelled by user"
    )


def can_retry(run: Run) -> bool:
    """Whether the dispatcher may retry a failed run on its own (attempts left)."""
    return run.state == RunState.failed and run.attempt < run.max_attempts


def retry(*, db_session: Session, run_id: int, project_id: int | None = None, reason: str | None = None) -> Run:
    """Queue a failed run again (attempt += 1; the trainer resumes from the newest checkpoint)."""
    return transition(
        db_session=db_session,
        run_id=run_id,
        to_state=RunState.queued,
        reason=reason or "retry",
        project_id=project_id,
    )


def record_environment(
    *,
    db_session: Session,
    run: Run,
    code_version: str | None = None,
    package_versions: dict[str, Any] | None = None,
    run_dir: str | None = None,
) -> None:
    """Remember what a run ran with (set by the trainer or the dispatcher)."""
    if code_version is not None:
        run.code_version = code_version
    if package_versions is not None:
        run.package_versions = package_versions
    if run_dir is not None:
        run.run_dir = run_dir
    run.updated_at = utcnow()


def queued_runs(*, db_session: Session, limit: int = 100) -> list[Run]:
    """Queued runs of every project, highest priority first, then oldest: the dispatch order."""
    return list(
        db_session.scalars(
            select(Run)
            .where(Run.state == RunState.queued.value)
            .order_by(Run.priority.desc(), Run.id)
            .limit(limit)
        )
    )


def runs_in_states(*, db_session: Session, states: Sequence[RunState]) -> list[Run]:
    """Runs of every project in any of `states` (for the reconciler)."""
    return list(
        db_session.scalars(
            select(Run).where(Run.state.in_([s.value for s in states])).order_by(Run.id)
        )
    )
