"""The Celery app: JSON only, late acks, prefetch 1, three priority queues.

The broker is `YATT_BROKER_URL`: by default kombu's SQLAlchemy transport on a SQLite file
under the data dir, Redis in production. Tasks never train: they talk to Ray's Jobs API.
"""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from kombu import Queue

from backend.settings import get_settings

QUEUES = ("yatt.high", "yatt.normal", "yatt.low")


def queue_for_priority(priority: int) -> str:
    """Runs with priority > 0 go to the high queue, < 0 to the low one."""
    return QUEUES[0] if priority > 0 else QUEUES[2] if priority < 0 else QUEUES[1]


def _transport_options(broker_url: str) -> dict[str, object]:
    # kombu's SQLAlchemy transport hands its options to create_engine(): give it none.
    if broker_url.startswith("sqla+"):
        return {}
    # Redis: an unacked message comes back after the visibility timeout (tasks are idempotent).
    return {"visibility_timeout": 3600}


def make_celery() -> Celery:
    settings = get_settings()
    if settings.broker_url.startswith("sqla+sqlite:///"):
        Path(settings.broker_url.removeprefix("sqla+sqlite:///")).parent.mkdir(
            parents=True, exist_ok=True
        )
    app = Celery("yatt", broker=settings.broker_url, include=["backend.dispatch.tasks"])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue="yatt.normal",
        broker_connection_retry_on_startup=True,
        broker_transport_options=_transport_options(settings.broker_url),
        worker_hijack_root_logger=False,
        enable_utc=True,
    )
    return app


celery = make_celery()
