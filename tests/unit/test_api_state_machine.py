"""The run state machine of DESIGN.md §2, move by move."""

from __future__ import annotations

import itertools

import pytest

from backend.runs.state import TRANSITIONS, IllegalTransition, RunState, check_transition

S = RunState
LEGAL = {
    (S.queued, S.starting), (S.queued, S.cancelling), (S.queued, S.cancelled), (S.queued, S.failed),
    (S.starting, S.running), (S.starting, S.cancelling), (S.starting, S.cancelled), (S.starting, S.failed),
    (S.running, S.succeeded), (S.running, S.failed), (S.running, S.cancelling),
    (S.failed, S.queued),
    (S.cancelling, S.cancelled),
}


@pytest.mark.parametrize(("current", "target"), list(itertools.product(RunState, RunState)))
def test_every_move(current: RunState, target: RunState) -> None:
    if (current, target) in LEGAL:
        check_transition(1, current, target)
    else:
        with pytest.raises(IllegalTransition) as err:
            check_transition(1, current, target)
        assert f"run 1 is {current.value}" in str(err.value)
        assert err.value.current is current and err.value.target is target


def test_final_states_have_no_way_out_but_retry() -> None:
    assert TRANSITIONS[S.succeeded] == TRANSITIONS[S.cancelled] == frozenset()
    assert TRANSITIONS[S.failed] == {S.queued}
    assert "none (final state)" in str(IllegalTransition(3, S.succeeded, S.running))


def test_strings_are_accepted_and_checked() -> None:
    check_transition(1, "queued", "starting")
    with pytest.raises(ValueError):
        check_transition(1, "queued", "exploded")
