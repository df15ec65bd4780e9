"""Run page: state, live charts, the phase timeline, events, logs, config and checkpoints.

While the run is active the live part reruns every couple of seconds (`st.fragment(run_every)`);
when the run ends, the page reruns once without the timer and stays still.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st
import yaml

from dashboard import api, session
from dashboard.charts import (
    gantt_figure,
    line_figure,
    metric_panels,
    phase_share,
    phase_spans,
    placement_switches,
)
from dashboard.live import FetchedWhenChanged, LiveLog, LiveSeries
from dashboard.tables import (
    CANCELLABLE_STATES,
    RunEvents,
    event_rows,
    format_duration,
    keeps_refreshing,
    launched_by,
    parse_time,
)

REFRESH_S = 2.0
MAX_POINTS = 800  # per series: plenty for a chart ~1,000 px wide, cheap for any run length
EVENTS_PAGE = 5000
STATE_COLORS = {"queued": "gray", "starting": "blue", "running": "blue", "cancelling": "orange",
                "succeeded": "green", "failed": "red", "cancelled": "orange"}

c = session.client()


def _pick_run() -> int | None:
    raw = st.query_params.get("run")
    if raw and raw.isdigit():
        return int(raw)
    st.title("Run")
    try:
        runs, _ = api.list_runs(c, limit=50)
    except api.ApiError as exc:
        session.show_api_error(exc, "list runs")
        return None
    if not runs:
        st.info("No runs yet: start one on the Launch page.")
        return None
    labels = {r["id"]: f"#{r['id']} {r.get('name', '')} · {r.get('state', '')}" for r in runs}
    chosen = st.selectbox("Open a run", list(labels), format_func=labels.__getitem__, index=None,
                          placeholder="choose a run")
    if chosen is not None:
        st.query_params["run"] = str(chosen)
        st.rerun()
    return None


def _header(run: dict[str, Any]) -> None:
    state = run["state"]
    st.title(f"#{run['id']} {run.get('name') or ''}")
    who, pipeline = launched_by(run)
    exp = run.get("experiment")
    exp_name = exp.get("name") if isinstance(exp, dict) else exp
    parts = [
        f":{STATE_COLORS.get(state, 'gray')}-badge[{state}]",
        f"experiment **{exp_name}**",
        f"attempt {run.get('attempt', 1)}/{run.get('max_attempts', 1)}",
        f"launched by {who}" + (f" ([pipeline]({pipeline}))" if pipeline else ""),
    ]
    if run.get("tags"):
        parts.append(" ".join(f":gray-badge[{t}]" for t in run["tags"]))
    st.markdown(" · ".join(parts))
    started, finished = parse_time(run.get("started_at")), parse_time(run.get("finished_at"))
    created = parse_time(run.get("created_at"))
    timing = [f"created {created:%Y-%m-%d %H:%M:%S} UTC" if created else ""]
    if started:
        end = finished or pd.Timestamp.now(tz="UTC").to_pydatetime()
        timing.append(f"ran {format_duration((end - started).total_seconds())}")
    if run.get("code_version"):
        timing.append(f"code {run['code_version']}")
    st.caption(" · ".join(t for t in timing if t))
    if run.get("error"):
        st.error(run["error"], icon=":material/error:")
    if run.get("description"):
        st.write(run["description"])


def _buttons(run: dict[str, Any]) -> str:
    """Cancel / retry, the CSV download and the x-axis choice, in one row; returns the x axis."""
    state = run["state"]
    row = st.container(horizontal=True, vertical_alignment="center")
    if state in CANCELLABLE_STATES and row.button(
        "Cancel run", icon=":material/cancel:", key="cancel"
    ):
        try:
            api.cancel_run(c, run["id"])
            st.toast(f"Cancelling run #{run['id']}")
            st.rerun(scope="app")
        except api.ApiError as exc:
            session.show_api_error(exc, "cancel the run")
    if state == "failed" and row.button("Retry run", icon=":material/replay:", key="retry"):
        try:
            api.retry_run(c, run["id"])
            st.toast(f"Run #{run['id']} queued again")
            st.rerun(scope="app")
        except api.ApiError as exc:
            session.show_api_error(exc, "retry the run")
    row.download_button(
        "Metrics as CSV",
        data=lambda: api.metrics_csv(c, run["id"]),
        file_name=f"run-{run['id']}-metrics.csv",
        mime="text/csv",
        icon=":material/download:",
        key="csv",
    )
    x = row.segmented_control("x axis", ["step", "time"], default="step", key="x_axis",
                              help="Chart metrics against the training step or wall time.")
    return x or "step"


def _summary_row(keys: list[dict[str, Any]]) -> None:
    latest = {k["key"]: k.get("latest") for k in keys}
    # the RL step; the SFT warm start counts its own steps (warm_start/*) until RL begins
    rl = [k for k in keys if not k["key"].startswith("warm_start/")]
    latest["step"] = max((k.get("latest_step") or 0) for k in rl or keys)
    wanted = [
        ("step", "step"),
        ("throughput/gen_tokens_per_s", "tokens/s"),
        ("throughput/samples_per_s", "samples/s"),
        ("reward/mean", "reward"),
        ("kl/mean", "KL"),
    ]
    shown = [(key, label) for key, label in wanted if latest.get(key) is not None]
    if not shown:
        return
    for col, (key, label) in zip(st.columns(len(shown)), shown, strict=True):
        col.metric(label, f"{latest[key]:,}" if key == "step" else f"{latest[key]:.4g}")


def _kept(name: str, run_id: int, make: Any) -> Any:
    """Per browser session and run: what the page keeps between refreshes."""
    cache: dict[int, Any] = st.session_state.setdefault(f"run_{name}", {})
    return cache.setdefault(run_id, make())


def _charts(run: dict[str, Any], x: str) -> None:
    run_id = run["id"]
    keys = api.metric_keys(c, run_id)
    if not keys:
        st.info("No metrics yet: charts appear with the trainer's first report.")
        return
    _summary_row(keys)
    panels = metric_panels(k["key"] for k in keys)
    live_series: LiveSeries = _kept("series", run_id, lambda: LiveSeries(max_points=MAX_POINTS))
    # only the steps after the ones already drawn are fetched (all again on a new attempt)
    series = live_series.refresh(c, run_id, [k for p in panels for k in p.keys],
                                 {k["key"]: k for k in keys}, attempt=int(run.get("attempt") or 1))
    main = [p for p in panels if p.primary]
    cols = st.columns(2)
    for i, panel in enumerate(main):
        with cols[i % 2]:
            st.plotly_chart(line_figure(panel, series, x=x), key=f"chart-{panel.title}",
                            config={"displaylogo": False})
    extra = [p for p in panels if not p.primary]
    if extra:
        with st.expander(f"More metrics: {', '.join(p.title for p in extra)}"):
            small = st.columns(3)
            for i, panel in enumerate(extra):
                with small[i % 3]:
                    st.plotly_chart(line_figure(panel, series, x=x, height=220),
                                    key=f"chart-{panel.title}", config={"displaylogo": False})


def _run_events(run_id: int) -> RunEvents:
    """The run's events, fetched since the last refresh only (kept in the browser session)."""
    cache: dict[int, RunEvents] = st.session_state.setdefault("run_events", {})
    log = cache.setdefault(run_id, RunEvents())
    while True:
        new = api.events(c, run_id, after_id=log.last_id, limit=EVENTS_PAGE)
        log.absorb(new)
        if len(new) < EVENTS_PAGE:
            return log


