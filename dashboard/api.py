"""The dashboard's calls to the yatt API, all through `backend.client.YattClient`.

Most calls are the client's own methods; the few the dashboard needs in another shape (a page
of runs as a tuple, events with a page size, the logs' tail) go through its generic `request`.
Failures are `ApiError` (the client's `YattAPIError`): `status` (0 when the API could not be
reached), `message`, and for 422 the `(field path, message)` pairs the API named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend.client import YattAPIError, YattClient

__all__ = [
    "Client",
    "ApiError",
    "connect",
    "whoami",
    "list_runs",
    "get_run",
    "cancel_run",
    "retry_run",
    "validate_config",
    "create_run",
    "list_experiments",
    "compare",
    "metric_keys",
    "metrics",
    "metrics_csv",
    "events",
    "attempts",
    "checkpoints",
    "logs",
    "cluster",
]

Client = YattClient
ApiError = YattAPIError


def connect(api_url: str, token: str) -> YattClient:
    """A client for the API at `api_url` (base URL, without `/api/v1`)."""
    return YattClient(api_url, token, timeout=20.0, retries=1)


def whoami(c: YattClient) -> dict[str, Any]:
    """The token's project and role: `{"project", "project_id", "token_name", "role", ...}`."""
    return c.whoami()


def list_runs(
    c: YattClient, *, cursor: str | None = None, limit: int = 25, **filters: Any
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of runs and the cursor of the next page (None on the last page).

    Filters are the route's query parameters: `state` (comma-separated), `experiment`, `tag`,
    `launched_by` (user/ci), `q`, `created_since`, `created_until`, `sort`, `metrics`."""
    page = c.list_runs(cursor=cursor, limit=limit, **filters)
    return list(page["items"]), page.get("next_cursor")


def compare(
    c: YattClient, run_ids: Sequence[int], keys: Sequence[str], *, max_points: int = 800
) -> list[dict[str, Any]]:
    """Up to 20 runs in one request: `[{"run", "config", "keys", "series"}]` (series of `keys`)."""
    return c.compare(run_ids, keys, max_points=max_points)


def get_run(c: YattClient, run_id: int) -> dict[str, Any]:
    return c.get_run(run_id)


def cancel_run(c: YattClient, run_id: int) -> dict[str, Any]:
    return c.cancel_run(run_id, reason="cancelled from the dashboard")


def retry_run(c: YattClient, run_id: int) -> dict[str, Any]:
    return c.retry_run(run_id, reason="retried from the dashboard")


def validate_config(c: YattClient, config: dict[str, Any]) -> dict[str, Any]:
    """The normalized config; a bad one raises ApiError(422) with errors by field path."""
    return c.validate_config(config)


def create_run(
    c: YattClient,
    *,
    experiment: str,
    config: dict[str, Any],
    tags: Sequence[str] = (),
    name: str | None = None,
    description: str | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """Queue a run; the same `idempotency_key` again returns the same run (HTTP 200)."""
    return c.create_run(experiment=experiment, config=config, tags=tags, name=name,
                        description=description, idempotency_key=idempotency_key)


def list_experiments(c: YattClient) -> list[dict[str, Any]]:
    return c.experiments()


def metric_keys(c: YattClient, run_id: int) -> list[dict[str, Any]]:
    """`[{"key", "latest", "latest_step", "min", "max", "count"}]` for each reported key."""
    return c.metric_keys(run_id)


def metrics(
    c: YattClient, run_id: int, keys: Sequence[str], *, max_points: int | None = 800
) -> dict[str, list[dict[str, Any]]]:
    """Each key's series, downsampled by the API to at most `max_points` points (None: the
    API's default, 1,000; every point: `metrics_csv`)."""
    if not keys:
        return {}
    return c.metrics(run_id, list(keys), max_points=max_points)


def metrics_csv(c: YattClient, run_id: int) -> bytes:
    """Every point of every key as CSV (`key,step,value,time`), streamed by the API page by page."""
    return b"".join(c.metrics_csv(run_id))


def events(
    c: YattClient, run_id: int, *, kind: str | None = None, after_id: int = 0, limit: int = 1000
) -> list[dict[str, Any]]:
    """The run's events in id order, those after `after_id` only; `kind` is comma-separated."""
    params: dict[str, Any] = {"after_id": after_id, "limit": limit}
    if kind:
        params["kind"] = kind
    return list(c.request("GET", f"/runs/{run_id}/events", params=params))


def attempts(c: YattClient, run_id: int) -> list[dict[str, Any]]:
    return c.attempts(run_id)


def checkpoints(c: YattClient, run_id: int) -> list[dict[str, Any]]:
    """The run's checkpoints, newest last."""
    return c.checkpoints(run_id)


def logs(c: YattClient, run_id: int, *, tail: int = 200) -> str:
    """The last `tail` lines of the current attempt's log."""
    return str(c.request("GET", f"/runs/{run_id}/logs", params={"tail": tail}, text=True))


def cluster(c: YattClient) -> dict[str, Any]:
    return c.cluster()
