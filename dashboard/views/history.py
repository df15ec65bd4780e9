"""History page: the project's runs, filtered, sorted and paged; picking one opens its page."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import pandas as pd
import streamlit as st

from backend.runs.state import RunState
from dashboard import api, session
from dashboard.tables import run_rows

PAGE_SIZE = 25
STATES = [s.value for s in RunState]
SORTS = {"newest first": "-created_at", "oldest first": "created_at", "best match": "-relevance"}

c = session.client()
st.title("History")


def _experiments() -> list[str]:
    try:
        return [e["name"] for e in api.list_experiments(c)]
    except api.ApiError:
        return []


with st.container(border=True):
    row1 = st.columns([2, 2, 2, 2])
    states = row1[0].multiselect("State", STATES, key="f_state")
    experiment = row1[1].selectbox("Experiment", _experiments(), index=None,
                                   placeholder="any", key="f_experiment")
    tag = row1[2].text_input("Tag", key="f_tag", placeholder="any")
    who = row1[3].selectbox("Launched by", ["anyone", "user", "ci"], key="f_who")
    row2 = st.columns([3, 2, 2, 1])
    search = row2[0].text_input("Search name, experiment, tags and description", key="f_q",
                                help="Every word must match (the last one as a prefix); "
                                     "sort by best match to rank the results.")
    today = date.today()
    days = row2[1].date_input("Created between", value=[], key="f_dates",
                              max_value=today + timedelta(days=1))
    sort = row2[2].selectbox("Sort by", [*SORTS, "summary metric"], key="f_sort")
    metric = ""
    descending = True
    if sort == "summary metric":
        metric = row2[3].text_input("Metric", value="reward/mean", key="f_metric")
        descending = st.toggle("Highest first", value=True, key="f_desc")

filters: dict[str, Any] = {
    "state": ",".join(states) or None,
    "experiment": experiment,
    "tag": tag.strip() or None,
    "launched_by": None if who == "anyone" else who,
    "q": search.strip() or None,
}
if isinstance(days, tuple) and days:
    filters["created_since"] = datetime.combine(days[0], time.min, tzinfo=UTC).isoformat()
    if len(days) > 1:  # the whole last day
        filters["created_until"] = datetime.combine(days[1] + timedelta(days=1), time.min,
                                                    tzinfo=UTC).isoformat()
if metric.strip():
    filters["sort"] = ("-" if descending else "") + metric.strip()
    filters["metrics"] = metric.strip()
else:
    filters["sort"] = SORTS.get(sort, "-created_at")
    if filters["sort"] == "-relevance" and not filters["q"]:  # nothing to rank by
        filters["sort"] = "-created_at"

# Cursor pagination: remember the cursors of pages already visited; new filters start over.
signature = repr(sorted(filters.items()))
if st.session_state.get("h_signature") != signature:
    st.session_state["h_signature"] = signature
    st.session_state["h_cursors"] = [None]
cursors: list[str | None] = st.session_state["h_cursors"]

try:
    runs, next_cursor = api.list_runs(c, cursor=cursors[-1], limit=PAGE_SIZE, **filters)
except api.ApiError as exc:
    session.show_api_error(exc, "list runs")
    st.stop()

if not runs:
    st.info("No runs match these filters." if len(cursors) == 1 else "No more runs.")
else:
    rows = run_rows(runs, metric=metric.strip() or None)
    df = pd.DataFrame(rows)
    df["open"] = [f"run?run={r['id']}" for r in rows]
    event = st.dataframe(
        df,
        hide_index=True,
        width="stretch",
        on_select="rerun",
        selection_mode="single-row",
        key="runs_table",
        column_order=["open", "name", "state", "experiment", "attempt", "launched by", "pipeline",
                      "created", "duration", "tags",
                      *([metric.strip()] if metric.strip() else [])],
        column_config={
            "pipeline": st.column_config.LinkColumn("pipeline", display_text="pipeline"),
            "created": st.column_config.DatetimeColumn("created (UTC)",
                                                       format="YYYY-MM-DD HH:mm:ss"),
            # the run number, linking to its page (in a new tab; selecting the row opens it here)
            "open": st.column_config.LinkColumn("run", display_text=r"run=(\d+)$",
                                                width="small"),
        },
    )
    selected = event.selection.rows if event is not None else []
    if selected:
        session.open_run(int(df.iloc[selected[0]]["id"]))
    st.caption("Select a row to open the run.")

    labels = {r["id"]: f"#{r['id']} {r['name']} · {r['state']}" for r in rows}
    chosen = st.selectbox("Open run", list(labels), format_func=labels.__getitem__,
                               index=None, placeholder="open a run…", key="h_open",
                               label_visibility="collapsed")
    if chosen is not None:
        session.open_run(int(chosen))

nav = st.columns([1, 1, 4])
if len(cursors) > 1 and nav[0].button("← Previous page", key="h_prev"):
    cursors.pop()
    st.rerun()
if next_cursor and nav[1].button("Next page →", key="h_next"):
    cursors.append(next_cursor)
    st.rerun()
st.caption(f"Page {len(cursors)} · {len(runs)} runs shown")
