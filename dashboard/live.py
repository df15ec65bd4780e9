"""What the run page keeps between refreshes, so each refresh fetches only what is new (no
Streamlit here): chart series grown by the steps after the last one held, and checkpoints and
attempts fetched again only when the run's events or state say they changed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.client import YattClient


@dataclass
class LiveSeries:
    """A run's chart series. The first fetch of a key is downsampled to `max_points`; each
    refresh then asks only for the points after the key's last step. A key whose series has
    grown past twice `max_points`, whose steps went back, or that lacks more than one page is
    fetched downsampled again. `attempt` changes (a resumed attempt rewrites steps) refetch all."""

    max_points: int = 800
    attempt: int = 0
    series: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    requests: int = 0  # API calls made, for tests and curiosity
    points_fetched: int = 0

    def refresh(
        self, client: YattClient, run_id: int, keys: Sequence[str],
        summaries: Mapping[str, Mapping[str, Any]], attempt: int,
    ) -> dict[str, list[dict[str, Any]]]:
        """The series of `keys`, brought up to date with `summaries` (GET /metric-keys)."""
        if attempt != self.attempt:
            self.series, self.attempt = {}, attempt
        full: list[str] = []
        grow: dict[str, int] = {}
        for key in keys:
            held = self.series.get(key)
            latest = int(summaries.get(key, {}).get("latest_step") or 0)
            if held is None or (held and latest < held[-1]["step"]):
                full.append(key)
            elif not held or latest > held[-1]["step"]:
                grow[key] = held[-1]["step"] if held else -1
        if grow:
            after = min(grow.values())
            new = self._get(client, run_id, list(grow), after_step=after)
            for key, points in new.items():
                last = grow[key]
                fresh = [p for p in points if p["step"] > last]
                if len(points) >= self.max_points or len(self.series[key]) + len(fresh) > 2 * self.max_points:
                    full.append(key)  # a long gap, or enough points to thin again
                else:
                    self.series[key].extend(fresh)
        if full:
            self.series.update(self._get(client, run_id, full, after_step=None))
        return {key: self.series.get(key, []) for key in keys}

    def _get(
        self, client: YattClient, run_id: int, keys: list[str], after_step: int | None
    ) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for start in range(0, len(keys), 200):  # the API's limit of keys in one read
            chunk = client.metrics(run_id, keys[start:start + 200], max_points=self.max_points,
                                   after_step=after_step)
            self.requests += 1
            self.points_fetched += sum(len(v) for v in chunk.values())
            out.update(chunk)
        return out


@dataclass
class FetchedWhenChanged:
    """A value fetched again only when its `version` (something cheap the page already has,
    like the count of checkpoint events or the run's attempt and state) changes."""

    version: Any = None
    value: Any = None

    def get(self, version: Any, fetch: Any) -> Any:
        if self.value is None or version != self.version:
            self.value, self.version = fetch(), version
        return self.value


@dataclass
class LiveLog:
    """The last `keep_lines` lines of an attempt's log: the first read asks for that tail, each
    later one only for the text after the length already read (`GET /logs?offset=`)."""

    keep_lines: int = 200
    attempt: int = 0
    length: int | None = None
    text: str = ""
    requests: int = 0

    def refresh(self, client: YattClient, run_id: int, attempt: int) -> str:
        if attempt != self.attempt:
            self.attempt, self.length, self.text = attempt, None, ""
        if self.length is not None:
            new, length = client.logs_since(run_id, self.length, attempt=attempt)
            self.requests += 1
            if length >= self.length:
                self._keep(self.text + new, length)
                return self.text
        # the first read, or a shorter copy than the one read so far (Ray's is gone): its tail
        tail, length = client.logs_since(run_id, None, tail=self.keep_lines, attempt=attempt)
        self.requests += 1
        self._keep(tail, length)
        return self.text

    def _keep(self, text: str, length: int) -> None:
        self.text = "".join(text.splitlines(keepends=True)[-self.keep_lines:])
        self.length = length