def _timeline(log: RunEvents) -> None:
    spans = phase_spans(log.span_events)
    if not spans:
        st.caption("No phase timeline yet (the trainer reports `phase_spans` after each step).")
        return
    steps = sorted({s["step"] for s in spans})
    last = st.slider("Steps shown", 1, max(2, min(20, len(steps))), min(3, len(steps)),
                     key="gantt_steps", help="The newest steps; gaps between bars are idle time.")
    switches = placement_switches(log.text)
    st.plotly_chart(gantt_figure(spans, last_steps=last, title="", switches=switches), key="gantt",
                    config={"displaylogo": False})
    if switches:  # placement.mode=auto moved roles: the dashed lines mark where
        st.caption("Placement changes: " + "; ".join(
            f"from step {sw['step']}: {sw['plan']}" for sw in switches))
    shown = [s for s in spans if s["step"] in set(steps[-last:])]
    share = pd.DataFrame(phase_share(shown))
    if not share.empty:
        st.caption("Seconds per phase and idle share of each device over the steps shown: "
                   "a balanced placement keeps every device's idle share low.")
        share = share.rename(columns={"busy_s": "busy (s)", "idle_pct": "idle (%)"})
        st.dataframe(share.set_index("device"), width="stretch",
                     column_config={c_: st.column_config.NumberColumn(format="%.2f")
                                    for c_ in share.columns if c_ != "device"})


