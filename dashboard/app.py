"""yatt dashboard: `yatt dashboard` (or `streamlit run dashboard/app.py`).

The entry script only sets the page up, checks the token and routes; each page is a script
under `views/` (not `pages/`, which Streamlit would also list on its own) and talks to the API
through `dashboard.api`.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import session

HERE = Path(__file__).parent

st.set_page_config(page_title="yatt", page_icon=":material/model_training:", layout="wide")

PAGES = {
    # the default page lives at the root URL
    "history": st.Page(HERE / "views/history.py", title="History", icon=":material/history:",
                       default=True),
    "launch": st.Page(HERE / "views/launch.py", title="Launch", icon=":material/rocket_launch:",
                      url_path="launch"),
    "run": st.Page(HERE / "views/run.py", title="Run", icon=":material/monitoring:",
                   url_path="run"),
    "compare": st.Page(HERE / "views/compare.py", title="Compare", icon=":material/compare:",
                       url_path="compare"),
    "cluster": st.Page(HERE / "views/cluster.py", title="Cluster", icon=":material/dns:",
                       url_path="cluster"),
}

page = st.navigation(list(PAGES.values()))
session.sidebar_login()
page.run()
