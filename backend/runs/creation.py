"""Creating a run, once per Idempotency-Key (the key is scoped to the project; the
comparison ignores CI fields that change between retries of one pipeline)."""

from __future__ import annotations

import hashlib
import json

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend.auth.service import Principal
from backend.db import utcnow
from backend.runs.experiments import get_or_create_experiment
from backend.runs.hooks import RunStateChange, notify_after_commit
from backend.runs.lifecycle import add_state_event
from backend.runs.models import Run, RunAttempt, RunTag
from backend.runs.schemas import RunCreate
from backend.runs.state import RunState
from trainer.config import parse_config
from trainer.placement.memory import check_memory


class IdempotencyConflict(Exception):
    """An Idempotency-Key reused with a different request body."""


# CI facts that change when the same pipeline retries a job (GitLab gives a retried job a new
# id and URL, GitHub a new run attempt): stored on the run, left out of the comparison.
CI_RETRY_FIELDS = frozenset({"job", "job_id", "job_url", "run_attempt", "attempt", "runner", "started_at"})


def request_hash(run_in: RunCreate) -> str:
    """A stable fingerprint of a create request, to spot an Idempotency-Key reused for another
    request; CI fields a retried job changes (`CI_RETRY_FIELDS`) are not part of it."""
    data = run_in.model_dump(mode="json")
    if data.get("ci"):
        data["ci"] = {k: v for k, v in data["ci"].items() if k not in CI_RETRY_FIELDS}
    body = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _get_by_idempotency_key(*, db_session: Session, project_id: int, key: str) -> Run | None:
    return db_session.scalar(
        select(Run).where(Run.project_id == project_id, Run.idempotency_key == key)
    )


def create_run(
    *,
    db_session: Session,
    principal: Principal,
    run_in: RunCreate,
    idempotency_key: str | None = None,
) -> tuple[Run, bool]:
    """Validate the config and queue a run; returns (run, created). Raises ConfigError, IdempotencyConflict."""
    fingerprint = request_hash(run_in)
    if idempotency_key:
        existing = _get_by_idempotency_key(
            db_session=db_session, project_id=principal.project_id, key=idempotency_key
        )
        if existing is not None:
            if existing.request_hash != fingerprint:
                raise IdempotencyConflict(
                    f"Idempotency-Key {idempotency_key!r} was used for a different request "
                    f"(run {existing.id})"
                )
            return existing, False
    config = parse_config(run_in.config)  # raises ConfigError naming the field paths
    check_memory(config)  # a placement that cannot fit is refused before anything is stored
    exp = get_or_create_experiment(
        db_session=db_session, project_id=principal.project_id, name=run_in.experiment
    )
    now = utcnow()
    run = Run(
        project_id=principal.project_id,
        experiment_id=exp.id,
        name=run_in.name or "",
        description=run_in.description,
        config=config.model_dump(mode="json"),
        seed=config.seed,
        state=RunState.queued.value,
        attempt=1,
        max_attempts=run_in.max_attempts,
        priority=run_in.priority,
        max_duration_s=run_in.max_duration_s,
        launched_by="ci" if run_in.ci is not None else "user",
        launched_by_name=principal.token_name,
        ci=run_in.ci.model_dump(mode="json", exclude_none=True) if run_in.ci else None,
        idempotency_key=idempotency_key or None,
        request_hash=fingerprint,
        created_at=now,
        updated_at=now,
        tag_rows=[RunTag(tag=t) for t in sorted(set(run_in.tags))],
    )
    try:
        with db_session.begin_nested():
            db_session.add(run)
            db_session.flush()
    except IntegrityError:
        if not idempotency_key:
            raise
        # the same key arrived concurrently: the other request created the run
        existing = _get_by_idempotency_key(
            db_session=db_session, project_id=principal.project_id, key=idempotency_key
        )
        if existing is None:
            raise
        if existing.request_hash != fingerprint:
            raise IdempotencyConflict(
                f"Idempotency-Key {idempotency_key!r} was used for a different request"
            ) from None
        return existing, False
    if not run.name:
        run.name = f"{exp.name}-{run.id}"
    db_session.add(RunAttempt(run_id=run.id, number=1, created_at=now))
    add_state_event(db_session, run, None, RunState.queued, None)
    notify_after_commit(
        db_session,
        RunStateChange(
            run.id, run.project_id, None, RunState.queued, run.attempt, priority=run.priority
        ),
    )
    return run, True
