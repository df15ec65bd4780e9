"""Tables and text for the dashboard, built from plain API answers (no Streamlit here)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from backend.runs.state import CANCELLABLE, TERMINAL, UNFINISHED, retry_pending

__all__ = [
    "ACTIVE_STATES",
    "TERMINAL_STATES",
    "CANCELLABLE_STATES",
    "keeps_refreshing",
    "flatten",
    "config_diff",
    "launched_by",
    "run_rows",
    "metrics_csv",
    "parse_time",
    "format_duration",
    "event_rows",
    "ClusterView",
    "cluster_tables",
    "summary_value",
    "RunEvents",
]

# from the one definition in backend/runs/state.py: "active" here is every unfinished state
ACTIVE_STATES = frozenset(s.value for s in UNFINISHED)
TERMINAL_STATES = frozenset(s.value for s in TERMINAL)
CANCELLABLE_STATES = frozenset(s.value for s in CANCELLABLE)


def keeps_refreshing(run: Mapping[str, Any]) -> bool:
    """Whether a live view of `run` should keep refreshing: unfinished, or failed with a retry
    the dispatcher will queue."""
    state = str(run.get("state"))
    return state in ACTIVE_STATES or retry_pending(
        state, int(run.get("attempt") or 1), int(run.get("max_attempts") or 1)
    )
_MISSING = "—"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict → {"dotted.path": leaf}; lists stay whole leaves (shown as JSON)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def config_diff(configs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows `{"key", <label>: value, ...}` for each dotted key whose value differs across runs.

    A key absent from one config shows as "—" there. Values are rendered as short text so
    that a list and a number can sit in one column.
    """
    flat = {label: flatten(cfg) for label, cfg in configs.items()}
    keys = sorted(set().union(*(f.keys() for f in flat.values()))) if flat else []
    rows = []
    for key in keys:
        values = [f.get(key, _MISSING) for f in flat.values()]
        rendered = [_render(v) for v in values]
        if len(set(rendered)) > 1:
            rows.append({"key": key, **dict(zip(flat.keys(), rendered, strict=True))})
    return rows


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def parse_time(value: str | float | int | None) -> datetime | None:
    """An ISO-8601 string or unix seconds → aware UTC datetime; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(float(value), tz=UTC)
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_duration(seconds: float | None) -> str:
    """3725 → '1h 2m 5s'; None → '—'."""
    if seconds is None:
        return _MISSING
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def launched_by(run: Mapping[str, Any]) -> tuple[str, str | None]:
    """(who launched the run, pipeline URL or None): a person's name, or CI with its commit."""
    ci = run.get("ci") or {}
    if run.get("launched_by") == "ci" or ci:
        commit = str(ci.get("commit") or ci.get("sha") or "")[:8]
        branch = ci.get("branch")
        label = "CI"
        if commit:
            label += f" {commit}"
        if branch:
            label += f" ({branch})"
        return label, ci.get("pipeline_url") or ci.get("url")
    return str(run.get("launched_by_name") or run.get("launched_by") or "user"), None


def _duration(run: Mapping[str, Any], now: datetime) -> float | None:
    started = parse_time(run.get("started_at"))
    if started is None:
        return None
    ended = parse_time(run.get("finished_at") or run.get("ended_at"))
    return ((ended or now) - started).total_seconds()