def _activity(run: dict[str, Any], log: RunEvents) -> None:
    run_id = run["id"]
    tab_events, tab_logs, tab_ckpt, tab_attempts, tab_config = st.tabs(
        ["Events", "Logs", "Checkpoints", "Attempts", "Config"]
    )
    with tab_events:
        rows = event_rows(log.text)
        if rows:
            st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch",
                         column_config={"time": st.column_config.DatetimeColumn(
                             "time (UTC)", format="YYYY-MM-DD HH:mm:ss")})
        else:
            st.caption("No events yet.")
    with tab_logs:
        live_log: LiveLog = _kept("log", run_id, LiveLog)
        try:  # only the text appended since the last refresh is fetched
            text = live_log.refresh(c, run_id, attempt=int(run.get("attempt") or 1))
        except api.ApiError as exc:
            text = ""
            st.caption(f"No logs to show ({exc.status}: {exc.message}).")
        st.code(text.rstrip("\n") or "(no log output yet)", language=None)
    with tab_ckpt:
        saved = sum(1 for e in log.text if e.get("kind") == "checkpoint")
        ckpts = _kept("checkpoints", run_id, FetchedWhenChanged).get(
            saved, lambda: api.checkpoints(c, run_id))  # again only after a checkpoint event
        if ckpts:
            df = pd.DataFrame(ckpts)
            st.dataframe(df[[col for col in ("step", "attempt", "path", "size_bytes", "metrics",
                                             "created_at") if col in df.columns]],
                         hide_index=True, width="stretch")
        else:
            st.caption("No checkpoints yet.")
    with tab_attempts:
        attempts = _kept("attempts", run_id, FetchedWhenChanged).get(
            (run.get("attempt"), run["state"]), lambda: api.attempts(c, run_id))
        st.caption(f"Attempt {run.get('attempt', 1)} of at most {run.get('max_attempts', 1)}.")
        if attempts:
            st.dataframe(pd.DataFrame(attempts), hide_index=True, width="stretch")
    with tab_config:
        st.code(yaml.safe_dump(run.get("config") or {}, sort_keys=False), language="yaml")
        if run.get("package_versions"):
            st.caption("Package versions")
            st.json(run["package_versions"], expanded=False)


picked = _pick_run()
if picked is None:
    st.stop()
assert picked is not None  # st.stop() ended the script otherwise
run_id: int = picked

try:
    first = api.get_run(c, run_id)
except api.ApiError as exc:
    session.show_api_error(exc, f"load run #{run_id}")
    st.stop()

active = keeps_refreshing(first)  # unfinished, or failed with a retry to come


@st.fragment(run_every=REFRESH_S if active else None)
def live() -> None:
    try:
        run = api.get_run(c, run_id)
    except api.ApiError as exc:
        session.show_api_error(exc, f"refresh run #{run_id}")
        return
    if active and not keeps_refreshing(run):
        st.rerun(scope="app")  # the run ended, no retry to come: redraw once, without the timer
    _header(run)
    x = _buttons(run)
    try:
        _charts(run, x)
        st.subheader("Phase timeline")
        log = _run_events(run_id)
        _timeline(log)
        _activity(run, log)
    except api.ApiError as exc:
        session.show_api_error(exc, "load the run's data")
    if active:
        waiting = " (a retry is pending)" if run["state"] == "failed" else ""
        st.caption(f"Live: refreshing every {REFRESH_S:g} s while the run is {run['state']}{waiting}.")


live()
