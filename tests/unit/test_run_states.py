"""One definition of the state groups (backend/runs/state.py), read by the client and dashboard."""

from __future__ import annotations

from backend.client import TERMINAL_STATES
from backend.runs.state import (
    ACTIVE,
    CANCELLABLE,
    TERMINAL,
    TRANSITIONS,
    UNFINISHED,
    RunState,
    is_over,
)
from dashboard.tables import ACTIVE_STATES, CANCELLABLE_STATES, keeps_refreshing


def test_groups_follow_the_transition_table() -> None:
    assert TERMINAL == {s for s in RunState if not TRANSITIONS[s] or s is RunState.failed}
    assert UNFINISHED == set(RunState) - TERMINAL and ACTIVE < UNFINISHED
    assert CANCELLABLE == {RunState.queued, RunState.starting, RunState.running}
    assert TERMINAL_STATES == {"succeeded", "failed", "cancelled"}
    assert ACTIVE_STATES == {"queued", "starting", "running", "cancelling"}
    assert CANCELLABLE_STATES == {"queued", "starting", "running"}


def test_a_failed_attempt_with_attempts_left_keeps_live_views_going() -> None:
    assert not is_over("failed", 1, 3) and is_over("failed", 3, 3) and is_over("succeeded", 1, 3)
    assert keeps_refreshing({"state": "failed", "attempt": 1, "max_attempts": 2})
    assert not keeps_refreshing({"state": "failed", "attempt": 2, "max_attempts": 2})
    assert keeps_refreshing({"state": "queued"}) and not keeps_refreshing({"state": "cancelled"})
