"""The dashboard's pure pieces: metric grouping, the phase Gantt, config diffs, the launch form."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

import pytest

from dashboard.charts import (
    PHASE_COLORS,
    gantt_figure,
    line_figure,
    metric_panels,
    overlay_figure,
    phase_share,
    phase_spans,
    placement_switches,
)
from dashboard.launch_form import (
    FORM_FIELDS,
    errors_by_field,
    field_value,
    merge_form,
    parse_yaml,
    set_path,
)
from dashboard.tables import (
    RunEvents,
    cluster_tables,
    config_diff,
    event_rows,
    flatten,
    format_duration,
    launched_by,
    metrics_csv,
    run_rows,
    summary_value,
)


def test_metric_panels_groups_every_key_once_in_reading_order() -> None:
    # the keys trainer/ reports (DESIGN.md §3.7)
    keys = [
        "reward/mean", "reward/std", "reward/failed_batches", "kl/mean", "loss/policy",
        "loss/total", "throughput/gen_tokens_per_s", "throughput/trained_tokens_per_s",
        "throughput/samples_per_s", "device/0/util_pct", "device/1/util_pct",
        "device/10/util_pct", "device/0/memory_mb", "device/1/memory_mb",
        "device/0/memory_total_mb", "device/0/busy_frac", "response/length_mean",
        "response/length_max", "response/truncated_frac", "sampling/valid_fraction",
        "sampling/oversample_ratio", "sampling/kept_groups", "time/rollout", "entropy", "lr",
        "advantage/mean", "advantage/abs_mean",
    ]
    panels = metric_panels(keys)
    titles = [p.title for p in panels]
    assert titles == [
        "Throughput (tokens/s)", "Throughput (samples/s)", "Device utilization",
        "Device memory", "Device busy fraction", "Reward", "KL", "Losses", "Response length",
        "Dynamic sampling ratios", "Dynamic sampling counts", "Time per phase",
        "advantage", "entropy", "lr", "response/truncated_frac", "reward/failed_batches",
    ]
    assert by_title_keys(panels, "advantage") == ["advantage/abs_mean", "advantage/mean"]
    assert [p.title for p in panels if not p.primary] == titles[12:]  # extras, shown folded
    by_title = {p.title: p for p in panels}
    util = by_title["Device utilization"]
    assert util.keys == ["device/0/util_pct", "device/1/util_pct", "device/10/util_pct"]
    assert [util.label(k) for k in util.keys] == ["device 0", "device 1", "device 10"]
    assert by_title["Throughput (tokens/s)"].keys == ["throughput/gen_tokens_per_s",
                                                      "throughput/trained_tokens_per_s"]
    assert by_title["Throughput (samples/s)"].label("throughput/samples_per_s") == "samples_per_s"
    assert by_title["Response length"].label("response/length_max") == "length_max"
    assert by_title["Dynamic sampling ratios"].keys == ["sampling/oversample_ratio",
                                                        "sampling/valid_fraction"]
    drawn = [k for p in panels for k in p.keys]
    assert len(drawn) == len(set(drawn))
    # the memory capacity is a constant, not a chart of its own
    assert set(drawn) == set(keys) - {"device/0/memory_total_mb"}


def by_title_keys(panels: list, title: str) -> list[str]:
    return next(p.keys for p in panels if p.title == title)


def test_line_figure_draws_one_trace_per_key_with_points() -> None:
    panel = metric_panels(["reward/mean", "reward/max"])[0]
    series = {
        "reward/mean": [{"step": s, "value": s / 10, "time": 100.0 + s} for s in range(5)],
        "reward/max": [],
    }
    fig = line_figure(panel, series)
    assert [t.name for t in fig.data] == ["mean"]
    assert list(fig.data[0].y) == [0.0, 0.1, 0.2, 0.3, 0.4]
    by_time = line_figure(panel, series, x="time")
    assert by_time.data[0].x[0] == datetime(1970, 1, 1, 0, 1, 40, tzinfo=UTC)
    assert not by_time.layout.xaxis.title.text  # dates read without a title
    elapsed = line_figure(panel, series, x="elapsed")
    assert list(elapsed.data[0].x) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert fig.layout.title.text == "Reward"
    assert elapsed.layout.xaxis.title.text == "seconds since the run's first report"


def test_overlay_figure_has_one_line_per_run() -> None:
    runs = {
        "#1 a": [{"step": 0, "value": 1.0, "time": 50.0}, {"step": 1, "value": 2.0, "time": 60.0}],
        "#2 b": [],
        "#3 c": [{"step": 0, "value": 0.5, "time": 9000.0}],
    }
    fig = overlay_figure("reward/mean", runs)
    assert [t.name for t in fig.data] == ["#1 a", "#3 c"]
    assert fig.data[1].mode == "markers"
    elapsed = overlay_figure("reward/mean", runs, x="elapsed")
    assert list(elapsed.data[0].x) == [0.0, 10.0] and list(elapsed.data[1].x) == [0.0]


def _spans_event(spans: list[dict]) -> dict:
    return {"kind": "phase_spans", "message": "", "data": {"spans": spans}}


def test_phase_spans_collects_sorts_and_drops_malformed() -> None:
    events = [
        {"kind": "placement", "data": {"mode": "colocate"}},
        _spans_event([
            {"device": 1, "phase": "train", "start": 12.0, "end": 14.0, "step": 1},
            {"device": 0, "phase": "rollout", "start": 10.0, "end": 12.0, "step": 1},
            {"device": 0, "phase": "train", "start": 15.0, "end": 14.0, "step": 1},  # backwards
            {"device": 0, "phase": "train"},  # no times
        ]),
        _spans_event([{"device": "0", "phase": "train", "start": 12, "end": 13, "step": 1}]),
    ]
    spans = phase_spans(events)
    assert [(s["device"], s["phase"], s["start"]) for s in spans] == [
        (0, "rollout", 10.0), (0, "train", 12.0), (1, "train", 12.0)
    ]


def test_gantt_figure_one_trace_per_phase_relative_seconds_and_last_steps() -> None:
    spans = phase_spans([_spans_event([
        {"device": d, "phase": phase, "start": 100.0 + 10 * step + off,
         "end": 100.0 + 10 * step + off + dur, "step": step}
        for step in range(4) for d in (0, 1)
        for phase, off, dur in (("rollout", 0, 4), ("reward", 4, 1), ("train", 5, 3))
    ])])
    fig = gantt_figure(spans)
    assert [t.name for t in fig.data] == ["rollout", "reward", "train"]
    rollout = fig.data[0]
    assert rollout.orientation == "h"
    assert rollout.marker.color == PHASE_COLORS["rollout"]
    assert min(rollout.base) == 0.0  # seconds since the first span shown
    assert set(rollout.y) == {"device 0", "device 1"}
    assert list(rollout.x[:2]) == [4.0, 4.0]
    last_two = gantt_figure(spans, last_steps=2)
    assert min(last_two.data[0].base) == 0.0
    assert len(last_two.data[0].base) == 4  # 2 steps x 2 devices
    assert {c[0] for c in last_two.data[0].customdata} == {2, 3}
    empty = gantt_figure([])
    assert len(empty.data) == 0


def test_gantt_marks_where_an_auto_placement_switch_starts() -> None:
    spans = phase_spans([_spans_event([
        {"device": 0, "phase": "train", "start": 100.0 + 10 * step, "end": 105.0 + 10 * step,
         "step": step} for step in range(1, 5)])])
    events = [
        {"kind": "placement", "data": {"decision": "start", "mode": "colocate"}},
        {"kind": "placement", "data": {"decision": "replan", "switch": True, "step": 2}},
        {"kind": "placement", "data": {"decision": "applied", "step": 2,
                                       "plan": "disaggregated 1 rollout / 1 train"}},
        {"kind": "placement", "data": {"decision": "applied"}},  # malformed: skipped
    ]
    switches = placement_switches(events)
    assert switches == [{"step": 3, "plan": "disaggregated 1 rollout / 1 train"}]
    fig = gantt_figure(spans, switches=switches)
    (line,) = fig.layout.shapes
    assert line.x0 == 20.0 and line.line.dash == "dash"  # step 3 starts 20 s after step 1
    assert "disaggregated" in fig.layout.annotations[0].text
    assert not gantt_figure(spans, last_steps=1, switches=switches).layout.shapes  # step 3 not shown


def test_phase_share_measures_idle_time_per_device() -> None:
    spans = phase_spans([_spans_event([
        # device 0 busy 0-8 of a 10 s window (two overlapping spans count once)
        {"device": 0, "phase": "rollout", "start": 0, "end": 6, "step": 0},
        {"device": 0, "phase": "reward", "start": 4, "end": 8, "step": 0},
        # device 1 busy 5-10
        {"device": 1, "phase": "train", "start": 5, "end": 10, "step": 0},
    ])])
    rows = phase_share(spans)
    assert rows[0]["device"] == 0 and rows[0]["busy_s"] == pytest.approx(8.0)
    assert rows[0]["idle_pct"] == pytest.approx(20.0)
    assert rows[0]["rollout"] == pytest.approx(6.0) and rows[0]["reward"] == pytest.approx(4.0)
    assert rows[1]["idle_pct"] == pytest.approx(50.0)
    assert rows[1]["rollout"] == 0.0  # every phase column on every row
    assert list(rows[0])[1:4] == ["rollout", "reward", "train"]  # in the pipeline's order
    assert phase_share([]) == []


def test_config_diff_lists_only_differing_keys_and_missing_ones() -> None:
    a = {"train": {"lr": 1e-5, "max_steps": 50}, "rollout": {"n": 8, "stop": ["\n"]}, "seed": 0}
    b = {"train": {"lr": 5e-5, "max_steps": 50}, "rollout": {"n": 8, "stop": ["\n"]}, "seed": 0,
         "sampling": {"dynamic": True}}
    rows = config_diff({"#1": a, "#2": b})
    assert rows == [
        {"key": "sampling.dynamic", "#1": "—", "#2": "true"},
        {"key": "train.lr", "#1": "1e-05", "#2": "5e-05"},
    ]
    assert config_diff({"#1": a, "#2": a}) == []
    assert flatten({"a": {"b": {"c": 1}, "d": []}, "e": {}}) == {"a.b.c": 1, "a.d": [], "e": {}}


def test_launched_by_names_ci_commit_and_pipeline() -> None:
    ci_run = {"launched_by": "ci", "launched_by_name": "gitlab",
              "ci": {"commit": "0123456789abcdef", "branch": "main",
                     "pipeline_url": "https://ci.example/p/42"}}
    assert launched_by(ci_run) == ("CI 01234567 (main)", "https://ci.example/p/42")
    assert launched_by({"launched_by": "user", "launched_by_name": "ada"}) == ("ada", None)
    assert launched_by({"launched_by": "user"}) == ("user", None)


def test_run_rows_flatten_runs_for_the_history_table() -> None:
    now = datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)
    runs = [{
        "id": 7, "name": "demo", "experiment": "arith", "state": "running", "attempt": 2,
        "tags": ["a", "b"], "created_at": "2026-01-01T11:59:00Z",
        "started_at": "2026-01-01T12:00:00+00:00", "finished_at": None,
        "metrics": {"reward/mean": {"latest": 0.5, "min": 0.1, "max": 0.6, "step": 3}},
        "summary": {"reward/mean": 0.4},
    }]
    [row] = run_rows(runs, metric="reward/mean", now=now)
    assert row["id"] == 7 and row["attempt"] == 2 and row["tags"] == "a, b"
    assert row["duration"] == "10s"
    assert row["reward/mean"] == 0.5  # the latest point wins over the final summary
    assert summary_value({"summary": {"reward/mean": 0.4}}, "reward/mean") == 0.4
    assert summary_value({"metrics": {}, "summary": None}, "reward/mean") is None
    assert row["created"] == datetime(2026, 1, 1, 11, 59, tzinfo=UTC)
    assert format_duration(3725) == "1h 2m 5s" and format_duration(None) == "—"


def test_metrics_csv_is_long_format() -> None:
    text = metrics_csv({"b": [{"step": 1, "value": 2.0, "time": 3.0}],
                        "a": [{"step": 0, "value": 0.5, "time": 1.0}]})
    rows = list(csv.reader(io.StringIO(text)))
    assert rows == [["key", "step", "value", "time"], ["a", "0", "0.5", "1.0"],
                    ["b", "1", "2.0", "3.0"]]


def test_event_rows_hide_phase_spans_and_sort_newest_first() -> None:
    events = [
        {"time": "2026-01-01T00:00:01Z", "kind": "placement", "message": "colocate",
         "data": {"devices": 2}},
        {"time": "2026-01-01T00:00:02Z", "kind": "phase_spans", "message": "", "data": {}},
        {"time": "2026-01-01T00:00:03Z", "kind": "state", "message": "running", "data": None},
    ]
    rows = event_rows(events)
    assert [r["kind"] for r in rows] == ["state", "placement"]
    assert rows[1]["data"] == '{"devices": 2}'
    assert len(event_rows(events, include_spans=True)) == 3


def test_merge_form_writes_only_changed_values() -> None:
    base = {"train": {"max_steps": 40}, "rollout": {"n": 8}}
    values = {"train.max_steps": 40, "rollout.n": 4, "seed": 0, "placement.mode": "auto"}
    merged = merge_form(base, values)
    assert merged == {"train": {"max_steps": 40}, "rollout": {"n": 4},
                      "placement": {"mode": "auto"}}
    assert base == {"train": {"max_steps": 40}, "rollout": {"n": 8}}  # not mutated
    assert field_value(base, "train.max_steps") == 40
    assert field_value(base, "train.lr") == 1e-5  # the TrainerConfig default
    cfg: dict = {"seed": 1}
    set_path(cfg, "a.b.c", 2)
    assert cfg == {"seed": 1, "a": {"b": {"c": 2}}}


def test_form_offers_schema_choices() -> None:
    by_path = {f.path: f for f in FORM_FIELDS}
    assert by_path["placement.mode"].options == ("colocate", "disaggregated",
                                                 "partial_colocate", "auto")
    assert by_path["rollout.engine"].options == ("vllm", "hf")


def test_parse_yaml_explains_bad_input() -> None:
    assert parse_yaml("train:\n  max_steps: 3\n") == ({"train": {"max_steps": 3}}, None)
    assert parse_yaml("") == ({}, None)
    config, err = parse_yaml("train: [1, 2\n")
    assert config is None and err is not None and "line" in err
    assert parse_yaml("- 1\n- 2\n")[1] is not None


def test_errors_by_field_puts_errors_beside_their_fields() -> None:
    beside, rest = errors_by_field([
        ("train.max_steps", "Input should be greater than or equal to 1"),
        ("reward", "reward.kind=remote needs reward.url"),
        ("", "train.batch_size=3 must divide evenly across 2 data-parallel controllers"),
    ])
    assert beside == {"train.max_steps": ["Input should be greater than or equal to 1"]}
    assert [p for p, _ in rest] == ["reward", ""]


def test_run_events_fetch_incrementally_and_keep_recent_spans() -> None:
    log = RunEvents(keep_steps=2)
    batch = [{"id": 1, "kind": "placement", "message": "colocate", "data": {}}] + [
        {"id": 2 + step, "kind": "phase_spans", "message": "",
         "data": {"spans": [{"device": 0, "phase": "train", "start": step, "end": step + 0.5,
                             "step": step}]}}
        for step in range(4)
    ]
    assert log.absorb(batch) == 5
    assert log.absorb(batch[:2]) == 0  # already seen
    assert log.last_id == 5
    assert [e["kind"] for e in log.text] == ["placement"]
    assert [s["step"] for s in phase_spans(log.span_events)] == [2, 3]


def test_submission_key_is_stable_per_visit_and_request() -> None:
    from dashboard.launch_form import submission_key

    body = {"experiment": "e", "config": {"train": {"max_steps": 3}}, "tags": ["a"]}
    same = {"tags": ["a"], "config": {"train": {"max_steps": 3}}, "experiment": "e"}
    assert submission_key("v1", body) == submission_key("v1", same)
    assert submission_key("v1", body) != submission_key("v2", body)
    assert submission_key("v1", body) != submission_key("v1", {**body, "tags": ["b"]})
    assert len(submission_key("v1", body)) <= 200  # the API's header limit


def test_fetched_when_changed_calls_again_only_on_a_new_version() -> None:
    from dashboard.live import FetchedWhenChanged

    calls: list[int] = []
    kept = FetchedWhenChanged()

    def fetch() -> int:
        calls.append(1)
        return len(calls)

    assert kept.get(0, fetch) == 1 and kept.get(0, fetch) == 1 and kept.get(1, fetch) == 2


def test_cluster_page_groups_devices_by_node_with_their_roles() -> None:
    info = {
        "reachable": True,
        "nodes": [{"node_id": "n-head", "devices": 4}, {"node_id": "n-b", "devices": 2}],
        "runs": [{"id": 9, "name": "grpo", "state": "running", "devices": 3}],
        "assignments": [
            {"device": 2, "node_id": "n-b", "roles": ["rollout"], "run_id": 9, "run_name": "grpo"},
            {"device": 0, "node_id": "n-head", "roles": ["train"], "run_id": 9, "run_name": "grpo"},
            {"device": 1, "node_id": "n-b", "roles": ["rollout"], "run_id": 9, "run_name": "grpo"},
            {"device": 0, "node_id": None, "roles": [], "run_id": 3, "run_name": None},
            {"device": 0, "node_id": "n-b", "roles": ["train", "reward"], "run_id": 12, "run_name": "x"},
        ],
    }
    view = cluster_tables(info)
    assert view.tables["Devices by role"] == [
        {"node": "n-b", "device": 1, "role": "rollout", "run": "#9 grpo"},
        {"node": "n-b", "device": 2, "role": "rollout", "run": "#9 grpo"},
        {"node": "n-b", "device": 0, "role": "train + reward", "run": "#12 x"},
        {"node": "n-head", "device": 0, "role": "train", "run": "#9 grpo"},
        {"node": "—", "device": 0, "role": "—", "run": "#3"},
    ]
    assert "Assignments" not in view.tables and view.tables["Runs"][0]["id"] == 9
    # one node: a device without a node id is on it
    single = cluster_tables({"nodes": [{"node_id": "only"}], "assignments": [
        {"device": 1, "node_id": None, "roles": ["train", "rollout"], "run_id": 4, "run_name": "c"}]})
    assert single.tables["Devices by role"] == [
        {"node": "only", "device": 1, "role": "train + rollout", "run": "#4 c"}]
    assert cluster_tables({"assignments": []}).tables["Devices by role"] == []
