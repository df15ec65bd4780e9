"""The run page's refreshes fetch only what is new (dashboard/live.py), against a live API."""

from __future__ import annotations

import pytest

from dashboard.live import LiveSeries
from tests.conftest import DATABASES, LiveAPI

pytestmark = pytest.mark.parametrize("live_api", DATABASES, indirect=True)


def post(api: LiveAPI, run_id: int, steps: range) -> None:
    for start in range(steps.start, steps.stop, 5000):
        api.seed_metrics(run_id, [{"key": "loss", "step": s, "value": s / 2, "time": 1.0}
                                         for s in range(start, min(steps.stop, start + 5000))])


def refresh(api: LiveAPI, live: LiveSeries, run_id: int, attempt: int = 1) -> list[int]:
    summaries = {k["key"]: k for k in api.client.metric_keys(run_id)}
    return [p["step"] for p in live.refresh(api.client, run_id, ["loss"], summaries, attempt)["loss"]]


def test_each_refresh_fetches_only_the_new_steps(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config={})
    live = LiveSeries(max_points=100)
    post(live_api, run["id"], range(0, 60))
    assert refresh(live_api, live, run["id"]) == list(range(60))
    assert (live.requests, live.points_fetched) == (1, 60)

    post(live_api, run["id"], range(60, 65))
    assert refresh(live_api, live, run["id"]) == list(range(65))
    assert (live.requests, live.points_fetched) == (2, 65)  # five new points, one request

    assert refresh(live_api, live, run["id"]) == list(range(65))
    assert live.requests == 2  # nothing new: no request at all

    post(live_api, run["id"], range(65, 5000))  # a long gap: fetched downsampled again
    steps = refresh(live_api, live, run["id"])
    assert len(steps) <= 100 and steps[0] == 0 and steps[-1] == 4999

    before = live.requests
    assert refresh(live_api, live, run["id"], attempt=2)[-1] == 4999  # a new attempt: all again
    assert live.requests == before + 1


def test_the_log_tab_reads_only_what_was_appended(live_api: LiveAPI) -> None:
    import httpx

    from backend.db import utcnow
    from backend.dispatch.models import RunLog
    from dashboard.live import LiveLog

    run = live_api.client.create_run(experiment="exp", config={})

    def store(text: str) -> None:
        with live_api.database.session() as s:
            row = s.get(RunLog, (run["id"], 1))
            if row is None:
                s.add(RunLog(run_id=run["id"], attempt=1, text=text, updated_at=utcnow()))
            else:
                row.text = text
            s.commit()

    store("".join(f"line {i}\n" for i in range(300)))
    log = LiveLog(keep_lines=200)
    text = log.refresh(live_api.client, run["id"], attempt=1)
    assert text.splitlines()[0] == "line 100" and text.splitlines()[-1] == "line 299"
    full = "".join(f"line {i}\n" for i in range(300))
    assert log.length == len(full)

    store(full + "line 300\n")
    with httpx.Client(base_url=live_api.url + "/api/v1",
                      headers={"Authorization": f"Bearer {live_api.token}"}) as c:
        r = c.get(f"/runs/{run['id']}/logs", params={"offset": len(full)})
        assert r.text == "line 300\n" and r.headers["Log-Length"] == str(len(full) + 9)
    text = log.refresh(live_api.client, run["id"], attempt=1)
    assert text.splitlines()[-1] == "line 300" and len(text.splitlines()) == 200
    assert log.requests == 2  # one read each refresh: the tail, then only the new line

    store("restarted\n")  # a shorter copy than the one read so far: start over from its tail
    assert log.refresh(live_api.client, run["id"], attempt=1) == "restarted\n"
