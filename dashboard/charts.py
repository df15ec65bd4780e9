"""Plotly figures for the dashboard, built from plain API answers (no Streamlit here).

Every figure leaves colours of paper, fonts and grid to the caller's theme (Streamlit's
`theme="streamlit"` restyles them for light and dark), and only fixes what carries meaning:
one colour per phase in the timeline, one per device in device charts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

__all__ = [
    "PHASE_COLORS",
    "LINE_COLORS",
    "Panel",
    "metric_panels",
    "line_figure",
    "phase_spans",
    "gantt_figure",
    "phase_share",
    "overlay_figure",
]

Point = Mapping[str, Any]  # {"step", "value", "time"}

# Colour-blind-safe (Okabe-Ito) hues that read on white and on near-black backgrounds.
PHASE_COLORS: dict[str, str] = {
    "rollout": "#0072B2",
    "reward": "#E69F00",
    "reference": "#CC79A7",
    "train": "#009E73",
    "weight_sync": "#D55E00",
    "eval": "#56B4E9",
    "checkpoint": "#999999",
    "rollout_wait": "#C8C8C8",  # a trainer waiting for rollouts: shown pale, close to idle
    "idle": "#E0E0E0",
}
_FALLBACK_COLORS = ("#F0E442", "#882255", "#44AA99", "#117733", "#332288", "#AA4499")
# Lines (devices, runs, keys of one panel): distinct hues, none too dark for a dark theme.
LINE_COLORS = ("#3A8FD9", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#999999",
               "#F0E442")


@dataclass
class Panel:
    """One chart on the run page: a title, the metric keys it draws and their legend labels.

    `primary` panels are the ones a person watches (DESIGN.md §3.7); the rest are extras."""

    title: str
    keys: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    y_title: str = ""
    primary: bool = True

    def label(self, key: str) -> str:
        return self.labels.get(key, key)


_DEVICE_KEY = re.compile(r"^device/(\d+)/(.+)$")

# Charts of keys that share a prefix and a scale, in the order a person scans a run: is it
# fast, is the hardware busy, is it learning. (title, prefix, y-axis title, key filter):
# keys of one prefix but another scale (a count among fractions) are left to later rules.
_PREFIX_PANELS: tuple[tuple[str, str, str, Callable[[str], bool]], ...] = (
    ("Throughput (tokens/s)", "throughput/", "tokens/s", lambda k: "token" in k),
    ("Throughput (samples/s)", "throughput/", "samples/s", lambda k: "sample" in k),
    ("Throughput", "throughput/", "per second", lambda k: True),
)
_LEARNING_PANELS: tuple[tuple[str, str, str, Callable[[str], bool]], ...] = (
    ("Reward", "reward/", "reward", lambda k: "failed" not in k),
    ("KL", "kl/", "KL", lambda k: True),
    ("Losses", "loss/", "loss", lambda k: True),
    ("Response length", "response/length", "tokens", lambda k: True),
    ("Dynamic sampling ratios", "sampling/", "ratio",
     lambda k: any(w in k for w in ("fraction", "ratio", "fill"))),
    ("Dynamic sampling counts", "sampling/", "count", lambda k: True),
    ("Time per phase", "time/", "seconds", lambda k: True),
)
_DEVICE_PANELS: tuple[tuple[str, str, str], ...] = (
    ("Device utilization", "util_pct", "%"),
    ("Device memory", "memory_mb", "MB"),
    ("Device busy fraction", "busy_frac", "fraction"),
)
_DEVICE_CONSTANTS = frozenset({"memory_total_mb"})  # the device's capacity: not worth a chart


def metric_panels(keys: Iterable[str]) -> list[Panel]:
    """Group metric keys into the run page's charts; every key lands in at most one panel.

    Device metrics get one line per device (`device/<i>/util_pct` → "device 0"); keys of one
    prefix and scale (`reward/*`, `kl/*`, …) share a chart; anything else gets a chart of
    its own. Constants such as `device/<i>/memory_total_mb` are not drawn.
    """
    remaining = sorted(set(keys), key=_natural_key)
    used: set[str] = set()
    panels: list[Panel] = []
    for title, prefix, y_title, keep in _PREFIX_PANELS:
        panels += _prefix_panel(remaining, used, title, prefix, y_title, keep)

    by_metric: dict[str, list[str]] = defaultdict(list)
    device_of: dict[str, str] = {}
    for key in remaining:
        m = _DEVICE_KEY.match(key)
        if m:
            by_metric[m.group(2)].append(key)
            device_of[key] = f"device {m.group(1)}"
    used.update(k for metric in _DEVICE_CONSTANTS for k in by_metric.pop(metric, []))
    titles = {metric: (title, y_title) for title, metric, y_title in _DEVICE_PANELS}
    ordered = [m for _, m, _ in _DEVICE_PANELS if m in by_metric]
    ordered += sorted(set(by_metric) - set(ordered))
    for metric in ordered:
        title, y_title = titles.get(metric, (f"Device {metric.replace('_', ' ')}", ""))
        keys_here = by_metric[metric]
        panels.append(Panel(title, keys_here, {k: device_of[k] for k in keys_here}, y_title))
        used.update(keys_here)

    for title, prefix, y_title, keep in _LEARNING_PANELS:
        panels += _prefix_panel(remaining, used, title, prefix, y_title, keep)
    # the rest: one chart per prefix (`advantage/*`, `warm_start/*`), or per key
    groups: dict[str, list[str]] = defaultdict(list)
    for key in remaining:
        if key not in used:
            groups[key.rsplit("/", 1)[0] if "/" in key else key].append(key)
    for prefix, keys_here in groups.items():
        labels = {k: k.rsplit("/", 1)[-1] for k in keys_here}
        panels.append(Panel(prefix if len(keys_here) > 1 else keys_here[0], keys_here, labels,
                            primary=False))
    return panels


def _prefix_panel(
    keys: list[str],
    used: set[str],
    title: str,
    prefix: str,
    y_title: str,
    keep: Callable[[str], bool],
) -> list[Panel]:
    mine = [k for k in keys if k.startswith(prefix) and k not in used and keep(k)]
    if not mine:
        return []
    used.update(mine)
    label_from = prefix if prefix.endswith("/") else prefix.rsplit("/", 1)[0] + "/"
    return [Panel(title, mine, {k: k[len(label_from):] for k in mine}, y_title)]


def _natural_key(key: str) -> list[Any]:
    # device/10 after device/9
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _xs(points: Sequence[Point], x: str) -> tuple[list[Any], str]:
    """x values and axis title: steps, wall-clock times (UTC), or seconds since the first point."""
    if x == "time":
        return [datetime.fromtimestamp(p["time"], UTC) for p in points], "time (UTC)"
    if x == "elapsed":
        t0 = points[0]["time"] if points else 0.0
        return [p["time"] - t0 for p in points], "seconds since the run's first report"
    return [p["step"] for p in points], "step"


def _axis_title(x: str) -> str:
    # step numbers and dates read without a title; elapsed seconds need one
    return _xs([], x)[1] if x == "elapsed" else ""


def _line(name: str, points: Sequence[Point], x: str, color: str) -> go.Scatter:
    xs, _ = _xs(points, x)
    return go.Scatter(
        x=xs,
        y=[p["value"] for p in points],
        mode="lines" if len(points) > 1 else "markers",
        line={"color": color, "width": 1.6},
        marker={"color": color},
        name=name,
        hovertemplate=f"{name}: %{{y:.4g}}<extra></extra>",  # the unified hover heads with x
    )


def line_figure(
    panel: Panel,
    series: Mapping[str, Sequence[Point]],
    *,
    x: str = "step",
    height: int = 280,
) -> go.Figure:
    """One line per key of the panel that has points; x is `step`, `time` or `elapsed`."""
    fig = go.Figure()
    for i, key in enumerate(panel.keys):
        points = series.get(key) or []
        if points:
            fig.add_trace(_line(panel.label(key), points, x, LINE_COLORS[i % len(LINE_COLORS)]))
    _style(fig, panel.title, x_title=_axis_title(x), y_title=panel.y_title, height=height)
    fig.update_layout(showlegend=len(fig.data) > 1)
    return fig


def overlay_figure(
    metric: str,
    series_by_run: Mapping[str, Sequence[Point]],
    *,
    x: str = "step",
    height: int = 380,
) -> go.Figure:
    """One metric, one line per run (Compare page); legend entries are the runs' labels.

    With x="elapsed" each run is measured from its own first report, so runs started on
    different days line up."""
    fig = go.Figure()
    for i, (label, points) in enumerate(series_by_run.items()):
        if points:
            fig.add_trace(_line(label, points, x, LINE_COLORS[i % len(LINE_COLORS)]))
    _style(fig, metric, x_title=_axis_title(x), y_title="", height=height)
    return fig


def phase_spans(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """All spans carried by `phase_spans` events, sorted by start time.

    Each span is `{"device", "phase", "start", "end", "step"}` (times in unix seconds);
    malformed spans (missing fields, end before start) are skipped rather than drawn wrong.
    """
    spans: list[dict[str, Any]] = []
    for event in events:
        if event.get("kind") != "phase_spans":
            continue
        for span in (event.get("data") or {}).get("spans") or []:
            try:
                start, end = float(span["start"]), float(span["end"])
                item = {
                    "device": int(span["device"]),
                    "phase": str(span["phase"]),
                    "start": start,
                    "end": end,
                    "step": int(span.get("step", -1)),
                }
            except (KeyError, TypeError, ValueError):
                continue
            if end >= start:
                spans.append(item)
    spans.sort(key=lambda s: (s["start"], s["device"]))
    return spans


def placement_switches(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Placement changes applied during a run (`placement.mode: auto`): for each, the first step
    the new plan ran (`step`) and its name (`plan`), from the `placement` events whose
    `decision` is `applied`."""
    out: list[dict[str, Any]] = []
    for event in events:
        data = event.get("data") or {}
        if event.get("kind") != "placement" or data.get("decision") != "applied":
            continue
        try:
            out.append({"step": int(data["step"]) + 1, "plan": str(data.get("plan") or "")})
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _phase_color(phase: str, extra: dict[str, str]) -> str:
    if phase in PHASE_COLORS:
        return PHASE_COLORS[phase]
    if phase not in extra:
        extra[phase] = _FALLBACK_COLORS[len(extra) % len(_FALLBACK_COLORS)]
    return extra[phase]


