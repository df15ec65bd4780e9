"""Celery dispatch to Ray Jobs. `install_hooks()` connects the run service to the broker."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from backend.runs.hooks import RunStateChange, add_state_hook
from backend.runs.state import RunState

log = logging.getLogger(__name__)


class BackgroundPublisher:
    """Sends broker messages from one background thread, so a request never waits for the broker.

    With the broker down, one publish blocks for seconds (redis-py retries its connect with
    backoff): an API request must not. A message already waiting is not queued twice, because
    every dispatch task is a kick that the reconciler repeats anyway: a lost one costs a few
    seconds, never a run."""

    def __init__(self) -> None:
        self._pending: dict[Hashable, Callable[[], object]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, key: Hashable, send: Callable[[], object]) -> None:
        """Call `send()` soon on the publisher's thread, unless a message with `key` still waits."""
        with self._lock:
            self._pending.setdefault(key, send)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="yatt-broker-publisher", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    if not self._pending:
                        break
                    key = next(iter(self._pending))
                    send = self._pending.pop(key)
                try:
                    send()
                except Exception as exc:  # the reconciler re-drives whatever this message would have
                    log.warning("could not publish %s to the broker: %s", key, exc)


publisher = BackgroundPublisher()


def enqueue_for_change(change: RunStateChange) -> None:
    """After a state change commits, send the task that acts on it (enqueue after commit)."""
    from backend.dispatch import tasks
    from backend.dispatch.celery_app import queue_for_priority

    if change.to_state is RunState.queued:
        queue = queue_for_priority(change.priority)
        publisher.publish(("schedule", queue), lambda: tasks.schedule_runs.apply_async(queue=queue, retry=False))
    elif change.to_state is RunState.cancelling:
        run_id = change.run_id
        publisher.publish(("stop", run_id), lambda: tasks.stop_run.apply_async(
            args=[run_id], queue="yatt.high", retry=False))
    elif change.to_state is RunState.failed:
        publisher.publish(("reconcile",), lambda: tasks.reconcile.apply_async(queue="yatt.normal", retry=False))


def install_hooks() -> None:
    """Enqueue dispatch tasks after every committed state change that needs one."""
    add_state_hook(enqueue_for_change)
