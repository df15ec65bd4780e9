"""Experiments, runs, events and checkpoints. The one writer of `Run.state` is `transition`.

The dispatcher hooks in without HTTP: `add_state_hook(fn)` registers a callback that receives a
`RunStateChange` after the transaction that made the change commits (a new run is a change
from `None` to `queued`). With no hook registered, runs simply stay queued.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, bindparam, exists, func, null, or_, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, load_only

from backend.auth.service import Principal, revoke_run_tokens
from backend.db import after_commit, utcnow
from backend.metrics import service as metric_service
from backend.metrics.models import MetricSummary
from backend.metrics.sort_index import RunMetricValue
from backend.runs import search
from backend.runs.models import (
    AppliedEventBatch,
    Checkpoint,
    Experiment,
    Run,
    RunAttempt,
    RunEvent,
    RunTag,
)
from backend.runs.schemas import CheckpointIn, EventIn, RunCreate
from backend.runs.state import TERMINAL, IllegalTransition, RunState, check_transition
from trainer.config import parse_config
from trainer.placement.memory import check_memory

log = logging.getLogger(__name__)

__all__ = [
    "IdempotencyConflict",
    "IllegalTransition",
    "InvalidQuery",
    "RunNotFound",
    "RunQuery",
    "RunStateChange",
    "add_state_hook",
    "remove_state_hook",
    "create_run",
    "transition",
    "cancel",
    "retry",
]


class RunNotFound(LookupError):
    """No such run (or not in the caller's project)."""


class IdempotencyConflict(Exception):
    """An Idempotency-Key reused with a different request body."""


class InvalidQuery(ValueError):
    """A list query the service cannot answer (bad cursor or sort)."""


# --- hooks: how the dispatcher learns about new, retried and cancelled runs -------------------


@dataclass(frozen=True)
class RunStateChange:
    run_id: int
    project_id: int
    from_state: RunState | None
    to_state: RunState
    attempt: int
    reason: str | None = None
    priority: int = 0


StateHook = Callable[[RunStateChange], None]
_state_hooks: list[StateHook] = []


def add_state_hook(hook: StateHook) -> None:
    """Call `hook(change)` after every committed state change (idempotent registration)."""
    if hook not in _state_hooks:
        _state_hooks.append(hook)


def remove_state_hook(hook: StateHook) -> None:
    """Undo `add_state_hook`."""
    if hook in _state_hooks:
        _state_hooks.remove(hook)


def _notify_after_commit(db_session: Session, change: RunStateChange) -> None:
    def notify() -> None:
        for hook in list(_state_hooks):
            try:
                hook(change)
            except Exception:  # one broken hook must not starve the others
                log.exception("state hook %r failed for %r", hook, change)

    after_commit(db_session, notify)


# --- experiments ---------------------------------------------------------------------------------


def get_experiment_by_name(*, db_session: Session, project_id: int, name: str) -> Experiment | None:
    """A project's experiment by name."""
    return db_session.scalar(
        select(Experiment).where(Experiment.project_id == project_id, Experiment.name == name)
    )


def get_experiment(*, db_session: Session, project_id: int, experiment_id: int) -> Experiment | None:
    """A project's experiment by id."""
    exp = db_session.get(Experiment, experiment_id)
    return exp if exp is not None and exp.project_id == project_id else None


def create_experiment(
    *, db_session: Session, project_id: int, name: str, description: str = "", tags: Sequence[str] = ()
) -> Experiment:
    """A new experiment; raises IntegrityError if the name is taken in the project."""
    exp = Experiment(project_id=project_id, name=name, description=description, tags=list(tags))
    db_session.add(exp)
    db_session.flush()
    return exp


def get_or_create_experiment(*, db_session: Session, project_id: int, name: str) -> Experiment:
    """The project's experiment called `name`, created if needed (safe under concurrency)."""
    exp = get_experiment_by_name(db_session=db_session, project_id=project_id, name=name)
    if exp is not None:
        return exp
    try:
        with db_session.begin_nested():
            exp = create_experiment(db_session=db_session, project_id=project_id, name=name)
    except IntegrityError:
        exp = get_experiment_by_name(db_session=db_session, project_id=project_id, name=name)
        assert exp is not None
    return exp


def list_experiments(*, db_session: Session, project_id: int) -> list[Experiment]:
    """A project's experiments, oldest first, each with its stored `run_count`."""
    return list(
        db_session.scalars(
            select(Experiment).where(Experiment.project_id == project_id).order_by(Experiment.id)
        )
    )


# --- runs ----------------------------------------------------------------------------------------


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


def get(*, db_session: Session, project_id: int, run_id: int) -> Run | None:
    """A run in the project, or None (another project's run does not exist for the caller)."""
    run = db_session.get(Run, run_id)
    return run if run is not None and run.project_id == project_id else None


def get_any(*, db_session: Session, run_id: int) -> Run | None:
    """A run by id in any project: for the dispatcher, never for HTTP callers."""
    return db_session.get(Run, run_id)


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
    _add_state_event(db_session, run, None, RunState.queued, None)
    _notify_after_commit(
        db_session,
        RunStateChange(
            run.id, run.project_id, None, RunState.queued, run.attempt, priority=run.priority
        ),
    )
    return run, True


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


def _add_state_event(
    db_session: Session, run: Run, old: RunState | None, new: RunState, reason: str | None
) -> None:
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
    _add_state_event(db_session, run, current, target, reason)
    db_session.flush()
    _notify_after_commit(
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


# --- listing: filters, sort by column, relevance or summary metric, keyset cursor -----------

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


# --- events and checkpoints -----------------------------------------------------------------------


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


def add_checkpoint(*, db_session: Session, run: Run, checkpoint_in: CheckpointIn) -> Checkpoint:
    """Record a checkpoint the trainer saved."""
    ckpt = Checkpoint(
        run_id=run.id,
        attempt=run.attempt,
        step=checkpoint_in.step,
        path=checkpoint_in.path,
        size_bytes=checkpoint_in.size_bytes,
        metrics=checkpoint_in.metrics,
    )
    db_session.add(ckpt)
    db_session.add(
        RunEvent(
            run_id=run.id,
            attempt=run.attempt,
            kind="checkpoint",
            message=f"checkpoint at step {checkpoint_in.step}: {checkpoint_in.path}",
            data={"step": checkpoint_in.step, "path": checkpoint_in.path},
        )
    )
    db_session.flush()
    return ckpt


def list_checkpoints(*, db_session: Session, run_id: int) -> list[Checkpoint]:
    """A run's checkpoints, newest (highest step) last."""
    return list(
        db_session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step, Checkpoint.id)
        )
    )


def latest_checkpoint(*, db_session: Session, run_id: int) -> Checkpoint | None:
    """The resume point: the checkpoint with the highest step."""
    return db_session.scalar(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    )
