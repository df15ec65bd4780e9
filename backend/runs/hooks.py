"""How the dispatcher learns about new, retried and cancelled runs: `add_state_hook(fn)`
registers a callback that receives a `RunStateChange` after the transaction that made the
change commits (a new run is a change from `None` to `queued`). With no hook registered,
runs simply stay queued."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from backend.db import after_commit
from backend.runs.state import RunState

log = logging.getLogger(__name__)


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


def notify_after_commit(db_session: Session, change: RunStateChange) -> None:
    """Call every registered hook with `change` once `db_session` commits (never before)."""
    def notify() -> None:
        for hook in list(_state_hooks):
            try:
                hook(change)
            except Exception:  # one broken hook must not starve the others
                log.exception("state hook %r failed for %r", hook, change)

    after_commit(db_session, notify)
