"""The run state machine of DESIGN.md §2. Every change of `Run.state` is checked here."""

from __future__ import annotations

import enum


class RunState(enum.StrEnum):
    queued = "queued"
    starting = "starting"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"


S = RunState

# The only legal moves; anything else is refused (HTTP 409).
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.queued: frozenset({S.starting, S.cancelling, S.cancelled, S.failed}),
    S.starting: frozenset({S.running, S.cancelling, S.cancelled, S.failed}),
    S.running: frozenset({S.succeeded, S.failed, S.cancelling}),
    S.failed: frozenset({S.queued}),  # retry: attempt += 1, resume from the newest checkpoint
    S.cancelling: frozenset({S.cancelled}),
    S.succeeded: frozenset(),
    S.cancelled: frozenset(),
}

# The one definition of these groups: the backend, the client (`backend.client`) and the
# dashboard (`dashboard.tables`) all read them from here. This module imports nothing else.
TERMINAL: frozenset[RunState] = frozenset({S.succeeded, S.failed, S.cancelled})
ACTIVE: frozenset[RunState] = frozenset({S.starting, S.running, S.cancelling})  # holds devices
UNFINISHED: frozenset[RunState] = frozenset(RunState) - TERMINAL  # queued or active
CANCELLABLE: frozenset[RunState] = frozenset(s for s, moves in TRANSITIONS.items() if S.cancelling in moves)


def retry_pending(state: RunState | str, attempt: int, max_attempts: int) -> bool:
    """A failed attempt with attempts left: the dispatcher will queue the run again."""
    return RunState(state) is S.failed and attempt < max_attempts


def is_over(state: RunState | str, attempt: int, max_attempts: int) -> bool:
    """Final, with no retry to come: live views stop here."""
    return RunState(state) in TERMINAL and not retry_pending(state, attempt, max_attempts)


class IllegalTransition(Exception):
    """A move the state machine does not allow; the message names the current state."""

    def __init__(self, run_id: int, current: RunState, target: RunState):
        self.run_id, self.current, self.target = run_id, current, target
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none (final state)"
        super().__init__(
            f"run {run_id} is {current.value}: cannot move to {target.value} "
            f"(allowed from {current.value}: {allowed})"
        )


def check_transition(run_id: int, current: RunState | str, target: RunState | str) -> None:
    """Raise IllegalTransition unless `current -> target` is a legal move."""
    current, target = RunState(current), RunState(target)
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(run_id, current, target)
