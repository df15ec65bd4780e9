"""Celery dispatch to Ray Jobs. `install_hooks()` connects the run service to the broker."""

from __future__ import annotations

import logging

from backend.runs.hooks import RunStateChange, add_state_hook
from backend.runs.state import RunState

log = logging.getLogger(__name__)


def enqueue_for_change(change: RunStateChange) -> None:
    """After a state change commits, send the task that acts on it (enqueue after commit)."""
    from backend.dispatch import tasks
    from backend.dispatch.celery_app import queue_for_priority

    if change.to_state is RunState.queued:
        queue = queue_for_priority(change.priority)
        tasks.schedule_runs.apply_async(queue=queue, retry=False)
    elif change.to_state is RunState.cancelling:
        tasks.stop_run.apply_async(args=[change.run_id], queue="yatt.high", retry=False)
    elif change.to_state is RunState.failed:
        tasks.reconcile.apply_async(queue="yatt.normal", retry=False)


def install_hooks() -> None:
    """Enqueue dispatch tasks after every committed state change that needs one."""
    add_state_hook(enqueue_for_change)
