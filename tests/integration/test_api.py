"""The HTTP API against a live server, on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import httpx
import pytest

from backend.client import YattAPIError
from backend.runs import hooks, lifecycle
from backend.runs.hooks import RunStateChange
from tests.conftest import DATABASES, LiveAPI

pytestmark = pytest.mark.parametrize("live_api", DATABASES, indirect=True)

CONFIG = {"train": {"max_steps": 5, "batch_size": 4}, "placement": {"devices": 2}, "seed": 7}


def new_run(api: LiveAPI, **kw: Any) -> dict[str, Any]:
    return api.client.create_run(experiment=kw.pop("experiment", "exp"), config=kw.pop("config", CONFIG), **kw)


def http(api: LiveAPI, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token or api.token}"} if token != "" else {}
    return httpx.Client(base_url=api.url + "/api/v1", headers=headers, timeout=30)


def run_token(api: LiveAPI, run: dict[str, Any]) -> str:
    """A token for the run's current attempt, minted as the dispatcher does (the run's state unchanged)."""
    from backend.auth.service import create_run_token

    with api.database.session() as s:
        return create_run_token(db_session=s, project_id=run["project_id"], run_id=run["id"],
                                attempt=run["attempt"], ttl_s=600)


def test_posted_run_is_queued_listed_and_normalized(live_api: LiveAPI) -> None:
    run = new_run(live_api, tags=["b", "a", "a"], name="first", ci={"commit": "abc123", "branch": "main",
                  "pipeline_url": "https://ci/p/1"})
    assert run["state"] == "queued" and run["attempt"] == 1
    assert run["tags"] == ["a", "b"]
    assert run["launched_by"] == "ci" and run["ci"]["commit"] == "abc123"
    assert run["config"]["train"]["max_steps"] == 5
    assert run["config"]["rollout"]["engine"] == "vllm"  # defaults filled in
    assert run["seed"] == 7
    assert run["created_at"].endswith(("Z", "+00:00"))
    listed = live_api.client.list_runs()["items"]
    assert [r["id"] for r in listed] == [run["id"]]
    assert live_api.client.get_run(run["id"])["name"] == "first"
    assert [e["name"] for e in live_api.client.experiments()] == ["exp"]
    assert live_api.client.events(run["id"])[0]["kind"] == "state"


def test_bad_config_is_422_naming_the_field_and_stores_nothing(live_api: LiveAPI) -> None:
    bad = {"train": {"lr": -1}, "rollout": {"engin": "vllm"}}
    with http(live_api) as c:
        r = c.post("/runs", json={"experiment": "bad", "config": bad})
    assert r.status_code == 422
    paths = {e["path"] for e in r.json()["detail"]}
    assert paths == {"train.lr", "rollout.engin"}
    assert any(e["loc"] == ["body", "config", "train", "lr"] for e in r.json()["detail"])
    assert live_api.client.list_runs()["items"] == []
    assert live_api.client.experiments() == []
    with pytest.raises(YattAPIError) as err:
        live_api.client.validate_config({"placement": {"devices": 2, "rollout_devices": 3}})
    assert err.value.status == 422 and err.value.errors[0][0] == "placement"
    assert live_api.client.validate_config({})["algorithm"]["name"] == "grpo"


def test_tokens_401_403_and_project_isolation(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    with http(live_api, token="") as c:
        assert c.get("/runs").status_code == 401
        assert c.post("/runs", json={"experiment": "x"}).status_code == 401
    with http(live_api, token="yatt_not-a-token") as c:
        assert c.get(f"/runs/{run['id']}").status_code == 401
    other = live_api.client_for("admin", project=f"{live_api.project}-other")
    for call in (
        lambda: other.get_run(run["id"]),
        lambda: other.cancel_run(run["id"]),
        lambda: other.events(run["id"]),
    ):
        with pytest.raises(YattAPIError) as err:
            call()
        assert err.value.status == 404
    assert other.list_runs()["items"] == []
    for client in (other, live_api.client):  # telemetry needs the run's own token
        with pytest.raises(YattAPIError) as err:
            client.post_metrics(run["id"], [{"key": "a", "step": 0, "value": 1.0}])
        assert err.value.status == 403 and "run's own token" in err.value.message
    reader = live_api.client_for("read")
    assert reader.get_run(run["id"])["id"] == run["id"]
    with pytest.raises(YattAPIError) as err:
        reader.create_run(experiment="exp", config={})
    assert err.value.status == 403
    with pytest.raises(YattAPIError) as err:
        live_api.client_for("write").create_token("x", "read")
    assert err.value.status == 403
    # tokens: create, use, revoke
    created = live_api.client.create_token("ci", "write")
    with http(live_api, token=created["token"]) as c:
        assert c.get("/runs").status_code == 200
        live_api.client.revoke_token(created["id"])
        assert c.get("/runs").status_code == 401
    assert created["token"] not in json.dumps(live_api.client.tokens())
    assert live_api.client.whoami()["project"] == live_api.project


def test_run_token_writes_only_its_own_run(live_api: LiveAPI) -> None:
    mine, other = new_run(live_api, max_attempts=2), new_run(live_api)
    token = live_api.start_attempt(mine["id"])
    with http(live_api, token=token) as c:
        assert c.post(f"/runs/{mine['id']}/metrics", json={"points": [{"key": "a", "step": 1, "value": 2}]}).status_code == 200
        assert c.post(f"/runs/{other['id']}/metrics", json={"points": []}).status_code == 403
        assert c.get(f"/runs/{other['id']}").status_code == 404
        assert c.get("/runs").status_code == 403
        assert c.post("/runs", json={"experiment": "x"}).status_code == 403
        assert c.post(f"/runs/{mine['id']}/state", json={"state": "cancelled"}).status_code == 403
        # the attempt ends: its token dies with it, and the next attempt's token is another one
        assert c.post(f"/runs/{mine['id']}/state", json={"state": "failed", "reason": "oom"}).status_code == 200
        assert c.post(f"/runs/{mine['id']}/metrics", json={"points": []}).status_code == 401
        second = live_api.start_attempt(mine["id"])
        assert second != token
        assert c.post(f"/runs/{mine['id']}/events", json={"events": [{"kind": "eval"}]}).status_code == 401


def test_same_idempotency_key_gives_one_run(live_api: LiveAPI) -> None:
    first = new_run(live_api, idempotency_key="pipeline-812")
    with http(live_api) as c:
        again = c.post("/runs", json={"experiment": "exp", "config": CONFIG}, headers={"Idempotency-Key": "pipeline-812"})
        assert again.status_code == 200 and again.json()["id"] == first["id"]
        other_body = c.post("/runs", json={"experiment": "exp", "config": {}}, headers={"Idempotency-Key": "pipeline-812"})
        assert other_body.status_code == 409
    # concurrent retries of one request still make one run
    results: list[int] = []

    def post() -> None:
        results.append(new_run(live_api, idempotency_key="concurrent-1")["id"])

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    assert len(live_api.client.list_runs(limit=100)["items"]) == 2


def test_state_machine_over_http(live_api: LiveAPI) -> None:
    run = new_run(live_api, max_attempts=2)
    token = run_token(live_api, run)
    with http(live_api, token=token) as trainer:
        r = trainer.post(f"/runs/{run['id']}/state", json={"state": "succeeded"})
        assert r.status_code == 403 and "the run is queued" in r.json()["detail"]  # not launched yet
        with live_api.database.session() as s:  # the dispatcher moves it without HTTP
            lifecycle.transition(db_session=s, run_id=run["id"], to_state="starting")
        assert trainer.post(f"/runs/{run['id']}/state", json={"state": "running", "code_version": "abc"}).status_code == 200
        assert trainer.post(f"/runs/{run['id']}/state", json={"state": "running"}).status_code == 200  # retried report
        failed = trainer.post(f"/runs/{run['id']}/state", json={"state": "failed", "reason": "OOM at step 3"}).json()
    assert failed["state"] == "failed" and failed["error"] == "OOM at step 3" and failed["finished_at"]
    assert failed["code_version"] == "abc"
    retried = live_api.client.retry_run(run["id"])
    assert retried["state"] == "queued" and retried["attempt"] == 2 and retried["error"] is None
    attempts = live_api.client.attempts(run["id"])
    assert [(a["number"], a["state"], a["error"]) for a in attempts] == [(1, "failed", "OOM at step 3"), (2, "queued", None)]
    with pytest.raises(YattAPIError) as err:
        live_api.client.retry_run(run["id"])
    assert err.value.status == 409 and f"run {run['id']} is queued" in err.value.message
    assert live_api.client.cancel_run(run["id"])["state"] == "cancelled"
    assert live_api.client.cancel_run(run["id"])["state"] == "cancelled"  # idempotent
    with pytest.raises(YattAPIError) as err:
        live_api.client.retry_run(run["id"])
    assert err.value.status == 409 and "cancelled" in err.value.message
    states = [e["data"]["to"] for e in live_api.client.events(run["id"], kind="state")]
    assert states == ["queued", "starting", "running", "failed", "queued", "cancelled"]


def test_cancel_of_a_running_run_waits_for_the_dispatcher(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    with live_api.database.session() as s:
        lifecycle.transition(db_session=s, run_id=run["id"], to_state="starting")
        lifecycle.transition(db_session=s, run_id=run["id"], to_state="running")
    assert live_api.client.cancel_run(run["id"], reason="wrong lr")["state"] == "cancelling"
    with live_api.database.session() as s:
        lifecycle.transition(db_session=s, run_id=run["id"], to_state="cancelled")
    with pytest.raises(YattAPIError) as err:
        live_api.client.report_state(run["id"], "running")
    assert err.value.status == 409 and "is cancelled" in err.value.message


def test_state_hooks_fire_after_commit_with_the_row_visible(live_api: LiveAPI) -> None:
    seen: list[tuple[RunStateChange, str | None]] = []

    def hook(change: RunStateChange) -> None:
        with live_api.database.read_session() as s:  # another connection sees the committed row
            row = lifecycle.get_any(db_session=s, run_id=change.run_id)
            seen.append((change, row.state if row else None))

    hooks.add_state_hook(hook)
    try:
        run = new_run(live_api)
        with live_api.database.sessionmaker() as s:  # rolled back: no hook call
            lifecycle.transition(db_session=s, run_id=run["id"], to_state="starting")
            s.rollback()
        live_api.client.cancel_run(run["id"])
        with pytest.raises(YattAPIError):
            new_run(live_api, config={"seed": "x"})  # refused: no hook call
    finally:
        hooks.remove_state_hook(hook)
    mine = [(c.from_state, c.to_state, state) for c, state in seen if c.run_id == run["id"]]
    assert mine == [(None, "queued", "queued"), ("queued", "cancelled", "cancelled")]
    assert len(seen) == 2


def test_pagination_filters_and_sort_by_metric(live_api: LiveAPI) -> None:
    ids = []
    for i in range(7):
        run = new_run(live_api, experiment="a" if i % 2 else "b", tags=["even"] if i % 2 == 0 else [],
                      name=f"run-{i}", description="Sweep LR" if i == 3 else "")
        ids.append(run["id"])
        if i < 5:  # two runs never report the metric
            live_api.seed_metrics(run["id"], [{"key": "reward/mean", "step": 1, "value": [0.5, 0.1, 0.9, 0.1, 0.3][i]}])
    pages, cursor = [], None
    while True:
        page = live_api.client.list_runs(limit=3, cursor=cursor)
        pages.append([r["id"] for r in page["items"]])
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert pages == [ids[::-1][:3], ids[::-1][3:6], ids[::-1][6:]]
    assert [r["id"] for r in live_api.client.iter_runs(page_size=2, sort="created_at")] == ids
    by_reward = list(live_api.client.iter_runs(page_size=2, sort="-reward/mean"))
    assert [r["id"] for r in by_reward] == [ids[2], ids[0], ids[4], ids[3], ids[1], ids[6], ids[5]]
    assert by_reward[0]["metrics"]["reward/mean"]["latest"] == 0.9
    ascending = [r["id"] for r in live_api.client.iter_runs(page_size=3, sort="reward/mean")]
    assert ascending == [ids[1], ids[3], ids[4], ids[0], ids[2], ids[5], ids[6]]
    assert {r["id"] for r in live_api.client.iter_runs(experiment="a")} == {ids[1], ids[3], ids[5]}
    assert {r["id"] for r in live_api.client.iter_runs(tag=["even"])} == {ids[0], ids[2], ids[4], ids[6]}
    assert [r["id"] for r in live_api.client.iter_runs(q="sweep lr")] == [ids[3]]
    assert live_api.client.list_runs(launched_by="ci")["items"] == []
    live_api.client.cancel_run(ids[0])
    assert [r["id"] for r in live_api.client.iter_runs(state="cancelled")] == [ids[0]]
    future = "2999-01-01T00:00:00Z"
    assert live_api.client.list_runs(created_since=future)["items"] == []
    assert len(live_api.client.list_runs(created_until=future, limit=100)["items"]) == 7
    with http(live_api) as c:
        assert c.get("/runs", params={"cursor": "garbage"}).status_code == 422
        assert c.get("/runs", params={"state": "sleeping"}).status_code == 422
        mixed = c.get("/runs", params={"sort": "priority", "cursor": cursor or pages and
                      live_api.client.list_runs(limit=1)["next_cursor"]})
        assert mixed.status_code == 422


def test_ten_thousand_points_land_and_come_back_downsampled(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    points = [{"key": "loss", "step": i, "value": 1.0 / (i + 1), "time": 1e9 + i} for i in range(10_000)]
    with live_api.run_client(run["id"]) as trainer:
        assert trainer.post_metrics(run["id"], points) == 10_000
    full = live_api.client.metrics(run["id"], ["loss"], max_points=10_000)["loss"]  # the cap
    assert len(full) == 10_000 and full[123] == {"step": 123, "value": 1 / 124, "time": 1e9 + 123}
    sampled = live_api.client.metrics(run["id"], ["loss", "missing"], max_points=100)
    assert sampled["missing"] == []
    loss = sampled["loss"]
    assert 40 <= len(loss) <= 100
    steps = [p["step"] for p in loss]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 9_999
    assert max(b - a for a, b in zip(steps, steps[1:], strict=False)) <= 10_000 // 24 + 64  # every bucket
    assert all(p["value"] == 1.0 / (p["step"] + 1) for p in loss)  # real points, not made up
    keys = live_api.client.metric_keys(run["id"])
    assert keys == [{"key": "loss", "latest": 1 / 10_000, "latest_step": 9_999, "latest_time": 1e9 + 9_999,
                     "min": 1 / 10_000, "max": 1.0, "count": 10_000}]


def test_non_finite_values_are_stored_as_null(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    body = '{"points": [{"key": "kl", "step": 1, "value": 0.5, "time": 1.0},' \
           '{"key": "kl", "step": 2, "value": NaN, "time": 2.0},' \
           '{"key": "kl", "step": 3, "value": Infinity, "time": 3.0},' \
           '{"key": "kl", "step": 4, "value": "-inf", "time": 4.0},' \
           '{"key": "kl", "step": 5, "value": null, "time": 5.0}]}'
    token = live_api.start_attempt(run["id"])
    with http(live_api, token=token) as c:
        r = c.post(f"/runs/{run['id']}/metrics", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        series = c.get(f"/runs/{run['id']}/metrics").json()["series"]["kl"]
        bad = c.post(f"/runs/{run['id']}/metrics", json={"points": [{"step": 1, "value": 1.0}]})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["points", 0, "key"]
    assert [p["value"] for p in series] == [0.5, None, None, None, None]
    (summary,) = live_api.client.metric_keys(run["id"])
    assert summary["latest"] is None and summary["latest_step"] == 5
    assert summary["min"] == summary["max"] == 0.5 and summary["count"] == 5
    with http(live_api, token=token) as c:
        assert c.post(f"/runs/{run['id']}/metrics", json={"points": [{"key": "kl", "step": 6, "value": -2.0}]}).is_success
    (summary,) = live_api.client.metric_keys(run["id"])
    assert (summary["latest"], summary["min"], summary["max"]) == (-2.0, -2.0, 0.5)
    assert not any(isinstance(v, float) and math.isnan(v) for v in summary.values())


def test_oversized_requests_get_413(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    too_many = [{"key": "k", "step": i, "value": 0.0, "time": 0.0} for i in range(10_001)]
    with http(live_api) as c:
        r = c.post(f"/runs/{run['id']}/metrics", json={"points": too_many})
        assert r.status_code == 413 and "10000" in r.text
        huge = b'{"points": [' + b" " * (live_api.server.settings.max_body_bytes + 10) + b"]}"
        assert c.post(f"/runs/{run['id']}/metrics", content=huge,
                      headers={"Content-Type": "application/json"}).status_code == 413

        def chunks() -> Any:  # no Content-Length: the limit holds while streaming too
            for _ in range(40):
                yield b" " * 500_000

        assert c.post(f"/runs/{run['id']}/events", content=chunks(),
                      headers={"Content-Type": "application/json"}).status_code == 413
    assert live_api.client.metric_keys(run["id"]) == []


def test_events_and_checkpoints(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    spans = {"spans": [{"device": 0, "phase": "rollout", "start": 1.0, "end": 2.0, "step": 1}]}
    trainer = live_api.run_client(run["id"])
    assert trainer.post_events(run["id"], [
        {"kind": "placement", "message": "colocate", "data": {"mode": "colocate", "devices": 2}},
        {"kind": "phase_spans", "message": "", "data": spans, "time": 1764403200.0},
    ]) == 2
    phase = live_api.client.events(run["id"], kind="phase_spans")
    assert phase[0]["data"] == spans and phase[0]["time"].startswith("2025-11-29T08:00:00")
    trainer.post_checkpoint(run["id"], step=20, path="/ck/20", size_bytes=10, metrics={"reward/mean": 0.5})
    trainer.post_checkpoint(run["id"], step=10, path="/ck/10")
    trainer.close()
    assert [c["step"] for c in live_api.client.checkpoints(run["id"])] == [10, 20]
    kinds = [e["kind"] for e in live_api.client.events(run["id"])]
    assert kinds == ["state", "state", "state", "placement", "phase_spans", "checkpoint", "checkpoint"]
    with http(live_api, token=trainer.token) as c:
        assert c.post(f"/runs/{run['id']}/events", json={"events": [{"message": "no kind"}]}).status_code == 422
        assert c.post(f"/runs/{run['id']}/checkpoints", json={"step": -1, "path": "x"}).status_code == 422


def test_sse_stream_sends_state_metrics_events_and_ends(live_api: LiveAPI) -> None:
    run = new_run(live_api)
    received: list[tuple[str, Any]] = []
    ready = threading.Event()

    def listen() -> None:
        for event, data in live_api.client.stream(run["id"], timeout=30):
            received.append((event, data))
            ready.set()

    listener = threading.Thread(target=listen)
    listener.start()
    assert ready.wait(10)
    with live_api.run_client(run["id"]) as trainer:
        trainer.post_metrics(run["id"], [{"key": "reward/mean", "step": s, "value": s / 10} for s in range(3)])
        trainer.post_events(run["id"], [{"kind": "warning", "message": "slow sampler"}])
    time.sleep(0.3)
    with live_api.database.session() as s:
        lifecycle.transition(db_session=s, run_id=run["id"], to_state="succeeded")
    listener.join(15)
    assert not listener.is_alive(), "the stream must end when the run is final"
    assert received[0] == ("state", {"run_id": run["id"], "state": "queued", "attempt": 1, "error": None})
    points = [p for e, d in received if e == "metric" for p in d["points"]]
    assert [(p["key"], p["step"], p["value"]) for p in points] == [("reward/mean", s, s / 10) for s in range(3)]
    assert any(e == "event" and d["kind"] == "warning" for e, d in received)
    assert received[-1][0] == "state" and received[-1][1]["state"] == "succeeded"
    with http(live_api) as c:
        assert c.get(f"/runs/{run['id'] + 10_000}/stream").status_code == 404


def test_health_and_openapi(live_api: LiveAPI) -> None:
    with httpx.Client(base_url=live_api.url) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json() == {"status": "ready"}
        spec = c.get("/openapi.json").json()
    for path in ("/api/v1/runs", "/api/v1/runs/{run_id}/metrics", "/api/v1/runs/{run_id}/stream",
                 "/api/v1/runs/validate", "/api/v1/experiments", "/api/v1/tokens", "/api/v1/projects"):
        assert path in spec["paths"], path
    assert "examples" in json.dumps(spec["components"]["schemas"]["RunCreate"])


def test_concurrent_writers_do_not_trip_over_each_other(live_api: LiveAPI) -> None:
    """The API, the worker and several reporters write at once (SQLite: WAL + busy timeout)."""
    runs = [new_run(live_api) for _ in range(3)]
    errors: list[BaseException] = []

    def reporter(run: dict[str, Any]) -> None:
        try:
            with http(live_api, token=live_api.start_attempt(run["id"])) as c:
                for batch in range(10):
                    pts = [{"key": f"k{i % 4}", "step": batch * 100 + i, "value": float(i)} for i in range(400)]
                    assert c.post(f"/runs/{run['id']}/metrics", json={"points": pts}).status_code == 200
                    assert c.post(f"/runs/{run['id']}/events", json={"events": [{"kind": "eval"}]}).status_code == 200
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def dispatcher() -> None:
        try:
            for _ in range(10):
                new_run(live_api, experiment="other")
                with live_api.database.session() as s:
                    lifecycle.queued_runs(db_session=s)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reporter, args=(r,)) for r in runs] + [threading.Thread(target=dispatcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for run in runs:
        keys = live_api.client.metric_keys(run["id"])
        # batches overlap (batch b covers steps 100b..100b+399): one point per (key, step) stays
        assert sum(k["count"] for k in keys) == 1_300 and {k["latest_step"] for k in keys} == {1296, 1297, 1298, 1299}
        assert len(live_api.client.events(run["id"], kind="eval")) == 10
