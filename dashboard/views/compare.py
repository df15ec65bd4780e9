"""Compare page: pick runs, overlay any metric, and see which config keys differ.

Everything about the chosen runs comes from one `GET /runs/compare` request (up to 20 runs)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import api, session
from dashboard.charts import overlay_figure
from dashboard.tables import config_diff, run_rows

MAX_POINTS = 800
MAX_RUNS = 20  # what GET /runs/compare takes in one request
DEFAULT_METRICS = ("reward/mean", "throughput/gen_tokens_per_s")

c = session.client()
st.title("Compare runs")

try:
    recent, _ = api.list_runs(c, limit=100)
except api.ApiError as exc:
    session.show_api_error(exc, "list runs")
    st.stop()
if not recent:
    st.info("No runs yet.")
    st.stop()

labels = {r["id"]: f"#{r['id']} {r.get('name', '')} · {r.get('state', '')}" for r in recent}
preset = [int(x) for x in str(st.query_params.get("runs", "")).split(",") if x.isdigit()]
for run_id in preset:  # runs named in the URL but older than the list
    if run_id not in labels:
        labels[run_id] = f"#{run_id}"
chosen: list[int] = st.multiselect("Runs", list(labels), default=preset or list(labels)[:2],
                                   format_func=labels.__getitem__, key="cmp_runs")
if len(chosen) < 1:
    st.info("Pick at least one run.")
    st.stop()

if len(chosen) > MAX_RUNS:
    st.warning(f"Comparing the first {MAX_RUNS} runs picked.")
    chosen = chosen[:MAX_RUNS]
st.query_params["runs"] = ",".join(map(str, chosen))

# One request for every run: rows, configs, metric keys and the series of the metrics shown.
wanted = st.session_state.get("cmp_metrics") or list(DEFAULT_METRICS)
try:
    compared = api.compare(c, chosen, wanted, max_points=MAX_POINTS)
except api.ApiError as exc:
    session.show_api_error(exc, "load the runs")
    st.stop()
runs = {item["run"]["id"]: {**item["run"], "config": item["config"]} for item in compared}
keys_by_run = {item["run"]["id"]: item["keys"] for item in compared}
series = {item["run"]["id"]: item["series"] for item in compared}

short = {rid: f"#{rid} {runs[rid].get('name', '')}".strip() for rid in chosen}
st.dataframe(pd.DataFrame(run_rows(runs.values())), hide_index=True, width="stretch",
             column_order=["id", "name", "state", "experiment", "attempt", "launched by",
                           "created", "duration", "tags"],
             column_config={"id": st.column_config.NumberColumn("run", format="#%d"),
                            "created": st.column_config.DatetimeColumn(
                                "created (UTC)", format="YYYY-MM-DD HH:mm:ss")})

all_keys = sorted(set().union(*keys_by_run.values()))
st.subheader("Metrics")
if not all_keys:
    st.caption("These runs have no metrics yet.")
else:
    default = [k for k in DEFAULT_METRICS if k in all_keys]
    metrics = st.multiselect("Metrics to overlay", all_keys, default=default or all_keys[:1],
                             key="cmp_metrics")
    x = st.segmented_control("x axis", ["step", "elapsed"], default="step", key="cmp_x",
                             format_func={"step": "step",
                                          "elapsed": "time since start"}.__getitem__) or "step"
    if metrics and set(metrics) - set(wanted):  # the first view of runs without the defaults
        try:
            series = {item["run"]["id"]: item["series"]
                      for item in api.compare(c, chosen, metrics, max_points=MAX_POINTS)}
        except api.ApiError as exc:
            session.show_api_error(exc, "load the metrics")
            st.stop()
    if metrics:
        cols = st.columns(2 if len(metrics) > 1 else 1)
        for i, metric in enumerate(metrics):
            by_run = {short[rid]: series[rid].get(metric, []) for rid in chosen}
            with cols[i % len(cols)]:
                st.plotly_chart(overlay_figure(metric, by_run, x=x), key=f"cmp-{metric}",
                                config={"displaylogo": False})

st.subheader("Config keys that differ")
if len(chosen) < 2:
    st.caption("Pick two or more runs to see their differences.")
else:
    diff = config_diff({short[rid]: runs[rid].get("config") or {} for rid in chosen})
    if diff:
        st.dataframe(pd.DataFrame(diff).set_index("key"), width="stretch")
    else:
        st.success("These runs have identical configs.")
