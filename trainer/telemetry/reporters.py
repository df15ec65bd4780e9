"""Where a run's metrics, events, checkpoints and state go.

`JsonlReporter` always writes `metrics.jsonl`, `events.jsonl` and `summary.json` under the run
directory. `HttpReporter` sends the same records to the backend API (docs/contracts.md) from a
background thread: batched, retried, spooled to disk while the API is unreachable and replayed
afterwards in order, so nothing is lost. Every metric batch carries a batch id that stays with it
on disk, so a batch resent after a timeout is applied once. The spool is per attempt: a trainer
restarted within an attempt replays what it left, a later attempt never replays an earlier
attempt's batches (that attempt's token is revoked, and its stale state must not land on the new
one). `make_reporter` picks them from the environment.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import httpx

__all__ = ["Reporter", "JsonlReporter", "HttpReporter", "MultiReporter", "make_reporter"]

log = logging.getLogger(__name__)


class Reporter(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float], time_s: float | None = None) -> None: ...
    def log_warm_start(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None: ...
    def log_checkpoint(self, step: int, path: str, size_bytes: int, metrics: dict[str, float]) -> None: ...
    def set_state(self, state: str, reason: str | None = None, summary: dict[str, Any] | None = None) -> None: ...
    def write_summary(self, summary: dict[str, Any]) -> None: ...
    def close(self, timeout_s: float = 10.0) -> None: ...


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    # NaN and inf are not JSON and mean nothing on a chart.
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}


class JsonlReporter:
    """Append-only JSONL files: one line per step in metrics.jsonl, one per event in events.jsonl."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with self._lock, open(self.out_dir / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log_metrics(self, step: int, metrics: dict[str, float], time_s: float | None = None) -> None:
        self._append("metrics.jsonl", {"step": step, "time": time_s or time.time(), **_finite(metrics)})

    def log_warm_start(self, step: int, metrics: dict[str, float]) -> None:
        # SFT warm-start steps have their own axis: metrics.jsonl keeps one line per RL step
        self._append("warm_start.jsonl", {"step": step, "time": time.time(), **_finite(metrics)})

    def log_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._append("events.jsonl",
                     {"time": time.time(), "kind": kind, "message": message, "data": data or {}})

    def log_checkpoint(self, step: int, path: str, size_bytes: int, metrics: dict[str, float]) -> None:
        self.log_event("checkpoint", f"checkpoint at step {step}",
                       {"step": step, "path": path, "size_bytes": size_bytes, "metrics": _finite(metrics)})

    def set_state(self, state: str, reason: str | None = None, summary: dict[str, Any] | None = None) -> None:
        self.log_event("state", state, {"state": state, "reason": reason})

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.out_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
        tmp.replace(self.out_dir / "summary.json")

    def close(self, timeout_s: float = 10.0) -> None:
        pass


# Statuses worth retrying: the API is down, overloaded or restarting. Anything else 4xx is final.
_RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


