"""Who the dashboard talks to and as whom: the API URL, the token, and the client built on them.

The token comes from the login box in the sidebar, or `YATT_TOKEN` for the API named by
`YATT_API_URL` only (never for a URL entered in the login box); a token the API refuses gets a
message that says so, and the pages do not run until a good one is given.
"""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from dashboard import api

__all__ = ["api_url", "configured_api_url", "server_token_for", "client", "sidebar_login", "show_api_error", "open_run"]

_TOKEN = "yatt_token"
_URL = "yatt_api_url"


def configured_api_url() -> str:
    """The API the dashboard was started for: `YATT_API_URL`."""
    return os.environ.get("YATT_API_URL", "http://127.0.0.1:8000")


def api_url() -> str:
    """The API base URL (without `/api/v1`): the login box's, else `YATT_API_URL`."""
    return st.session_state.get(_URL) or configured_api_url()


def server_token_for(url: str) -> str:
    """`YATT_TOKEN` when `url` is the configured API, else nothing: the server's own token is
    never sent to an address a visitor typed in."""
    if url.strip().rstrip("/") != configured_api_url().strip().rstrip("/"):
        return ""
    return os.environ.get("YATT_TOKEN", "")


def _token() -> str:
    return st.session_state.get(_TOKEN) or server_token_for(api_url())


@st.cache_resource(show_spinner=False)
def _client_for(url: str, token: str) -> api.Client:
    return api.connect(url, token)


def client() -> api.Client:
    """The client for this browser session's URL and token."""
    return _client_for(api_url(), _token())


def _login_form(message: str | None) -> None:
    if message:
        st.error(message, icon=":material/key_off:")
    with st.form("login"):
        st.text_input("API URL", value=api_url(), key="login_url")
        st.text_input("API token", type="password", key="login_token",
                      help="A token from `yatt token create`, or set YATT_TOKEN before starting.")
        if st.form_submit_button("Sign in", type="primary"):
            st.session_state[_URL] = st.session_state["login_url"].strip()
            st.session_state[_TOKEN] = st.session_state["login_token"].strip()
            st.rerun()


def sidebar_login() -> api.Client:
    """Check the token against the API; stop the page with a login box when it is refused."""
    token = _token()
    if not token:
        st.title("yatt")
        _login_form("No API token: enter one below, or start the dashboard with YATT_TOKEN set.")
        st.stop()
    c = client()
    try:
        who = api.whoami(c)
    except api.ApiError as exc:
        st.title("yatt")
        if exc.status == 401:
            msg = (f"The API at {api_url()} refused this token (401: {exc.message}). "
                   "Check YATT_TOKEN, or sign in with another token.")
        elif exc.status == 0:
            msg = f"Cannot reach the API at {api_url()}: {exc.message}"
        else:
            msg = f"The API at {api_url()} answered {exc.status}: {exc.message}"
        _login_form(msg)
        st.stop()
    with st.sidebar:
        st.caption(f"{api_url()}  \nproject **{who.get('project', '?')}** · role "
                   f"{who.get('role', '?')}")
        if st.session_state.get(_TOKEN) and st.button("Sign out", key="sign_out"):
            st.session_state.pop(_TOKEN, None)
            st.rerun()
    return c


def show_api_error(exc: api.ApiError, doing: str) -> None:
    """One clear line for a refused or failed API call."""
    if exc.status == 0:
        st.error(f"Could not {doing}: the API is unreachable ({exc.message}).")
    else:
        st.error(f"Could not {doing}: {exc.status} {exc.message}")


_PAGES = Path(__file__).parent / "views"


def open_run(run_id: int) -> None:
    """Go to the run's page (stops the current script)."""
    st.switch_page(_PAGES / "run.py", query_params={"run": str(run_id)})
