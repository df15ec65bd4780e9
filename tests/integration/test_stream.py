"""The run's SSE stream (backend/runs/stream.py) against a live API on SQLite and PostgreSQL:
ids on every event, Last-Event-ID resume, history first (no gap), late commits on PostgreSQL,
retries followed to the end."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from backend.metrics.models import MetricPoint
from backend.runs import events, lifecycle
from backend.runs.models import Run
from backend.runs.schemas import EventIn
from backend.runs.stream import RowTail
from tests.conftest import DATABASES, LiveAPI

# serial: runs alone, after the tests that run side by side (`make test`); it asserts
# on a stream that answers within 5 s
pytestmark = pytest.mark.serial

CONFIG = {"train": {"max_steps": 5, "batch_size": 4}, "placement": {"devices": 2}, "seed": 7}


def points(n0: int, n1: int, key: str = "loss") -> list[dict[str, Any]]:
    return [{"key": key, "step": s, "value": s / 10, "time": 1.0} for s in range(n0, n1)]


class Listener:
    """Reads a run's stream in a thread, keeping (id, event, data) triples."""

    def __init__(self, api: LiveAPI, run_id: int, last_event_id: str | None = None):
        self.received: list[tuple[str | None, str, Any]] = []
        self.client = api.client_for("read")
        self.thread = threading.Thread(target=self._run, args=(run_id, last_event_id), daemon=True)
        self.thread.start()

    def _run(self, run_id: int, last_event_id: str | None) -> None:
        for message in self.client.stream_with_ids(run_id, timeout=30, last_event_id=last_event_id):
            self.received.append(message)

    def steps(self, key: str = "loss") -> list[int]:
        return [p["step"] for _, e, d in self.received if e == "metric" for p in d["points"] if p["key"] == key]

    def wait(self, predicate: Any, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, self.received[-5:]
            time.sleep(0.05)


def finish(api: LiveAPI, run_id: int, *states: str) -> None:
    with api.database.session() as s:
        for state in states:
            lifecycle.transition(db_session=s, run_id=run_id, to_state=state, reason="test")
        s.commit()


def test_row_tail_sends_a_late_commit_below_the_newest_id() -> None:
    tail = RowTail(floor=0, lag_s=60)
    row = lambda i: SimpleNamespace(id=i)  # noqa: E731
    assert [r.id for r in tail.take([row(1), row(3)])] == [1, 3]
    assert [r.id for r in tail.take([row(1), row(2), row(3)])] == [2]  # id 2 committed late
    assert tail.take([row(1), row(2), row(3)]) == []
    settled = RowTail(floor=0, lag_s=0)
    settled.take([row(1), row(3)])
    assert settled.floor == 3 and settled.take([row(2)]) == []  # no lag: the floor passed it


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_every_event_has_an_id_history_comes_first_and_resume_continues(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    live_api.seed_metrics(run["id"], points(0, 5))  # before anyone listens
    first = Listener(live_api, run["id"])
    first.wait(lambda: first.steps() == list(range(5)))
    live_api.seed_metrics(run["id"], points(5, 8))
    first.wait(lambda: first.steps() == list(range(8)))
    assert first.received[0][1] == "state" and first.received[0][2]["state"] == "queued"
    assert all(event_id for event_id, _, _ in first.received)
    resume_at = first.received[-1][0]
    finish(live_api, run["id"], "starting", "running")
    first.wait(lambda: any(d.get("state") == "running" for _, e, d in first.received if e == "state"))

    live_api.seed_metrics(run["id"], points(8, 12))
    with live_api.database.session() as s:  # what the trainer's token would post
        events.add_events(db_session=s, run=s.get(Run, run["id"]),
                               events=[EventIn(kind="warning", message="after the break")])
    second = Listener(live_api, run["id"], last_event_id=resume_at)
    finish(live_api, run["id"], "succeeded")
    second.thread.join(20)
    first.thread.join(20)
    assert not second.thread.is_alive() and not first.thread.is_alive(), "streams end on a final state"
    resumed = second.steps()
    assert set(range(8, 12)) <= set(resumed)  # nothing lost across the break
    if live_api.database.dialect == "sqlite":
        assert resumed == list(range(8, 12))  # and nothing repeated where commits follow ids
    else:  # PostgreSQL: the lag window may send recent points again, never lose one
        assert set(resumed) <= set(range(12))
    assert any(e == "event" and d["message"] == "after the break" for _, e, d in second.received)
    assert [d["state"] for _, e, d in second.received if e == "state"][-1] == "succeeded"


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_stream_follows_a_run_across_its_retry(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG, max_attempts=2)
    listener = Listener(live_api, run["id"])
    listener.wait(lambda: bool(listener.received))
    finish(live_api, run["id"], "starting", "running", "failed")
    time.sleep(1.0)
    assert listener.thread.is_alive(), "a failed attempt with attempts left is not the end"
    with live_api.database.session() as s:
        lifecycle.retry(db_session=s, run_id=run["id"], reason="retry")
        s.commit()
    live_api.seed_metrics(run["id"], points(0, 3, key="attempt2/loss"))
    finish(live_api, run["id"], "starting", "running", "succeeded")
    listener.thread.join(20)
    assert not listener.thread.is_alive()
    states = [(d["state"], d["attempt"]) for _, e, d in listener.received if e == "state"]
    assert ("failed", 1) in states and ("succeeded", 2) == states[-1]
    assert listener.steps("attempt2/loss") == [0, 1, 2]


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_a_step_a_resumed_attempt_overwrites_is_sent_again_and_replaces_the_old_value(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG, max_attempts=2)
    listener = Listener(live_api, run["id"])
    first = live_api.run_client(run["id"])
    first.post_metrics(run["id"], points(0, 10), batch_id="a1-0")
    listener.wait(lambda: sorted(listener.steps()) == list(range(10)))
    finish(live_api, run["id"], "failed")
    second = live_api.run_client(run["id"])  # attempt 2 resumes from step 5 with other values
    second.post_metrics(run["id"], [{**p, "value": p["value"] + 100} for p in points(5, 15)], batch_id="a2-0")
    sent = lambda: [(p["step"], p["attempt"]) for _, e, d in listener.received if e == "metric" for p in d["points"]]  # noqa: E731
    listener.wait(lambda: {(s, 2) for s in range(5, 15)} <= set(sent()))
    finish(live_api, run["id"], "succeeded")
    listener.thread.join(20)
    assert not listener.thread.is_alive()

    # each overwritten step came once per attempt, the rewrite marked with the attempt that wrote it
    assert sorted(s for s, _ in sent() if 5 <= s < 10) == sorted(list(range(5, 10)) * 2)
    assert [a for s, a in sent() if 5 <= s < 10][-5:] == [2] * 5
    # a client keeping one value per (key, step) ends with exactly what the API stores
    held: dict[int, float] = {}
    for _, e, d in listener.received:
        if e == "metric":
            held.update({p["step"]: p["value"] for p in d["points"]})
    stored = live_api.client.metrics(run["id"], ["loss"], max_points=100)["loss"]
    assert held == {p["step"]: p["value"] for p in stored}
    assert len(stored) == 15 and held[5] == pytest.approx(100.5) and held[4] == pytest.approx(0.4)


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_tampered_last_event_id_is_422(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    with httpx.Client(base_url=live_api.url + "/api/v1",
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        for bad in ("abc", "1-", "-1-2", "99999999999999999999-1", "1-2-3"):
            r = c.get(f"/runs/{run['id']}/stream", headers={"Last-Event-ID": bad})
            assert r.status_code == 422 and "Last-Event-ID" in r.text, bad


@pytest.mark.postgres
@pytest.mark.parametrize("live_api", ["postgresql"], indirect=True)
def test_a_point_that_commits_after_a_higher_id_is_still_sent(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    listener = Listener(live_api, run["id"])
    listener.wait(lambda: bool(listener.received))
    slow = live_api.database.sessionmaker()
    try:
        slow.add(MetricPoint(run_id=run["id"], key="loss", step=1, value=0.1, time=1.0))
        slow.flush()  # takes its id now, commits later
        live_api.seed_metrics(run["id"], points(2, 4))  # higher ids, committed first
        listener.wait(lambda: listener.steps() == [2, 3])
        slow.commit()
    finally:
        slow.close()
    listener.wait(lambda: sorted(listener.steps()) == [1, 2, 3])
    finish(live_api, run["id"], "cancelled")
    listener.thread.join(20)
    assert not listener.thread.is_alive()


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_logs_tail_with_follow_on_a_finished_attempt_sends_the_tail_and_ends(live_api: LiveAPI) -> None:
    from backend.db import utcnow
    from backend.dispatch.models import RunLog

    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    with live_api.database.session() as s:
        s.add(RunLog(run_id=run["id"], attempt=1, text="".join(f"step {i}\n" for i in range(50)),
                     updated_at=utcnow()))
        lifecycle.transition(db_session=s, run_id=run["id"], to_state="failed", reason="test")
        s.commit()
    with httpx.Client(base_url=live_api.url + "/api/v1", timeout=10,
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        r = c.get(f"/runs/{run['id']}/logs", params={"tail": 2, "follow": True})
        assert r.status_code == 200 and r.text == "step 48\nstep 49\n"
        assert c.get(f"/runs/{run['id']}/logs", params={"tail": 1}).text == "step 49\n"
        assert c.get(f"/runs/{run['id']}/logs", params={"attempt": 2}).status_code == 404


@pytest.mark.parametrize("live_api", DATABASES, indirect=True)
def test_following_an_earlier_attempt_of_a_retried_run_ends_with_that_attempt(live_api: LiveAPI) -> None:
    from backend.db import utcnow
    from backend.dispatch.models import RunLog

    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    live_api.start_attempt(run["id"])
    with live_api.database.session() as s:
        lifecycle.transition(db_session=s, run_id=run["id"], to_state="failed", reason="test")
        s.add(RunLog(run_id=run["id"], attempt=1, text="attempt 1 died\n", updated_at=utcnow()))
        s.commit()
    live_api.start_attempt(run["id"])  # attempt 2 runs: the run is not final, attempt 1 is
    with httpx.Client(base_url=live_api.url + "/api/v1", timeout=10,
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        started = time.monotonic()
        r = c.get(f"/runs/{run['id']}/logs", params={"attempt": 1, "follow": True})
        assert r.status_code == 200 and r.text == "attempt 1 died\n"
        assert time.monotonic() - started < 5  # not polled until the run ends
