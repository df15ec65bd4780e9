"""Bad input gets a 4xx naming what is wrong, never a 500, and stores nothing — on SQLite and
PostgreSQL. Also what the API shows to whom: `/cluster` across projects, `/readyz`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from backend.app import create_app
from backend.db import Database
from backend.settings import Settings
from tests.conftest import DATABASES, LiveAPI

pytestmark = pytest.mark.parametrize("live_api", DATABASES, indirect=True)

CONFIG = {"train": {"max_steps": 5, "batch_size": 4}, "placement": {"devices": 2}, "seed": 7}


def http(api: LiveAPI, token: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=api.url + "/api/v1", headers={"Authorization": f"Bearer {token or api.token}"}, timeout=60
    )


def trainer_http(api: LiveAPI, run_id: int) -> httpx.Client:
    """The run's trainer: telemetry is written only with the token of its running attempt."""
    return http(api, api.start_attempt(run_id))


def fields(response: httpx.Response) -> list[str]:
    """The field paths a 422 points at, without the location: `name`, `tags.0`, `events.0.kind`."""
    return [".".join(str(p) for p in e["loc"][1:]) for e in response.json()["detail"]]


def test_ids_beyond_the_column_range_are_422_not_500(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    with http(live_api) as c, trainer_http(live_api, run["id"]) as t:
        for big in (2**31, 2**63, 2**70):
            for path in (f"/runs/{big}", f"/runs/{big}/metrics", f"/runs/{big}/events",
                         f"/runs/{big}/stream", f"/runs/{big}/logs", f"/experiments/{big}"):
                r = c.get(path)
                assert r.status_code == 422 and "run_id" in r.text or "experiment_id" in r.text, (path, r.text)
            assert c.post(f"/runs/{big}/cancel").status_code == 422
            assert c.delete(f"/tokens/{big}").status_code == 422
        assert c.get(f"/runs/{2**31 - 1}").status_code == 404  # the largest id is a plain miss
        r = c.get(f"/runs/{run['id']}/events", params={"after_id": 2**64})
        assert r.status_code == 422 and fields(r) == ["after_id"]
        r = t.post(f"/runs/{run['id']}/checkpoints", json={"step": 2**53, "path": "/ck"})
        assert r.status_code == 422 and fields(r) == ["step"]
        r = t.post(f"/runs/{run['id']}/metrics", json={"points": [{"key": "k", "step": 2**63, "value": 1}]})
        assert r.status_code == 422 and "step" in r.text
    assert live_api.client.checkpoints(run["id"]) == []
    assert live_api.client.metric_keys(run["id"]) == []


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/experiments", {"name": "a\x00b"}, "name"),
        ("/runs", {"experiment": "e", "description": "x\x00"}, "description"),
        ("/runs", {"experiment": "e", "tags": ["t\x00"]}, "tags.0"),
        ("/runs", {"experiment": "e", "ci": {"commit": "\x00"}}, "ci.commit"),
        ("/runs", {"experiment": "e", "name": "\ud800"}, "name"),
        ("/tokens", {"name": "n\x00", "role": "read"}, "name"),
    ],
)
def test_unstorable_text_is_422_naming_the_field(live_api: LiveAPI, path: str, body: dict[str, Any], field: str) -> None:
    with http(live_api) as c:
        # json.dumps writes NUL as \u0000 and a lone surrogate as \ud800: valid JSON, unstorable text
        r = c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert fields(r) == [field] and "cannot be stored" in r.text
    assert live_api.client.list_runs()["items"] == []


