"""Cluster page: nodes, devices, which runs hold them (and in which role), and what is free."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import api, session
from dashboard.tables import cluster_tables

c = session.client()
st.title("Cluster")


@st.fragment(run_every=5.0)
def cluster_view() -> None:
    try:
        info = api.cluster(c)
    except api.ApiError as exc:
        session.show_api_error(exc, "read the cluster")
        return
    if info.get("reachable") is False:
        st.warning(info.get("error") or "The API sees no Ray cluster: device numbers are unknown. "
                   "Set YATT_RAY_ADDRESS for the API, or start everything with `yatt up`.",
                   icon=":material/cloud_off:")
    view = cluster_tables(info)
    if view.capacity:
        for col, (label, value) in zip(st.columns(len(view.capacity)), view.capacity.items(),
                                       strict=True):
            col.metric(label, value)
    if view.note:
        st.caption(view.note)
    for title, rows in view.tables.items():
        st.subheader(title)
        if rows:
            st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
        else:
            st.caption(f"No {title.lower()}.")
    st.caption("Refreshes every 5 s.")


cluster_view()