def gantt_figure(
    spans: Sequence[Mapping[str, Any]],
    *,
    last_steps: int | None = None,
    height: int | None = None,
    title: str = "Phase timeline",
    switches: Sequence[Mapping[str, Any]] = (),
) -> go.Figure:
    """Per-device phase timeline: one row per device, one bar per span, gaps are idle time.

    The x axis is seconds since the first span shown; `last_steps` keeps only the newest steps
    so a long run stays readable (and cheap to draw). Each of `switches` (`placement_switches`)
    whose first step is shown is marked by a dashed line where that step starts.
    """
    shown = list(spans)
    if last_steps is not None and shown:
        steps = sorted({s["step"] for s in shown})
        keep = set(steps[-last_steps:])
        shown = [s for s in shown if s["step"] in keep]
    fig = go.Figure()
    if not shown:
        _style(fig, title, x_title="seconds", y_title="", height=height or 160, unified=False)
        return fig
    t0 = min(s["start"] for s in shown)
    devices = sorted({s["device"] for s in shown})
    by_phase: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in shown:
        by_phase[s["phase"]].append(s)
    extra: dict[str, str] = {}
    order = [p for p in PHASE_COLORS if p in by_phase] + sorted(set(by_phase) - set(PHASE_COLORS))
    for phase in order:
        items = by_phase[phase]
        fig.add_trace(
            go.Bar(
                orientation="h",
                name=phase,
                y=[f"device {s['device']}" for s in items],
                base=[s["start"] - t0 for s in items],
                x=[max(s["end"] - s["start"], 1e-6) for s in items],
                marker_color=_phase_color(phase, extra),
                customdata=[[s["step"], s["end"] - s["start"]] for s in items],
                hovertemplate=(
                    f"{phase}<br>%{{y}}<br>step %{{customdata[0]}}"
                    "<br>%{base:.2f}s → +%{customdata[1]:.3f}s<extra></extra>"
                ),
            )
        )
    for switch in switches:
        starts = [s["start"] for s in shown if s["step"] == switch["step"]]
        if starts:
            fig.add_vline(x=min(starts) - t0, line_dash="dash", line_color="#444444",
                          annotation_text=f"placement → {switch['plan']}",
                          annotation_position="top left")
    rows = [f"device {d}" for d in devices]
    _style(fig, title, x_title="seconds since the first span shown", y_title="",
           height=height or max(180, 70 + 44 * len(devices)), unified=False)
    fig.update_layout(barmode="overlay", bargap=0.25,
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1,
                              "xanchor": "right"})
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(rows)))
    return fig