def test_unstorable_text_in_events_metrics_and_queries_is_422(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    with http(live_api) as c, trainer_http(live_api, run["id"]) as t:
        r = t.post(f"/runs/{run['id']}/events", json={"events": [{"kind": "k\x00", "message": "m"}]})
        assert r.status_code == 422 and fields(r) == ["events.0.kind"]
        r = t.post(f"/runs/{run['id']}/events", json={"events": [{"kind": "warning", "message": "m\x00"}]})
        assert r.status_code == 422 and fields(r) == ["events.0.message"]
        r = t.post(f"/runs/{run['id']}/metrics", json={"points": [{"key": "k\x00", "step": 1, "value": 1}]})
        assert r.status_code == 422 and "key" in r.text
        for params in ({"q": "a\x00"}, {"experiment": "\x00"}, {"tag": "\x00"}, {"sort": "-a\x00"},
                       {"cursor": "\x00"}, {"metrics": "a\x00"}):
            r = c.get("/runs", params=params)
            assert r.status_code == 422 and fields(r)[0].split(".")[0] == next(iter(params)), (params, r.text)
        r = c.get(f"/runs/{run['id']}/metrics", params={"keys": "k\x00"})
        assert r.status_code == 422 and fields(r) == ["keys"]
        r = t.post(f"/runs/{run['id']}/checkpoints", json={"step": 1, "path": "/ck\x00"})
        assert r.status_code == 422 and fields(r) == ["path"]
    assert {e["kind"] for e in live_api.client.events(run["id"])} == {"state"}  # nothing else stored


def test_lengths_and_durations_match_the_columns(live_api: LiveAPI) -> None:
    with http(live_api) as c:
        r = c.post("/runs", json={"experiment": "e", "config": CONFIG, "tags": ["t" * 101]})
        assert r.status_code == 422 and "100" in r.text
        for value in (1e300, 10 * 366 * 24 * 3600.0):
            r = c.post("/tokens", json={"name": "ci", "role": "read", "expires_in_s": value})
            assert r.status_code == 422 and fields(r) == ["expires_in_s"], r.text
        assert c.post("/tokens", json={"name": "ci", "role": "read", "expires_in_s": 3600}).status_code == 201
        r = c.post("/runs", json={"experiment": "e", "config": CONFIG, "max_duration_s": 1e300})
        assert r.status_code == 422 and fields(r) == ["max_duration_s"]
        r = c.post("/runs", content=b'{"experiment": "e", "max_duration_s": Infinity}',
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 422
    assert live_api.client.list_runs()["items"] == []


def test_date_bounds_outside_the_utc_calendar_are_422_naming_them(live_api: LiveAPI) -> None:
    # found by the schemathesis run: a bound whose UTC time falls in year 0 was a 500 on PostgreSQL
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    with http(live_api) as c:
        for name, bound in (("created_since", "0001-01-01T00:01:00+01:02"),
                            ("created_until", "9999-12-31T23:59:00-01:00")):
            r = c.get("/runs", params={name: bound})
            assert r.status_code == 422 and name in r.json()["detail"], (name, r.text)
        # an offset bound in range is compared in UTC: 12:00+02:00 is 10:00 UTC
        since = c.get("/runs", params={"created_since": "2000-01-01T12:00:00+02:00"})
        until = c.get("/runs", params={"created_until": "2000-01-01T12:00:00+02:00"})
        assert since.status_code == 200 and [i["id"] for i in since.json()["items"]] == [run["id"]]
        assert until.status_code == 200 and until.json()["items"] == []


def test_config_seed_beyond_64_bits_is_422_naming_it(live_api: LiveAPI) -> None:
    with http(live_api) as c:
        r = c.post("/runs", json={"experiment": "e", "config": {**CONFIG, "seed": 2**64}})
        assert r.status_code == 422 and "seed" in r.text, r.text
    assert live_api.client.list_runs()["items"] == []


def test_tampered_cursor_is_422(live_api: LiveAPI) -> None:
    for _ in range(3):
        live_api.client.create_run(experiment="exp", config=CONFIG)
    cursor = live_api.client.list_runs(limit=1)["next_cursor"]
    assert cursor
    import base64

    def forged(*parts: Any) -> str:  # well-formed base64 JSON, wrong types or ranges inside
        return base64.urlsafe_b64encode(json.dumps(["-created_at", *parts]).encode()).decode()

    forgeries = [forged(0, "abc", 1), forged("a", 1, 1), forged(0, {"x": 1}, 1), forged(0, 1, 2**70),
                 forged(0, [1], 1), forged(2, 1, 1), forged(0, 1, "1"), forged(0, 2**80, 1)]
    with http(live_api) as c:
        for bad in (cursor[:-3] + "AAA", "x" * 40, "!!!", cursor[::-1], "W10", "WyJ4Il0", *forgeries):
            r = c.get("/runs", params={"limit": 1, "cursor": bad})
            assert r.status_code == 422, (bad, r.text)
            assert "cursor" in r.json()["detail"]


def test_fifty_megabyte_body_gets_a_readable_413(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    body = b'{"points": [' + b" " * (50 * 1024 * 1024) + b"]}"
    with http(live_api) as c:
        r = c.post(f"/runs/{run['id']}/metrics", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert "larger than" in r.json()["detail"]

        def chunks() -> Any:  # no Content-Length: the client streams 50 MB, the answer is still a 413
            for _ in range(50):
                yield b" " * (1024 * 1024)

        r = c.post(f"/runs/{run['id']}/events", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "larger than" in r.json()["detail"]
        assert c.get(f"/runs/{run['id']}").status_code == 200  # the connection is still usable


def test_openapi_defines_every_reference_and_an_example_on_every_body(live_api: LiveAPI) -> None:
    with httpx.Client(base_url=live_api.url) as c:
        spec = c.get("/openapi.json").json()
    text = json.dumps(spec)
    refs = {r.split('"')[0] for r in text.split('"$ref": "#/components/schemas/')[1:]}
    missing = refs - set(spec["components"]["schemas"])
    assert not missing, missing
    assert "MetricBatch" in refs
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody")
            if not body:
                continue
            schema = body["content"]["application/json"]["schema"]
            for option in schema.get("anyOf", [schema]):
                if "$ref" in option:
                    name = option["$ref"].rsplit("/", 1)[-1]
                    assert spec["components"]["schemas"][name].get("examples"), (method, path, name)
            for code in ("401", "404", "422"):
                assert code in op["responses"], (method, path, code)


def test_cluster_shows_other_projects_only_as_device_counts(live_api: LiveAPI) -> None:
    other = live_api.client_for("admin", project=f"{live_api.project}-other")
    theirs = other.create_run(experiment="secret-exp", name="secret-run", config=CONFIG)
    mine = live_api.client.create_run(experiment="exp", name="my-run", config=CONFIG)
    from backend.runs import lifecycle

    with live_api.database.session() as s:
        for run in (theirs, mine):
            lifecycle.transition(db_session=s, run_id=run["id"], to_state="starting")
        s.commit()
    view = live_api.client.cluster()
    assert [r["id"] for r in view["runs"]] == [mine["id"]] and view["runs"][0]["name"] == "my-run"
    assert view["other_projects"]["devices"] >= 2
    text = json.dumps(view)
    assert "secret" not in text and str(theirs["id"]) not in [str(r["id"]) for r in view["runs"]]
    assert view["queued"] == 0
    with live_api.database.session() as s:
        for run in (theirs, mine):
            lifecycle.transition(db_session=s, run_id=run["id"], to_state="failed", reason="test over")
        s.commit()
    other.close()


def test_cluster_shows_the_roles_on_each_device_of_own_runs_only(live_api: LiveAPI) -> None:
    other = live_api.client_for("admin", project=f"{live_api.project}-other")
    theirs = other.create_run(experiment="secret-exp", name="secret-run", config=CONFIG)
    mine = live_api.client.create_run(experiment="exp", name="my-run", config=CONFIG)
    colocate = {"mode": "colocate", "devices": 2, "train_devices": [0, 1],
                "local_sampler_devices": [0, 1], "rollout_devices": [], "reward_devices": []}
    split = {"mode": "disaggregated", "devices": 2, "train_devices": [0], "local_sampler_devices": [],
             "rollout_devices": [1], "reward_devices": [], "nodes": ["node-a", "node-b"]}
    decision = {"decision": "measured", "switch": False, "plan": "disaggregated 1+1"}  # no device lists
    with trainer_http(live_api, mine["id"]) as t:
        r = t.post(f"/runs/{mine['id']}/events", json={"events": [
            {"kind": "placement", "message": "colocate", "data": colocate},
            {"kind": "placement", "message": "switched", "data": split},
            {"kind": "placement", "message": "measured", "data": decision}]})
        assert r.status_code < 300, r.text
    with trainer_http(live_api, theirs["id"]) as t:
        r = t.post(f"/runs/{theirs['id']}/events", json={"events": [
            {"kind": "placement", "message": "x", "data": {**colocate, "nodes": ["secret-node"] * 2}}]})
        assert r.status_code < 300, r.text
    view = live_api.client.cluster()
    assert view["assignments"] == [
        {"device": 0, "node_id": "node-a", "roles": ["train"], "run_id": mine["id"], "run_name": "my-run"},
        {"device": 1, "node_id": "node-b", "roles": ["rollout"], "run_id": mine["id"], "run_name": "my-run"},
    ]
    assert [r["id"] for r in view["runs"]] == [mine["id"]] and "assignments" not in view["runs"][0]
    assert view["other_projects"]["devices"] >= 2
    text = json.dumps(view)
    assert "secret" not in text and all(a["run_id"] != theirs["id"] for a in view["assignments"])
    # the other project sees its own run's roles, and none of ours
    theirs_view = other.cluster()
    assert {(a["run_id"], a["node_id"]) for a in theirs_view["assignments"]} == {(theirs["id"], "secret-node")}
    assert [a["roles"] for a in theirs_view["assignments"]] == [["train", "rollout"], ["train", "rollout"]]
    assert "my-run" not in json.dumps(theirs_view)
    from backend.runs import lifecycle

    with live_api.database.session() as s:
        for run in (theirs, mine):
            lifecycle.transition(db_session=s, run_id=run["id"], to_state="failed", reason="test over")
        s.commit()
    assert all(a["run_id"] != mine["id"] for a in live_api.client.cluster()["assignments"])
    other.close()


def test_readyz_says_database_unavailable_and_no_more(live_api: LiveAPI, tmp_path: Any) -> None:
    from fastapi.testclient import TestClient

    secret = "postgresql+psycopg://yatt:hunter2@127.0.0.1:1/nowhere"
    app = create_app(Settings(data_dir=tmp_path, database_url=secret, dispatch=False), Database(secret))
    with TestClient(app) as c:
        r = c.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {"status": "unavailable", "detail": "database unavailable"}


def test_metric_reads_are_bounded_and_the_csv_export_has_every_point(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    pts = [{"key": "loss", "step": s, "value": float("nan") if s == 7 else s / 2, "time": 100.0 + s}
           for s in range(2500)]
    pts += [{"key": "acc", "step": s, "value": 1.0, "time": 1.0} for s in range(3)]
    with http(live_api) as c, trainer_http(live_api, run["id"]) as t:
        r = t.post(f"/runs/{run['id']}/metrics",
                   content=json.dumps({"points": pts}), headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        series = c.get(f"/runs/{run['id']}/metrics").json()["series"]  # no max_points: 1,000
        assert set(series) == {"acc", "loss"}
        assert len(series["loss"]) <= 1000 and series["loss"][-1]["step"] == 2499
        r = c.get(f"/runs/{run['id']}/metrics", params={"max_points": 10_001})
        assert r.status_code == 422 and fields(r) == ["max_points"]
        r = c.get(f"/runs/{run['id']}/metrics", params={"keys": ",".join(f"k{i}" for i in range(201))})
        assert r.status_code == 422 and "200" in r.text

    rows = b"".join(live_api.client.metrics_csv(run["id"])).decode().splitlines()
    assert rows[0] == "key,step,value,time" and len(rows) == 1 + 2503
    assert rows[1:4] == ["acc,0,1.0,1.0", "acc,1,1.0,1.0", "acc,2,1.0,1.0"]
    loss = [row.split(",") for row in rows[4:]]
    assert [int(s) for _, s, _, _ in loss] == list(range(2500))
    assert loss[7][2] == "" and loss[8][2] == "4.0"  # NaN stored as null: an empty cell
    only = b"".join(live_api.client.metrics_csv(run["id"], keys=["acc"])).decode().splitlines()
    assert len(only) == 4


def test_csv_export_pages_through_a_series_longer_than_a_page(live_api: LiveAPI, monkeypatch: Any) -> None:
    from backend.metrics import export

    monkeypatch.setattr(export, "PAGE", 100)  # the server runs in this process: pages of 100
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    live_api.seed_metrics(run["id"], [{"key": "loss", "step": s, "value": 1.0} for s in range(1050)])
    rows = b"".join(live_api.client.metrics_csv(run["id"])).decode().splitlines()
    assert [int(r.split(",")[1]) for r in rows[1:]] == list(range(1050))


def test_unstorable_text_inside_free_form_json_is_422(live_api: LiveAPI) -> None:
    run = live_api.client.create_run(experiment="exp", config=CONFIG)
    with http(live_api) as c, trainer_http(live_api, run["id"]) as t:
        bodies = [
            (f"/runs/{run['id']}/events", {"events": [{"kind": "warning", "data": {"a\x00": "b\x00\ud800"}}]}),
            (f"/runs/{run['id']}/checkpoints", {"step": 1, "path": "/ck", "metrics": {"x": "\x00"}}),
            ("/runs", {"experiment": "e", "config": {**CONFIG, "name": "\x00"}}),
            ("/runs", {"experiment": "e", "ci": {"extra": "\x00\ud800"}}),
            ("/runs/validate", {"config": {"model": {"path": "\x00"}}}),
        ]
        for path, body in bodies:
            poster = t if path.startswith(f"/runs/{run['id']}/") else c  # telemetry: the trainer's token
            r = poster.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and "cannot be stored" in r.text, (path, r.status_code, r.text)
        assert c.get(f"/runs/{run['id']}/events").status_code == 200
        assert c.get(f"/runs/{run['id']}/checkpoints").status_code == 200
        assert c.get("/runs").status_code == 200
