"""Every dashboard page under Streamlit's AppTest, against a real API seeded with runs in every
state (and one with 200,000 metric points) on the local PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from streamlit.testing.v1 import AppTest

from backend.client import YattClient
from tests.conftest import long_context_model, start_api
from tests.dashboard_fixtures import SeededApi, seed_project

pytestmark = pytest.mark.postgres

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
TIMEOUT = 60


@pytest.fixture(scope="module")
def api(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededApi]:
    """The live API of tests/conftest.py on the session's PostgreSQL, one seeded project."""
    server = start_api(postgres_url, tmp_path_factory.mktemp("dash-api"))
    try:
        yield seed_project(server)
    finally:
        server.stop()


@pytest.fixture
def client(api: SeededApi) -> Iterator[YattClient]:
    with YattClient(api.url, api.token) as c:
        yield c


@pytest.fixture
def as_admin(api: SeededApi, monkeypatch: pytest.MonkeyPatch) -> SeededApi:
    monkeypatch.setenv("YATT_API_URL", api.url)
    monkeypatch.setenv("YATT_TOKEN", api.token)
    return api


def _app() -> AppTest:
    return AppTest.from_file(str(APP), default_timeout=TIMEOUT)


def _open(page: str, **query: str) -> AppTest:
    """The app on one of its pages (a path under dashboard/), with query parameters."""
    at = _app()
    at.run()
    at.switch_page(page)
    at.query_params.update(query)
    at.run()
    _no_exception(at)
    return at