class HttpReporter:
    """Sends records to `{api_url}/api/v1/runs/{run_id}/...` with the run token.

    Records are queued in order and flushed every `flush_interval_s` by one thread; consecutive
    metric points (up to `max_batch`) and consecutive events travel in one request. A batch that
    fails with a network error or a retryable status is written to `spool_dir` and retried, oldest
    first, before anything newer is sent. A final 4xx (bad token, 409 on an illegal state move) is
    logged and dropped: it can never succeed.
    """

    def __init__(self, api_url: str, token: str, run_id: int | str, *, spool_dir: str | Path,
                 flush_interval_s: float = 1.0, max_batch: int = 2000, timeout_s: float = 5.0,
                 retry_backoff_s: float = 0.5):
        self.base = f"{api_url.rstrip('/')}/api/v1/runs/{run_id}"
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.retry_backoff_s = retry_backoff_s
        self._client = httpx.Client(timeout=timeout_s,
                                    headers={"Authorization": f"Bearer {token}"})
        self._pending: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        # one sender at a time: close() drains while a slow final flush of the thread may still
        # run, and two drains would send a batch twice and race on its file
        self._drain_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._seq = self._last_spool_seq()
        self._batch_prefix = uuid.uuid4().hex[:12]  # batch ids stay unique across restarts
        self.sent_batches = 0
        self.dropped_batches = 0
        self._thread = threading.Thread(target=self._loop, name="yatt-http-reporter", daemon=True)
        self._thread.start()

    # -- the Reporter interface: everything only queues -------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, float], time_s: float | None = None) -> None:
        t = time_s or time.time()
        self._put([("metrics", {"key": k, "step": step, "value": v, "time": t})
                   for k, v in _finite(metrics).items()])

    def log_warm_start(self, step: int, metrics: dict[str, float]) -> None:
        self.log_metrics(step, metrics)  # the keys (warm_start/*) keep the series apart

    def log_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._put([("events", {"kind": kind, "message": message, "data": data or {},
                               "time": time.time()})])

    def log_checkpoint(self, step: int, path: str, size_bytes: int, metrics: dict[str, float]) -> None:
        self._put([("checkpoints", {"step": step, "path": path, "size_bytes": size_bytes,
                                    "metrics": _finite(metrics)})])

    def set_state(self, state: str, reason: str | None = None, summary: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"state": state}
        if reason is not None:
            body["reason"] = reason
        if summary is not None:
            body["summary"] = summary
        self._put([("state", body)])
        self._wake.set()

    def write_summary(self, summary: dict[str, Any]) -> None:
        pass  # the summary travels with the final state

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued; whatever cannot be delivered in time stays spooled on disk."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s + 1)
        deadline = time.time() + timeout_s
        self._spool_pending()
        while self._spool_files() and time.time() < deadline:
            if not self._drain_spool():
                time.sleep(min(self.retry_backoff_s, max(0.0, deadline - time.time())))
        self._client.close()

    @property
    def spooled(self) -> int:
        return len(self._spool_files())

    # -- the background thread ----------------------------------------------------------------
    def _put(self, items: list[tuple[str, Any]]) -> None:
        with self._lock:
            self._pending.extend(items)
            if len(self._pending) >= self.max_batch:
                self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                self._flush()
            except Exception:  # the reporter must never kill training
                log.exception("http reporter flush failed")
        try:
            self._flush()
        except Exception:
            log.exception("http reporter final flush failed")

    def _flush(self) -> None:
        self._spool_pending()
        self._drain_spool()

    def _spool_pending(self) -> None:
        # Every batch goes through the spool: the order on disk is the order of delivery.
        with self._lock:  # close() and the thread's last flush may both get here
            items, self._pending = self._pending, []
            batches = self._batches(items)
            first, self._seq = self._seq + 1, self._seq + len(batches)
        for seq, (route, body) in enumerate(batches, start=first):
            if route in ("metrics", "events"):  # a resent batch is then a no-op on the server
                body["batch_id"] = f"{self._batch_prefix}-{seq:012d}"
            path = self.spool_dir / f"{seq:012d}-{route}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            tmp.replace(path)

    def _batches(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for route, item in items:
            if out and route == "metrics" and out[-1][0] == "metrics" \
                    and len(out[-1][1]["points"]) < self.max_batch:
                out[-1][1]["points"].append(item)
            elif out and route == "events" and out[-1][0] == "events" \
                    and len(out[-1][1]["events"]) < self.max_batch:
                out[-1][1]["events"].append(item)
            elif route == "metrics":
                out.append((route, {"points": [item]}))
            elif route == "events":
                out.append((route, {"events": [item]}))
            else:
                out.append((route, item))
        return out

    def _spool_files(self) -> list[Path]:
        return sorted(self.spool_dir.glob("*.json"))

    def _last_spool_seq(self) -> int:
        files = self._spool_files()
        return int(files[-1].name.split("-", 1)[0]) if files else 0

    def _drain_spool(self) -> bool:
        """Send spooled batches oldest first; stop at the first that cannot go yet."""
        with self._drain_lock:
            return self._drain_spool_locked()

    def _drain_spool_locked(self) -> bool:
        for path in self._spool_files():
            route = path.stem.split("-", 1)[1]
            try:
                body = json.loads(path.read_text())
            except FileNotFoundError:  # sent and removed meanwhile
                continue
            outcome = self._send(route, body)
            if outcome == "retry":
                return False
            if outcome == "dropped":
                self.dropped_batches += 1
            else:
                self.sent_batches += 1
            path.unlink(missing_ok=True)
        return True

    def _send(self, route: str, body: Any) -> str:
        for attempt in range(3):
            try:
                resp = self._client.post(f"{self.base}/{route}", json=body)
            except httpx.TransportError as exc:
                log.debug("POST %s failed: %s", route, exc)
            else:
                if resp.status_code < 300:
                    return "sent"
                if resp.status_code not in _RETRYABLE:
                    log.warning("API refused %s (%s): %s", route, resp.status_code, resp.text[:300])
                    return "dropped"
            if self._stop.is_set() and attempt == 0:
                return "retry"  # closing: let close() decide how long to keep trying
            time.sleep(self.retry_backoff_s * (2**attempt))
        return "retry"


class MultiReporter:
    """Fans every call out to several reporters."""

    def __init__(self, reporters: list[Any]):
        self.reporters = reporters

    def log_metrics(self, step: int, metrics: dict[str, float], time_s: float | None = None) -> None:
        for r in self.reporters:
            r.log_metrics(step, metrics, time_s)

    def log_warm_start(self, step: int, metrics: dict[str, float]) -> None:
        for r in self.reporters:
            r.log_warm_start(step, metrics)

    def log_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        for r in self.reporters:
            r.log_event(kind, message, data)

    def log_checkpoint(self, step: int, path: str, size_bytes: int, metrics: dict[str, float]) -> None:
        for r in self.reporters:
            r.log_checkpoint(step, path, size_bytes, metrics)

    def set_state(self, state: str, reason: str | None = None, summary: dict[str, Any] | None = None) -> None:
        for r in self.reporters:
            r.set_state(state, reason, summary)

    def write_summary(self, summary: dict[str, Any]) -> None:
        for r in self.reporters:
            r.write_summary(summary)

    def close(self, timeout_s: float = 10.0) -> None:
        for r in self.reporters:
            r.close(timeout_s)


def run_token(env: dict[str, str]) -> str | None:
    """The attempt's run token: YATT_RUN_TOKEN, or the file YATT_RUN_TOKEN_FILE names (how the
    dispatcher hands it over, so that it never shows in Ray's job info)."""
    if token := env.get("YATT_RUN_TOKEN", "").strip():
        return token
    if path := env.get("YATT_RUN_TOKEN_FILE"):
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            log.warning("cannot read the run token from %s: %s", path, exc)
    return None


def make_reporter(out_dir: str | Path, *, flush_interval_s: float = 1.0, max_batch: int = 2000,
                  env: dict[str, str] | None = None) -> MultiReporter:
    """JSONL under out_dir always; HTTP too when YATT_API_URL, YATT_RUN_ID and a run token
    (YATT_RUN_TOKEN or YATT_RUN_TOKEN_FILE) are set, spooling under spool/attempt-<YATT_ATTEMPT>."""
    env = dict(os.environ) if env is None else env
    reporters: list[Any] = [JsonlReporter(out_dir)]
    api, token, run_id = env.get("YATT_API_URL"), run_token(env), env.get("YATT_RUN_ID")
    if api and token and run_id:
        spool = Path(out_dir) / "spool" / f"attempt-{env.get('YATT_ATTEMPT') or 1}"
        reporters.append(HttpReporter(api, token, run_id, spool_dir=spool,
                                      flush_interval_s=flush_interval_s, max_batch=max_batch))
    return MultiReporter(reporters)