def run_rows(
    runs: Iterable[Mapping[str, Any]],
    *,
    metric: str | None = None,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """One flat row per run for the History table (and the Compare picker).

    With `metric`, a column holds that summary metric's latest value (None when absent).
    """
    now = now or datetime.now(UTC)
    rows = []
    for run in runs:
        who, pipeline = launched_by(run)
        row: dict[str, Any] = {
            "id": run["id"],
            "name": run.get("name") or f"run {run['id']}",
            "experiment": _experiment_name(run),
            "state": run.get("state", ""),
            "attempt": run.get("attempt") or run.get("attempts") or 1,
            "launched by": who,
            "pipeline": pipeline,
            "created": parse_time(run.get("created_at")),
            "duration": format_duration(_duration(run, now)),
            "tags": ", ".join(run.get("tags") or []),
        }
        if metric:
            row[metric] = summary_value(run, metric)
        rows.append(row)
    return rows


def _experiment_name(run: Mapping[str, Any]) -> str:
    exp = run.get("experiment")
    if isinstance(exp, Mapping):
        return str(exp.get("name", ""))
    return str(exp or run.get("experiment_name") or "")


def summary_value(run: Mapping[str, Any], key: str) -> float | None:
    """The run's value for a metric key: the latest reported point (`metrics`, present when the
    listing was asked for that key), else the trainer's final summary."""
    value = (run.get("metrics") or {}).get(key)
    if value is None:
        value = (run.get("summary") or {}).get(key)
    if isinstance(value, Mapping):
        value = value.get("latest", value.get("last"))
    return float(value) if isinstance(value, int | float) else None


def metrics_csv(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Long-format CSV: `key,step,value,time` — one line per point, keys in order."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["key", "step", "value", "time"])
    for key in sorted(series):
        for p in series[key]:
            writer.writerow([key, p.get("step"), p.get("value"), p.get("time")])
    return buf.getvalue()


def event_rows(events: Iterable[Mapping[str, Any]], *, include_spans: bool = False) -> list[dict[str, Any]]:
    """Events for the run's timeline table, newest first; `phase_spans` hidden by default
    (they are drawn in the Gantt chart, not read as text)."""
    rows = []
    for e in events:
        if e.get("kind") == "phase_spans" and not include_spans:
            continue
        data = e.get("data") or {}
        rows.append(
            {
                "time": parse_time(e.get("time") or e.get("created_at")),
                "kind": e.get("kind", ""),
                "message": e.get("message", ""),
                "data": json.dumps(data, sort_keys=True) if data else "",
            }
        )
    rows.sort(key=lambda r: r["time"] or datetime.min.replace(tzinfo=UTC), reverse=True)
    return rows


@dataclass
class ClusterView:
    """GET /cluster, shaped for the page: headline numbers, tables by title, a note."""

    capacity: dict[str, str] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    note: str = ""


def _cell(value: Any) -> Any:
    if isinstance(value, Mapping | list):
        return json.dumps(value, sort_keys=True)
    return value


def cluster_tables(info: Mapping[str, Any]) -> ClusterView:
    """Lists become tables (nested records flattened to dotted columns), `assignments` the
    "Devices by role" table (`device_role_rows`); numbers and small records become headline
    figures; text becomes the note."""
    view = ClusterView()
    for key, value in info.items():
        title = key.replace("_", " ").capitalize()
        if key == "assignments" and isinstance(value, list):
            view.tables["Devices by role"] = device_role_rows(value, info.get("nodes") or [])
        elif isinstance(value, list):
            view.tables[title] = [
                {k: _cell(v) for k, v in flatten(item).items()} if isinstance(item, Mapping)
                else {"value": item}
                for item in value
            ]
        elif isinstance(value, Mapping):
            for sub, leaf in flatten(value).items():
                if isinstance(leaf, int | float | str) and not isinstance(leaf, bool):
                    view.capacity[f"{title} {sub.replace('_', ' ')}"] = _figure(leaf)
        elif isinstance(value, bool):
            view.capacity[title] = "yes" if value else "no"
        elif isinstance(value, int | float):
            view.capacity[title] = _figure(value)
        elif isinstance(value, str):
            view.note = (view.note + " · " if view.note else "") + f"{title}: {value}"
    return view


def device_role_rows(assignments: Iterable[Mapping[str, Any]],
                     nodes: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """GET /cluster `assignments` as the "Devices by role" table, grouped by node: one row per
    device of a run (node, device, role, run). A device with no node id is on the only node when
    the cluster has one, else its node is unknown ("—")."""
    node_ids = [n.get("node_id") for n in nodes if isinstance(n, Mapping)]
    sole = node_ids[0] if len(node_ids) == 1 else None
    keyed = []
    for a in assignments:
        if not isinstance(a, Mapping):
            continue
        node = a.get("node_id") or sole or "—"
        row = {"node": node, "device": a.get("device"),
               "role": " + ".join(a.get("roles") or []) or "—",
               "run": f"#{a.get('run_id')} {a.get('run_name') or ''}".strip()}
        keyed.append(((node == "—", str(node), a.get("run_id") or 0, a.get("device") or 0), row))
    return [row for _, row in sorted(keyed, key=lambda kr: kr[0])]


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


@dataclass
class RunEvents:
    """A run's events as read so far, fetched incrementally by id.

    Text events are all kept; `phase_spans` events are kept for the newest `keep_steps` steps
    only, so a long run's timeline stays small in memory and cheap to draw.
    """

    keep_steps: int = 50
    last_id: int = 0
    text: list[dict[str, Any]] = field(default_factory=list)
    span_events: list[dict[str, Any]] = field(default_factory=list)

    def absorb(self, events: Iterable[Mapping[str, Any]]) -> int:
        """Add newly fetched events (in id order); returns how many were new."""
        n = 0
        for e in events:
            if int(e.get("id", 0)) <= self.last_id:
                continue
            self.last_id = int(e["id"])
            n += 1
            if e.get("kind") == "phase_spans":
                self.span_events.append(dict(e))
            else:
                self.text.append(dict(e))
        if n and self.span_events:
            self._trim()
        return n

    def _trim(self) -> None:
        steps = sorted({int(s.get("step", -1)) for e in self.span_events
                        for s in (e.get("data") or {}).get("spans") or []})
        if len(steps) <= self.keep_steps:
            return
        floor = steps[-self.keep_steps]
        self.span_events = [
            e for e in self.span_events
            if any(int(s.get("step", -1)) >= floor for s in (e.get("data") or {}).get("spans") or [])
        ]