def _no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def _charts(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def _texts(at: AppTest) -> str:
    parts = [el.value for kind in ("markdown", "caption", "error", "warning", "info", "success")
             for el in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


# --- History ---------------------------------------------------------------------------------


def test_history_lists_runs_and_filters_them(as_admin: SeededApi) -> None:
    at = _app()
    at.run()
    _no_exception(at)
    assert at.title[0].value == "History"
    table = at.dataframe[0].value
    assert set(as_admin.runs.values()) <= set(table["id"])
    assert set(table["state"]) >= {"running", "succeeded", "failed", "cancelled"}
    ci_row = table[table["id"] == as_admin.runs["failed"]].iloc[0]
    assert ci_row["launched by"] == "CI 3f2a9c1e (main)"
    assert ci_row["pipeline"] == "https://ci.example/p/812"

    at.multiselect(key="f_state").set_value(["failed"]).run()
    assert list(at.dataframe[0].value["id"]) == [as_admin.runs["failed"]]
    at.multiselect(key="f_state").set_value([]).run()

    at.selectbox(key="f_who").set_value("ci").run()
    assert list(at.dataframe[0].value["id"]) == [as_admin.runs["failed"]]
    at.selectbox(key="f_who").set_value("anyone").run()

    at.text_input(key="f_tag").set_value("baseline").run()
    assert set(at.dataframe[0].value["id"]) == {as_admin.runs["succeeded"],
                                                as_admin.runs["running"]}
    at.text_input(key="f_tag").set_value("").run()

    at.selectbox(key="f_experiment").set_value("dash-big").run()
    assert list(at.dataframe[0].value["id"]) == [as_admin.runs["big"]]
    at.selectbox(key="f_experiment").set_value(None).run()

    at.text_input(key="f_q").set_value("cancel").run()
    assert list(at.dataframe[0].value["id"]) == [as_admin.runs["cancelled"]]
    at.selectbox(key="f_sort").set_value("best match").run()
    assert list(at.dataframe[0].value["id"]) == [as_admin.runs["cancelled"]]
    at.text_input(key="f_q").set_value("").run()  # nothing to rank: newest first
    ids = list(at.dataframe[0].value["id"])
    assert len(ids) >= len(as_admin.runs) and ids == sorted(ids, reverse=True)
    at.selectbox(key="f_sort").set_value("newest first").run()
    _no_exception(at)


def test_history_sorts_by_a_summary_metric_and_pages(as_admin: SeededApi) -> None:
    at = _app()
    at.run()
    at.selectbox(key="f_sort").set_value("summary metric").run()
    at.text_input(key="f_metric").set_value("reward/mean").run()
    table = at.dataframe[0].value
    with_metric = table[table["reward/mean"].notna()]
    assert list(with_metric["reward/mean"]) == sorted(with_metric["reward/mean"], reverse=True)
    assert with_metric.iloc[0]["id"] == as_admin.runs["big"]  # reward near 1.0 at the end
    # runs without the metric come last
    assert table["reward/mean"].isna().tolist() == sorted(table["reward/mean"].isna().tolist())

    at.selectbox(key="f_sort").set_value("oldest first").run()
    assert list(at.dataframe[0].value["id"]) == sorted(as_admin.runs.values())[:25]


def test_history_pages_through_a_long_history(as_admin: SeededApi, client: YattClient) -> None:
    for i in range(26):  # more than one page of 25
        client.create_run(experiment="dash-paging", name=f"page-{i}", config={})
    at = _app()
    at.run()
    at.selectbox(key="f_experiment").set_value("dash-paging").run()
    first = list(at.dataframe[0].value["id"])
    assert len(first) == 25
    at.button(key="h_next").click().run()
    second = list(at.dataframe[0].value["id"])
    assert len(second) == 1 and second[0] < min(first)
    at.button(key="h_prev").click().run()
    assert list(at.dataframe[0].value["id"]) == first


def test_history_opens_the_chosen_run(as_admin: SeededApi) -> None:
    at = _app()
    at.run()
    at.selectbox(key="f_experiment").set_value("dash-seed").run()
    at.selectbox(key="h_open").set_value(as_admin.runs["succeeded"]).run()
    _no_exception(at)
    assert at.title[0].value == f"#{as_admin.runs['succeeded']} succeeded"
    assert at.query_params["run"] == str(as_admin.runs["succeeded"])


# --- Run page ----------------------------------------------------------------------------------


def test_running_run_page_shows_live_charts_timeline_and_cancel(as_admin: SeededApi) -> None:
    at = _open("views/run.py", run=str(as_admin.runs["running"]))
    assert at.title[0].value == f"#{as_admin.runs['running']} running"
    titles = [c["layout"]["title"]["text"] for c in _charts(at)]
    for expected in ("Throughput (tokens/s)", "Throughput (samples/s)", "Device utilization",
                     "Device memory", "Reward", "KL", "Losses", "Response length",
                     "Dynamic sampling ratios"):
        assert expected in titles
    util = next(c for c in _charts(at) if c["layout"]["title"]["text"] == "Device utilization")
    assert [t["name"] for t in util["data"]] == ["device 0", "device 1"]
    assert len(util["data"][0]["y"]) == 12  # every step the seed reported
    gantt = next(c for c in _charts(at) if c["data"] and c["data"][0].get("orientation") == "h")
    assert [t["name"] for t in gantt["data"]] == ["rollout", "reward", "train", "weight_sync"]
    assert {m.label for m in at.metric} >= {"step", "tokens/s", "reward"}
    assert [b.label for b in at.button] == ["Cancel run"]
    assert "refreshing every 2 s" in _texts(at)
    events = at.dataframe[1].value  # [0] is the phase share table
    assert {"placement", "checkpoint", "state"} <= set(events["kind"])


def test_big_run_page_asks_for_downsampled_series(as_admin: SeededApi) -> None:
    started = time.monotonic()
    at = _open("views/run.py", run=str(as_admin.runs["big"]))
    took = time.monotonic() - started
    charts = _charts(at)
    assert {c["layout"]["title"]["text"] for c in charts} == {"Throughput (tokens/s)", "Reward"}
    for chart in charts:
        assert 2 <= len(chart["data"][0]["x"]) <= 800
        assert chart["data"][0]["x"][-1] == 99_999  # the last point is kept
    assert took < 30, f"the 200,000-point run page took {took:.1f}s"


def test_metrics_csv_download_holds_every_point(as_admin: SeededApi, client: YattClient) -> None:
    from dashboard import api

    text = api.metrics_csv(client, as_admin.runs["big"]).decode()
    lines = text.splitlines()
    assert lines[0] == "key,step,value,time"
    assert len(lines) == 1 + 200_000  # every point, over several pages of the streamed export
    steps = [int(line.split(",")[1]) for line in lines[1:] if line.startswith(lines[1].split(",")[0] + ",")]
    assert steps == sorted(steps)


def test_failed_run_shows_its_error_and_retries(as_admin: SeededApi, client: YattClient) -> None:
    run = client.create_run(experiment="dash-retry", name="to-retry", config={})
    client.report_state(run["id"], "starting")
    client.report_state(run["id"], "failed", reason="worker lost")
    at = _open("views/run.py", run=str(run["id"]))
    assert any("worker lost" in e.value for e in at.error)
    assert [b.label for b in at.button] == ["Retry run"]
    at.button(key="retry").click().run()
    _no_exception(at)
    after = client.get_run(run["id"])
    assert after["state"] == "queued" and after["attempt"] == 2


def test_cancel_button_cancels_a_queued_run(as_admin: SeededApi, client: YattClient) -> None:
    run = client.create_run(experiment="dash-cancel", name="to-cancel", config={})
    at = _open("views/run.py", run=str(run["id"]))
    at.button(key="cancel").click().run()
    _no_exception(at)
    assert client.get_run(run["id"])["state"] == "cancelled"
    assert at.title[0].value == f"#{run['id']} to-cancel"
    assert "Cancel run" not in [b.label for b in at.button]


def test_finished_runs_have_no_timer_and_no_cancel(as_admin: SeededApi) -> None:
    for role in ("succeeded", "cancelled"):
        at = _open("views/run.py", run=str(as_admin.runs[role]))
        assert "refreshing every" not in _texts(at)
        assert "Cancel run" not in [b.label for b in at.button]
    at = _open("views/run.py", run=str(as_admin.runs["succeeded"]))
    [ckpts] = [d.value for d in at.dataframe if "path" in d.value.columns]
    assert list(ckpts["step"]) == [29]


def test_run_page_without_a_run_offers_a_picker_and_unknown_runs_are_explained(
    as_admin: SeededApi,
) -> None:
    at = _open("views/run.py")
    assert at.selectbox[0].label == "Open a run"
    at = _open("views/run.py", run="999999")
    assert any("404" in e.value and "999999" in e.value for e in at.error)


# --- Launch ------------------------------------------------------------------------------------


def test_launch_shows_field_errors_then_submits_and_lands_on_the_run(
    as_admin: SeededApi, client: YattClient
) -> None:
    at = _open("views/launch.py")
    at.selectbox(key="l_source").set_value("paste YAML").run()
    at.text_area(key="l_yaml_paste").set_value(
        "train:\n  max_steps: 3\nrollout:\n  temperature: -1\n"
    ).run()
    steps = next(w for w in at.number_input if w.label == "Steps")
    assert steps.value == 3  # the form starts from the YAML
    steps.set_value(0)
    at.button[0].click().run()  # Validate
    _no_exception(at)
    errors = [e.value for e in at.error]
    assert "Input should be greater than or equal to 1" in errors  # beside the Steps field
    assert any(e.startswith("`rollout.temperature`") for e in errors)  # a YAML-only field

    at.text_area(key="l_yaml_paste").set_value("train:\n  max_steps: 3\n").run()
    next(w for w in at.number_input if w.label == "Steps").set_value(5)
    at.selectbox(key="l_exp").set_value("+ new experiment")
    at.text_input(key="l_new_exp").set_value("dash-launched")
    at.text_input(key="l_tags").set_value("ui, smoke")
    at.text_input(key="l_name").set_value("from-the-form")
    next(b for b in at.button if b.label == "Launch").click().run()
    _no_exception(at)
    assert at.title[0].value.endswith("from-the-form")
    run_id = int(at.query_params["run"])
    run = client.get_run(run_id)
    assert run["experiment"] == "dash-launched"
    assert run["tags"] == ["smoke", "ui"]
    assert run["config"]["train"]["max_steps"] == 5
    assert run["state"] == "queued"


def test_launch_clicked_twice_in_one_visit_makes_one_run(as_admin: SeededApi, client: YattClient) -> None:
    def launch(visit: str) -> int:
        at = _open("views/launch.py")
        at.session_state["l_visit"] = visit  # the visit the page's plain render started
        at.selectbox(key="l_exp").set_value("+ new experiment")
        at.text_input(key="l_new_exp").set_value("dash-double-click")
        at.text_input(key="l_name").set_value("clicked-twice")
        next(b for b in at.button if b.label == "Launch").click().run()
        _no_exception(at)
        return int(at.query_params["run"])

    first = launch("visit-a")
    assert launch("visit-a") == first  # the second click of a double click: the same run
    assert launch("visit-b") != first  # a new visit of the page is a new submission
    runs = client.list_runs(experiment="dash-double-click", limit=10)["items"]
    assert len(runs) == 2


def test_launch_shows_a_placement_that_cannot_fit_beside_the_kv_cache_field(as_admin: SeededApi,
                                                                            tmp_path: Path) -> None:
    at = _open("views/launch.py")
    at.selectbox(key="l_source").set_value("paste YAML").run()
    model = long_context_model(tmp_path / "micro-long")  # a context long enough that its KV cannot fit
    at.text_area(key="l_yaml_paste").set_value(
        f"model:\n  path: {model}\n  preset: micro\nrollout:\n  kv_cache_gb: 6\n"
        "placement:\n  devices: 2\n  device_type: cpu\n  device_memory_gb: 3\n").run()
    assert next(w for w in at.number_input if w.label == "KV cache (GB, CPU)").value == 6
    at.button[0].click().run()  # Validate
    _no_exception(at)
    beside = [e.value for e in at.error if not e.value.startswith("`")]
    assert any("does not fit" in e and "rollout.kv_cache_gb ≤" in e for e in beside)


def test_launch_validates_a_ready_config(as_admin: SeededApi) -> None:
    at = _open("views/launch.py")
    assert at.selectbox(key="l_source").value == "demo-arithmetic.yaml"
    demo = yaml.safe_load((APP.parents[1] / "configs" / "demo-arithmetic.yaml").read_text())
    assert next(w for w in at.number_input if w.label == "Steps").value == demo["train"][
        "max_steps"]  # the form starts from the file
    at.button[0].click().run()
    _no_exception(at)
    assert [s.value for s in at.success] == ["The config is valid."]


# --- Compare and Cluster -------------------------------------------------------------------------


def test_compare_overlays_metrics_and_lists_config_differences(as_admin: SeededApi) -> None:
    a, b = as_admin.runs["succeeded"], as_admin.runs["failed"]
    at = _open("views/compare.py", runs=f"{a},{b}")
    charts = _charts(at)
    assert [c["layout"]["title"]["text"] for c in charts] == [
        "reward/mean", "throughput/gen_tokens_per_s"]
    assert [t["name"] for t in charts[0]["data"]] == [f"#{a} succeeded", f"#{b} failed"]
    diff = at.dataframe[-1].value
    assert list(diff.index) == ["train.lr"]
    assert list(diff.loc["train.lr"]) == ["5e-05", "1e-05"]


def test_compare_page_loads_ten_runs_with_one_request(
    as_admin: SeededApi, client: YattClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = list(as_admin.runs.values())
    while len(ids) < 10:
        run = client.create_run(experiment="dash-compare", name=f"cmp-{len(ids)}", config={})
        client.report_state(run["id"], "starting")
        client.report_state(run["id"], "running")
        assert as_admin.mint_run_token is not None
        with YattClient(as_admin.url, as_admin.mint_run_token(run["id"])) as trainer:
            trainer.post_metrics(run["id"], [{"key": "reward/mean", "step": s, "value": s / 10} for s in range(50)])
        ids.append(run["id"])
    calls: list[str] = []
    real = YattClient.request

    def counted(self: YattClient, method: str, path: str, **kw: Any) -> Any:
        calls.append(f"{method} {path}")
        return real(self, method, path, **kw)

    monkeypatch.setattr(YattClient, "request", counted)
    at = _open("views/compare.py", runs=",".join(map(str, ids)))
    per_run = [c for c in calls if c.startswith("GET /runs/") and not c.startswith("GET /runs/compare")]
    assert per_run == []
    assert sum(c.startswith("GET /runs/compare") for c in calls) == 1
    charts = _charts(at)
    monkeypatch.undo()
    with_reward = [i for i in ids if any(k["key"] == "reward/mean" for k in client.metric_keys(i))]
    assert len(with_reward) >= 8
    assert len(charts[0]["data"]) == len(with_reward)  # each run's reward/mean in the first chart


def test_cluster_page_shows_capacity_and_active_runs(as_admin: SeededApi) -> None:
    at = _open("views/cluster.py")
    labels = {m.label: m.value for m in at.metric}
    assert int(labels["Devices used"]) >= 2  # the seed's running run holds 2 (others may run)
    assert "Devices free" in labels
    assert any("no Ray cluster" in w.value for w in at.warning)
    titles = [h.value for h in at.subheader]
    empty = {c.value for c in at.caption}
    tables = dict(zip([t for t in titles if f"No {t.lower()}." not in empty],
                      (d.value for d in at.dataframe), strict=True))
    assert as_admin.runs["running"] in set(tables["Runs"]["id"])
    # the seed's running run logged a colocated plan: both its devices train and sample
    by_role = tables["Devices by role"]
    mine = by_role[by_role["run"] == f"#{as_admin.runs['running']} running"]
    assert list(mine["device"]) == [0, 1] and set(mine["role"]) == {"train + rollout"}


# --- Tokens ------------------------------------------------------------------------------------


def test_wrong_token_gets_a_clear_message_and_a_login_box(
    api: SeededApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("YATT_API_URL", api.url)
    monkeypatch.setenv("YATT_TOKEN", "yatt_not-a-real-token")
    at = _app()
    at.run()
    _no_exception(at)
    assert any("refused this token" in e.value and "401" in e.value for e in at.error)
    assert not at.dataframe  # no page ran

    at.text_input(key="login_token").set_value(api.read_token)
    at.button[0].click().run()
    _no_exception(at)
    assert at.title[0].value == "History"
    assert at.dataframe[0].value.shape[0] >= 5


def test_no_token_asks_for_one(api: SeededApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YATT_API_URL", api.url)
    monkeypatch.delenv("YATT_TOKEN", raising=False)
    at = _app()
    at.run()
    _no_exception(at)
    assert any("No API token" in e.value for e in at.error)
    assert at.text_input(key="login_token")


def test_unreachable_api_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.stack import free_port

    monkeypatch.setenv("YATT_API_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("YATT_TOKEN", "yatt_whatever")
    at = _app()
    at.run()
    _no_exception(at)
    assert any("Cannot reach the API" in e.value for e in at.error)
