"""Launch page: start from a ready config or pasted YAML, adjust the common fields, validate
against the API (errors beside their fields), then submit and land on the run's page."""

from __future__ import annotations

import os
import uuid
import zlib
from pathlib import Path
from typing import Any

import streamlit as st

from dashboard import api, session
from dashboard.launch_form import (
    FORM_FIELDS,
    FormField,
    config_files,
    errors_by_field,
    field_value,
    merge_form,
    parse_yaml,
    submission_key,
)

CONFIGS_DIR = Path(os.environ.get("YATT_CONFIGS_DIR") or Path(__file__).parents[2] / "configs")
PASTE = "paste YAML"
NEW_EXPERIMENT = "+ new experiment"

c = session.client()
st.title("Launch a run")

# 1. The starting point: a ready config or pasted YAML.
files = {p.name: p for p in config_files(CONFIGS_DIR)}
source = st.selectbox("Start from", [*files, PASTE], key="l_source",
                      help=f"Ready configs from {CONFIGS_DIR}")
if source == PASTE:
    yaml_text = st.text_area("Config YAML", height=260, key="l_yaml_paste",
                             placeholder="train:\n  max_steps: 20\nplacement:\n  devices: 2")
else:
    yaml_text = st.text_area("Config YAML", value=files[source].read_text(), height=260,
                             key=f"l_yaml_{source}",
                             help="Edit freely; the form below overrides the fields it shows.")
base, yaml_error = parse_yaml(yaml_text)
if yaml_error:
    st.error(yaml_error)
    st.stop()
assert base is not None  # st.stop() ended the script otherwise
config_base: dict[str, Any] = base

def _widget(f: FormField, key: str) -> Any:
    value = field_value(config_base, f.path)
    if f.kind == "select":
        options = list(f.options)
        return st.selectbox(f.label, options, index=options.index(value) if value in options
                            else 0, key=key, help=f.help or None)
    if f.kind == "bool":
        return st.toggle(f.label, value=bool(value), key=key, help=f.help or None)
    if f.kind == "int":
        return st.number_input(f.label, value=int(value), step=1, key=key, help=f.help or None)
    if f.kind == "float":
        return st.number_input(f.label, value=float(value), format="%g", key=key,
                               help=f.help or None)
    return st.text_input(f.label, value="" if value is None else str(value), key=key,
                         help=f.help or None)


# Widget keys carry the source and a hash of the YAML so that new YAML resets the form to it.
form_key = f"{source}-{zlib.crc32(yaml_text.encode()):x}"
try:
    experiments = [e["name"] for e in api.list_experiments(c)]
except api.ApiError as exc:
    session.show_api_error(exc, "list experiments")
    experiments = []

with st.form("launch"):
    st.subheader("Run")
    top = st.columns([2, 2, 3])
    exp_choice = top[0].selectbox("Experiment", [*experiments, NEW_EXPERIMENT], key="l_exp")
    new_exp = top[1].text_input("New experiment name", key="l_new_exp",
                                help="Used when '+ new experiment' is chosen; created on submit.")
    name = top[2].text_input("Run name", key="l_name", placeholder="optional")
    mid = st.columns([3, 2])
    description = mid[0].text_input("Description", key="l_description")
    tags_text = mid[1].text_input("Tags", key="l_tags", placeholder="comma,separated")
    st.subheader("Common settings")
    values: dict[str, Any] = {}
    slots: dict[str, Any] = {}  # error placeholders beside each field, filled after validation
    cols = st.columns(3)
    for i, f in enumerate(FORM_FIELDS):
        with cols[i % 3]:
            values[f.path] = _widget(f, f"l_field_{f.path}_{form_key}")
            slots[f.path] = st.empty()
    other_slot = st.empty()
    buttons = st.columns([1, 1, 5])
    validate = buttons[0].form_submit_button("Validate", icon=":material/fact_check:")
    submit = buttons[1].form_submit_button("Launch", type="primary",
                                           icon=":material/rocket_launch:")

if values.get("model.path") == "":
    values["model.path"] = field_value(base, "model.path")
config = merge_form(base, values)


def _show_errors(errors: list[tuple[str, str]]) -> None:
    """Errors beside their fields; the rest (group checks, YAML-only fields) under the form.

    Kept in session state so they stay visible until the next validation."""
    st.session_state["l_errors"] = errors
    beside, rest = errors_by_field(errors)
    for path, messages in beside.items():
        with slots[path].container():
            for message in messages:
                st.error(message, icon=":material/error:")
    if rest:
        with other_slot.container():
            for path, message in rest:
                st.error(f"`{path or 'config'}`: {message}", icon=":material/error:")


def _check(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Ask the API to validate; the normalized config, or None with the errors shown."""
    try:
        normalized = api.validate_config(c, cfg)
    except api.ApiError as exc:
        if exc.status == 422:
            _show_errors(exc.errors or [("", exc.message)])
        else:
            session.show_api_error(exc, "validate the config")
        return None
    _show_errors([])
    return normalized


if not (validate or submit):
    # a plain view of the form starts a new visit: submissions until the next one share its
    # Idempotency-Key base, so a double click on Launch makes one run
    st.session_state["l_visit"] = uuid.uuid4().hex
    _show_errors(st.session_state.get("l_errors", []))
else:
    normalized = _check(config)
    if normalized is not None and validate:
        st.success("The config is valid.", icon=":material/check_circle:")
        with st.expander("Normalized config (every default filled in)"):
            st.json(normalized, expanded=False)
    if normalized is not None and submit:
        experiment = new_exp.strip() if exp_choice == NEW_EXPERIMENT else exp_choice
        if not experiment:
            st.error("Name the new experiment, or choose an existing one.")
            st.stop()
        tags = [t.strip() for t in tags_text.split(",") if t.strip()]
        request = {"experiment": experiment, "config": config, "tags": tags,
                   "name": name.strip() or None, "description": description.strip() or None}
        visit = st.session_state.setdefault("l_visit", uuid.uuid4().hex)
        try:
            run = api.create_run(c, **request, idempotency_key=submission_key(visit, request))
        except api.ApiError as exc:
            if exc.status == 422 and exc.errors:
                _show_errors(exc.errors)
            else:
                session.show_api_error(exc, "launch the run")
            st.stop()
        st.session_state.pop("l_errors", None)
        session.open_run(run["id"])

with st.expander("Config that will be submitted"):
    st.json(config, expanded=True)
