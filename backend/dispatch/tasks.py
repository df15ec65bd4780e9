"""Celery tasks. Each is idempotent: a re-delivered message changes nothing twice."""

from __future__ import annotations

import logging
from functools import lru_cache

from backend.db import Database
from backend.dispatch import service
from backend.dispatch.celery_app import celery
from backend.dispatch.ray_cluster import RayCluster, RayUnavailable
from backend.settings import get_settings

log = logging.getLogger(__name__)


@lru_cache
def _db() -> Database:
    return Database.from_settings(get_settings())


def _cluster() -> RayCluster:
    return RayCluster.from_settings(get_settings())


@celery.task(name="yatt.schedule", ignore_result=True)
def schedule_runs() -> list[int]:
    """Admit and launch whatever queued runs fit now."""
    try:
        with _cluster() as cluster:
            return service.schedule(db=_db(), cluster=cluster, settings=get_settings())
    except RayUnavailable as exc:  # the reconciler tries again every few seconds
        log.warning("schedule: %s", exc)
        return []


@celery.task(name="yatt.stop_run", ignore_result=True)
def stop_run(run_id: int) -> None:
    """Stop a cancelling run's Ray job (the reconciler then marks it cancelled)."""
    try:
        with _cluster() as cluster:
            service.stop(run_id=run_id, db=_db(), cluster=cluster)
    except RayUnavailable as exc:
        log.warning("stop run %s: %s", run_id, exc)


@celery.task(name="yatt.reconcile", ignore_result=True)
def reconcile() -> dict[int, str]:
    """One reconciliation pass (also run every few seconds by the worker's loop)."""
    try:
        with _cluster() as cluster:
            return service.reconcile(db=_db(), cluster=cluster, settings=get_settings()).moved
    except RayUnavailable as exc:
        log.warning("reconcile: %s", exc)
        return {}
