"""YattClient: the one HTTP client of the yatt API, used by the CLI and the dashboard.

Built on httpx only (no SQLAlchemy, no FastAPI), so it can live anywhere a token does.
Every method maps to one route of docs/contracts.md; a refused call raises `YattAPIError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from backend.runs.state import TERMINAL  # plain enums: no SQLAlchemy, no FastAPI

TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


class YattAPIError(Exception):
    """A refused or failed call: `status` (0 when the API could not be reached), the API's
    `message`, and for 422 the `(field path, message)` pairs it named."""

    def __init__(self, status: int, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status, self.message, self.errors = status, message, errors or []


def _error_of(response: httpx.Response) -> YattAPIError:
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    errors: list[tuple[str, str]] = []
    if isinstance(detail, list):  # validation errors, each with a field path
        for item in detail:
            path = item.get("path") or ".".join(str(p) for p in item.get("loc", []) if p != "body")
            errors.append((path, str(item.get("msg", ""))))
        message = "; ".join(f"{p}: {m}" if p else m for p, m in errors)
    else:
        message = str(detail)
    return YattAPIError(response.status_code, message, errors)


class YattClient:
    """A client for the API at `api_url` (the base URL, without `/api/v1`)."""

    def __init__(self, api_url: str, token: str | None, *, timeout: float = 30.0, retries: int = 2):
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.retries = retries
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout)

    @classmethod
    def from_env(cls) -> YattClient:
        """A client for YATT_API_URL with YATT_TOKEN."""
        from backend.settings import get_settings

        settings = get_settings()
        return cls(settings.api_url, settings.token)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> YattClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ----------------------------------------------------------------------------

    def request(self, method: str, path: str, *, text: bool = False, **kwargs: Any) -> Any:
        """Call `/api/v1<path>` (or a root path like `/healthz`); JSON (or text) on 2xx."""
        url = path if path.startswith(("/healthz", "/readyz")) else "/api/v1" + path
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                # only requests that cannot have had an effect are retried
                if attempt < self.retries and (method == "GET" or isinstance(exc, httpx.ConnectError)):
                    time.sleep(0.2 * 2**attempt)
                    continue
                raise YattAPIError(0, f"cannot reach the yatt API at {self.api_url}: {exc}") from exc
            break
        if response.status_code >= 400:
            raise _error_of(response)
        if text:
            return response.text
        return response.json() if response.content else None

    # --- health and identity -----------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/healthz")  # type: ignore[no-any-return]

    def ready(self) -> dict[str, Any]:
        return self.request("GET", "/readyz")  # type: ignore[no-any-return]

    def whoami(self) -> dict[str, Any]:
        return self.request("GET", "/whoami")  # type: ignore[no-any-return]

    def projects(self) -> list[dict[str, Any]]:
        return self.request("GET", "/projects")  # type: ignore[no-any-return]

    def tokens(self) -> list[dict[str, Any]]:
        return self.request("GET", "/tokens")  # type: ignore[no-any-return]

    def create_token(self, name: str, role: str, expires_in_s: float | None = None) -> dict[str, Any]:
        body = {"name": name, "role": role, "expires_in_s": expires_in_s}
        return self.request("POST", "/tokens", json=body)  # type: ignore[no-any-return]

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        return self.request("DELETE", f"/tokens/{token_id}")  # type: ignore[no-any-return]

    # --- experiments and runs ----------------------------------------------------------------

    def experiments(self) -> list[dict[str, Any]]:
        return self.request("GET", "/experiments")  # type: ignore[no-any-return]

    def create_experiment(self, name: str, description: str = "", tags: Sequence[str] = ()) -> dict[str, Any]:
        body = {"name": name, "description": description, "tags": list(tags)}
        return self.request("POST", "/experiments", json=body)  # type: ignore[no-any-return]

    def validate_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The config with defaults filled in; raises YattAPIError(422) naming bad fields."""
        return self.request("POST", "/runs/validate", json={"config": config})["config"]  # type: ignore[no-any-return]

    def create_run(
        self,
        *,
        experiment: str,
        config: dict[str, Any],
        tags: Sequence[str] = (),
        name: str | None = None,
        description: str | None = None,
        ci: dict[str, Any] | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        max_duration_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Queue a run; with `idempotency_key`, a retried call returns the same run."""
        body: dict[str, Any] = {"experiment": experiment, "config": config, "tags": list(tags)}
        optional = {
            "name": name, "description": description, "ci": ci, "priority": priority,
            "max_attempts": max_attempts, "max_duration_s": max_duration_s,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.request("POST", "/runs", json=body, headers=headers)  # type: ignore[no-any-return]

    def list_runs(self, *, cursor: str | None = None, limit: int = 50, **filters: Any) -> dict[str, Any]:
        """One page: `{"items": [...], "next_cursor": ...}`; items are History rows (no config).
        Filters: state, experiment, tag, launched_by, q, created_since, created_until, sort,
        where (metric filters such as `["reward/mean>=0.5"]`), metrics."""
        params = {k: v for k, v in filters.items() if v not in (None, "", [])}
        params["limit"] = limit
        if cursor:
            params["cursor"] = cursor
        return self.request("GET", "/runs", params=params)  # type: ignore[no-any-return]

    def iter_runs(self, *, page_size: int = 100, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every run matching the filters, following the cursor."""
        cursor = None
        while True:
            page = self.list_runs(cursor=cursor, limit=page_size, **filters)
            yield from page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def get_run(self, run_id: int) -> dict[str, Any]:
        return self.request("GET", f"/runs/{run_id}")  # type: ignore[no-any-return]

    def attempts(self, run_id: int) -> list[dict[str, Any]]:
        return self.request("GET", f"/runs/{run_id}/attempts")  # type: ignore[no-any-return]

    def cancel_run(self, run_id: int, reason: str | None = None) -> dict[str, Any]:
        return self.request("POST", f"/runs/{run_id}/cancel", json={"reason": reason})  # type: ignore[no-any-return]

    def retry_run(self, run_id: int, reason: str | None = None) -> dict[str, Any]:
        return self.request("POST", f"/runs/{run_id}/retry", json={"reason": reason})  # type: ignore[no-any-return]

    def report_state(
        self, run_id: int, state: str, *, reason: str | None = None, summary: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Report a state (trainer: running, succeeded, failed); 409 on an illegal move."""
        body = {"state": state, "reason": reason, "summary": summary, **extra}
        return self.request("POST", f"/runs/{run_id}/state", json={k: v for k, v in body.items() if v is not None})  # type: ignore[no-any-return]

    def wait_for_run(
        self, run_id: int, *, poll_s: float = 2.0, timeout_s: float | None = None, on_change: Any = None
    ) -> dict[str, Any]:
        """Poll until the run reaches a final state (or `timeout_s` passes); returns the run."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last = None
        while True:
            run = self.get_run(run_id)
            if on_change is not None and run["state"] != last:
                on_change(run)
            last = run["state"]
            if run["state"] in TERMINAL_STATES:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run['state']} after {timeout_s}s")
            time.sleep(poll_s)

    # --- telemetry ---------------------------------------------------------------------------

    def post_metrics(self, run_id: int, points: Sequence[dict[str, Any]], *, batch_id: str | None = None) -> int:
        """Send `[{"key", "step", "value", "time"}]` (at most 10,000 per call) with the run's
        token; a `batch_id` the run has applied before makes the call a no-op."""
        body: dict[str, Any] = {"points": list(points)}
        if batch_id is not None:
            body["batch_id"] = batch_id
        return int(self.request("POST", f"/runs/{run_id}/metrics", json=body)["accepted"])

    def metrics(
        self, run_id: int, keys: Sequence[str] | None = None, *, max_points: int | None = None,
        after_step: int | None = None,
    ) -> dict[str, list[dict[str, Any]]]:
        """Each key's series (`{"step","value","time"}` points), sampled to `max_points` (the
        API's default: 1,000; at most 10,000); with `after_step`, only the points after that
        step (the first `max_points`, not sampled). Every point: `metrics_csv`."""
        params: dict[str, Any] = {}
        if keys:
            params["keys"] = ",".join(keys)
        if max_points:
            params["max_points"] = max_points
        if after_step is not None:
            params["after_step"] = after_step
        return self.request("GET", f"/runs/{run_id}/metrics", params=params)["series"]  # type: ignore[no-any-return]

    def compare(
        self, run_ids: Sequence[int], keys: Sequence[str] = (), *, max_points: int = 500
    ) -> list[dict[str, Any]]:
        """Up to 20 runs in one request: `[{"run", "config", "keys", "series"}]`, in the order asked."""
        params: dict[str, Any] = {"runs": ",".join(map(str, run_ids)), "max_points": max_points}
        if keys:
            params["keys"] = ",".join(keys)
        return self.request("GET", "/runs/compare", params=params)["runs"]  # type: ignore[no-any-return]

    def metrics_csv(self, run_id: int, keys: Sequence[str] | None = None) -> Iterator[bytes]:
        """Every point of the run (or of `keys`) as CSV `key,step,value,time`, chunk by chunk
        as the API streams it."""
        params = {"keys": ",".join(keys)} if keys else {}
        with self._http.stream(
            "GET", f"/api/v1/runs/{run_id}/metrics.csv", params=params, timeout=httpx.Timeout(30, read=300)
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise _error_of(response)
            yield from response.iter_bytes()

    def metric_keys(self, run_id: int) -> list[dict[str, Any]]:
        """`[{"key","latest","latest_step","min","max","count"}]`."""
        return self.request("GET", f"/runs/{run_id}/metric-keys")  # type: ignore[no-any-return]

    def post_events(self, run_id: int, events: Sequence[dict[str, Any]], *, batch_id: str | None = None) -> int:
        body: dict[str, Any] = {"events": list(events)}
        if batch_id is not None:
            body["batch_id"] = batch_id
        return int(self.request("POST", f"/runs/{run_id}/events", json=body)["accepted"])

    def events(self, run_id: int, *, kind: str | None = None, after_id: int = 0) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"after_id": after_id}
        if kind:
            params["kind"] = kind
        return self.request("GET", f"/runs/{run_id}/events", params=params)  # type: ignore[no-any-return]

    def post_checkpoint(
        self, run_id: int, *, step: int, path: str, size_bytes: int | None = None, metrics: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = {"step": step, "path": path, "size_bytes": size_bytes, "metrics": metrics}
        return self.request("POST", f"/runs/{run_id}/checkpoints", json=body)  # type: ignore[no-any-return]

    def checkpoints(self, run_id: int) -> list[dict[str, Any]]:
        return self.request("GET", f"/runs/{run_id}/checkpoints")  # type: ignore[no-any-return]

    def logs(self, run_id: int, *, attempt: int | None = None, tail: int | None = None) -> str:
        """An attempt's trainer log (default: the current attempt), or its last `tail` lines."""
        params = {k: v for k, v in {"attempt": attempt, "tail": tail}.items() if v is not None}
        return str(self.request("GET", f"/runs/{run_id}/logs", params=params, text=True))

    def logs_since(
        self, run_id: int, offset: int | None, *, tail: int | None = None, attempt: int | None = None
    ) -> tuple[str, int]:
        """`(new text, length)`: the log after `offset` characters (all of it, or its last `tail`
        lines, for None or an offset past a shorter copy); pass `length` as the next offset."""
        params = {k: v for k, v in {"offset": offset, "tail": tail, "attempt": attempt}.items() if v is not None}
        response = self._http.get(f"/api/v1/runs/{run_id}/logs", params=params)
        if response.status_code >= 400:
            raise _error_of(response)
        return response.text, int(response.headers.get("Log-Length", len(response.text)))

    def follow_logs(self, run_id: int, *, attempt: int | None = None) -> Iterator[str]:
        """The log as it grows, chunk by chunk, until the attempt ends."""
        params: dict[str, Any] = {"follow": True}
        if attempt is not None:
            params["attempt"] = attempt
        with self._http.stream(
            "GET", f"/api/v1/runs/{run_id}/logs", params=params, timeout=httpx.Timeout(30, read=None)
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise _error_of(response)
            yield from response.iter_text()

    def cluster(self) -> dict[str, Any]:
        return self.request("GET", "/cluster")  # type: ignore[no-any-return]

    def stream(
        self, run_id: int, *, timeout: float | None = None, last_event_id: str | None = None,
        reconnects: int = 3,
    ) -> Iterator[tuple[str, Any]]:
        """Server-Sent Events of a run as `(event, data)`: `state`, `metric`, `event`; from its
        history on, or after `last_event_id`. A dropped connection is resumed where it broke
        (`Last-Event-ID`, up to `reconnects` times). Ends when the run is final, retries done."""
        for _, event, data in self.stream_with_ids(
            run_id, timeout=timeout, last_event_id=last_event_id, reconnects=reconnects
        ):
            yield event, data

    def stream_with_ids(
        self, run_id: int, *, timeout: float | None = None, last_event_id: str | None = None,
        reconnects: int = 3,
    ) -> Iterator[tuple[str | None, str, Any]]:
        """As `stream`, with each event's id: `(id, event, data)`."""
        failures = 0
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                with self._http.stream(
                    "GET", f"/api/v1/runs/{run_id}/stream", headers=headers,
                    timeout=httpx.Timeout(timeout or 60.0, read=timeout),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise _error_of(response)
                    for event_id, event, data in _sse_messages(response.iter_lines()):
                        failures = 0
                        last_event_id = event_id or last_event_id
                        yield event_id, event, data
                return
            except (httpx.TransportError, httpx.StreamError) as exc:
                failures += 1
                if failures > reconnects:
                    raise YattAPIError(0, f"the stream of run {run_id} broke: {exc}") from exc
                time.sleep(min(5.0, 0.5 * failures))


def _sse_messages(lines: Iterator[str]) -> Iterator[tuple[str | None, str, Any]]:
    """`(id, event, data)` for each Server-Sent Event in `lines` (comments skipped)."""
    event_id: str | None = None
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event_id, event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif line.startswith("id:"):
            event_id = line[3:].strip()
