"""`yatt worker`: the Celery worker and the reconciler loop (`yatt up` lives in backend/local_stack.py)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

import typer

log = logging.getLogger("yatt.dispatch")


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)


def _reconcile_forever(stop: threading.Event, interval_s: float) -> None:
    from backend.dispatch import tasks

    while not stop.is_set():
        try:
            moved = tasks.reconcile()
            if moved:
                log.info("reconciler moved %s", moved)
        except Exception:  # keep the loop alive whatever one pass hit
            log.exception("reconcile pass failed")
        stop.wait(interval_s)


def worker(
    pool: str = typer.Option(None, help="solo or threads (never prefork: Ray and CUDA are not fork-safe)."),
    concurrency: int = typer.Option(None, help="Threads for the threads pool."),
    reconcile: bool = typer.Option(True, help="Run the reconciler loop in this process."),
) -> None:
    """Start the Celery worker that launches, watches and cancels runs on Ray."""
    from backend.dispatch import install_hooks
    from backend.dispatch.celery_app import QUEUES, celery
    from backend.dispatch.local_ray import ensure_head
    from backend.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    pool = pool or settings.worker_pool
    if pool not in ("solo", "threads"):
        raise typer.BadParameter("pool must be solo or threads", param_hint="--pool")
    head = ensure_head(settings, log_path=Path(settings.data_dir) / "ray-head.log")
    if head is not None:
        typer.echo(f"local Ray head: {head.dashboard_url} ({head.devices} devices)")
    install_hooks()
    stop = threading.Event()
    if reconcile:
        threading.Thread(
            target=_reconcile_forever, args=(stop, settings.reconcile_interval_s),
            name="yatt-reconciler", daemon=True,
        ).start()
    argv = [
        "worker", f"--pool={pool}", f"--concurrency={concurrency or settings.worker_concurrency}",
        f"--queues={','.join(QUEUES)}", "--loglevel=INFO", f"--hostname=yatt@{socket.gethostname()}-{os.getpid()}",
        "--without-gossip", "--without-mingle",
    ]
    try:
        celery.worker_main(argv)
    finally:
        stop.set()
