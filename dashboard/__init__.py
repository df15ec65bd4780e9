"""The yatt web dashboard (Streamlit): launch runs, watch them live, browse and compare history.

- `app.py` — the entry script: page setup, token check, navigation.
- `views/` — one script per page: history, launch, run, compare, cluster.
- `api.py` — every call to the API, through `backend.client.YattClient` (never the database).
- `session.py` — API URL and token (YATT_API_URL / YATT_TOKEN or the login box).
- `charts.py`, `tables.py`, `launch_form.py` — pure functions from API answers to Plotly
  figures, tables and the launch form; unit-tested without Streamlit.
- `cli.py` — `yatt dashboard [--port P] [--api-url U]`.
"""