def phase_share(spans: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per device: seconds in each phase and the idle share of the window the spans cover.

    Answers "is this placement balanced": a device that mostly waits has a high idle share.
    Overlapping spans on one device are merged before busy time is counted.
    """
    if not spans:
        return []
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    window = max(t1 - t0, 1e-9)
    per_device: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for s in spans:
        per_device[s["device"]].append(s)
    present = {s["phase"] for s in spans}
    phases = [p for p in PHASE_COLORS if p in present] + sorted(present - set(PHASE_COLORS))
    rows = []
    for device in sorted(per_device):
        items = per_device[device]
        row: dict[str, Any] = {"device": device, **dict.fromkeys(phases, 0.0)}
        for s in items:
            row[s["phase"]] += s["end"] - s["start"]
        busy = _union_length([(s["start"], s["end"]) for s in items])
        row["busy_s"] = busy
        row["idle_pct"] = 100.0 * (1.0 - busy / window)
        rows.append(row)
    return rows


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    cur_start: float | None = None
    cur_end = 0.0
    for start, end in sorted(intervals):
        if cur_start is None or start > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def _style(
    fig: go.Figure, title: str, *, x_title: str, y_title: str, height: int, unified: bool = True
) -> None:
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left", "font": {"size": 15}},
        height=height,
        margin={"l": 10, "r": 10, "t": 40, "b": 10},
        # below the tick labels; the x axis has no title then (ticks and the page say it)
        legend={"orientation": "h", "yanchor": "top", "y": -0.16, "x": 0},
        hovermode="x unified" if unified else "closest",
    )
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
