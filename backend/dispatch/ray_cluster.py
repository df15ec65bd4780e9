"""The dispatcher's view of Ray: the Jobs API (submit / status / stop / logs) and the node list.

Everything goes over the Ray dashboard's HTTP API, so neither the API nor the worker becomes a
Ray driver. The address is `YATT_RAY_ADDRESS` (the dashboard URL, e.g. `http://head:8265`, the
same address `ray job submit --address` takes) or, when unset, the local head that
`yatt up` / `yatt worker` started (`<data_dir>/ray.json`).

Ray ≥ 2.59 turns token authentication on for local clusters, but its HTTP clients only send
the token when `RAY_AUTH_MODE=token` is set in *their* environment; we always send it when
one exists (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.exceptions import InvalidStatus, WebSocketException

from backend.settings import Settings, get_settings

TERMINAL_JOB_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


class RayUnavailable(RuntimeError):
    """No Ray cluster is configured or it does not answer."""


class JobNotFound(LookupError):
    """Ray has no job with that submission id."""


class JobExists(RuntimeError):
    """A job with that submission id was submitted before (the idempotency hook)."""


@dataclass
class JobInfo:
    submission_id: str
    status: str  # PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str = ""
    error_type: str | None = None
    driver_exit_code: int | None = None
    start_time: float | None = None  # unix seconds
    end_time: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_JOB_STATES


@dataclass
class NodeInfo:
    node_id: str
    ip: str
    alive: bool
    is_head: bool
    resources: dict[str, float] = field(default_factory=dict)


def ray_auth_token() -> str | None:
    """The Ray cluster token this machine holds, if any."""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def local_head_file(settings: Settings) -> Path:
    """Where the local head's address is written (by backend.dispatch.local_ray)."""
    return Path(settings.data_dir) / "ray.json"


def resolve_address(settings: Settings | None = None) -> str | None:
    """The Ray dashboard URL to talk to, or None when no cluster is known."""
    settings = settings or get_settings()
    if settings.ray_address:
        addr = settings.ray_address
        return addr if "://" in addr else f"http://{addr}"
    try:
        return str(json.loads(local_head_file(settings).read_text())["dashboard_url"])
    except (OSError, ValueError, KeyError):
        return None


class RayCluster:
    """A thin, synchronous client of one Ray cluster's dashboard HTTP API."""

    def __init__(self, address: str, *, timeout_s: float = 10.0):
        self.address = address.rstrip("/")
        headers = {}
        self._token = ray_auth_token()
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        self._timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.address, headers=headers, timeout=timeout_s)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> RayCluster:
        """The configured cluster; raises RayUnavailable when there is none."""
        address = resolve_address(settings)
        if address is None:
            raise RayUnavailable(
                "no Ray cluster: set YATT_RAY_ADDRESS to a Ray dashboard URL, or start the "
                "local stack with `yatt up` (or `yatt worker`, which starts a local head)"
            )
        return cls(address)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RayUnavailable(f"Ray at {self.address} does not answer: {exc}") from exc

    # --- jobs ------------------------------------------------------------------------------

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        env_vars: dict[str, str],
        metadata: dict[str, str] | None = None,
        working_dir: str | None = None,
    ) -> str:
        """Submit a job; raises JobExists when `submission_id` was used before."""
        runtime_env: dict[str, Any] = {"env_vars": env_vars}
        if working_dir:
            runtime_env["working_dir"] = working_dir
        body = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": runtime_env,
            "metadata": metadata or {},
        }
        # Ray starts the job's supervisor actor before it answers: slow on a busy machine.
        resp = self._request("POST", "/api/jobs/", json=body, timeout=120.0)
        if resp.status_code == 200:
            return str(resp.json()["submission_id"])
        if self.job(submission_id) is not None:  # Ray answers 500 for a reused id
            raise JobExists(f"Ray job {submission_id} already exists")
        raise RayUnavailable(f"Ray refused job {submission_id}: {resp.status_code} {resp.text[:500]}")

    def job(self, submission_id: str) -> JobInfo | None:
        """The job's state, or None when Ray does not know it."""
        resp = self._request("GET", f"/api/jobs/{submission_id}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RayUnavailable(f"Ray job status: {resp.status_code} {resp.text[:300]}")
        data = resp.json()
        ms = 1000.0
        return JobInfo(
            submission_id=submission_id,
            status=str(data.get("status")),
            message=data.get("message") or "",
            error_type=data.get("error_type"),
            driver_exit_code=data.get("driver_exit_code"),
            start_time=data["start_time"] / ms if data.get("start_time") else None,
            end_time=data["end_time"] / ms if data.get("end_time") else None,
        )

    def jobs(self) -> list[dict[str, Any]]:
        """Every job the cluster knows, as Ray describes them."""
        resp = self._request("GET", "/api/jobs/")
        if resp.status_code != 200:
            raise RayUnavailable(f"Ray job list: {resp.status_code} {resp.text[:300]}")
        return list(resp.json())

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop a job; False when it had already ended or does not exist."""
        resp = self._request("POST", f"/api/jobs/{submission_id}/stop")
        if resp.status_code == 404:
            return False
        if resp.status_code != 200:
            raise RayUnavailable(f"Ray stop_job: {resp.status_code} {resp.text[:300]}")
        return bool(resp.json().get("stopped", False))

    def logs(self, submission_id: str) -> str:
        """The job driver's whole log so far; raises JobNotFound."""
        resp = self._request("GET", f"/api/jobs/{submission_id}/logs")
        if resp.status_code == 404:
            raise JobNotFound(submission_id)
        if resp.status_code != 200:
            raise RayUnavailable(f"Ray job logs: {resp.status_code} {resp.text[:300]}")
        return str(resp.json().get("logs", ""))

    async def tail_logs(self, submission_id: str) -> AsyncIterator[str]:
        """The job driver's log over one WebSocket (what `JobSubmissionClient.tail_job_logs`
        reads): the whole log so far, then each piece as it is appended; ends when the job has
        ended and its log has been read to the end. Raises JobNotFound, or RayUnavailable when
        the connection fails, breaks, or is closed while the job still runs."""
        url = "ws" + self.address.removeprefix("http") + f"/api/jobs/{submission_id}/logs/tail"
        try:
            async with websockets.connect(
                url, additional_headers={"Authorization": f"Bearer {self._token}"} if self._token else None,
                open_timeout=self._timeout_s, max_size=None,
                # No permessage-deflate: Ray's dashboard passes the offer on to its JobHead process,
                # which compresses, while the proxy's own aiohttp client did not ask to, so it drops
                # every frame and closes at once ("Unknown msg type: 258", aiohttp's ERROR).
                compression=None,
            ) as ws:
                async for message in ws:
                    yield message if isinstance(message, str) else message.decode("utf-8", "replace")
        except InvalidStatus as exc:
            if exc.response.status_code == 404:
                raise JobNotFound(submission_id) from exc
            raise RayUnavailable(f"Ray job log tail: {exc.response.status_code}") from exc
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise RayUnavailable(f"Ray job log tail at {self.address} broke: {exc}") from exc
        # Ray closes the tail normally once the job has ended, but also when its own hop to the
        # node's agent drops: only the first is the end of the log.
        job = await asyncio.to_thread(self.job, submission_id)
        if job is None:
            raise JobNotFound(submission_id)
        if not job.terminal:
            raise RayUnavailable(f"Ray closed the log tail of {submission_id} while it is {job.status}")

    # --- nodes -----------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        """Every node Ray knows, with its total resources."""
        resp = self._request("GET", "/api/v0/nodes", params={"limit": 1000, "detail": "true"})
        if resp.status_code != 200:
            raise RayUnavailable(f"Ray node list: {resp.status_code} {resp.text[:300]}")
        rows = resp.json()["data"]["result"]["result"]
        return [
            NodeInfo(
                node_id=row["node_id"],
                ip=row.get("node_ip", ""),
                alive=row.get("state") == "ALIVE",
                is_head=bool(row.get("is_head_node")),
                resources={k: float(v) for k, v in (row.get("resources_total") or {}).items()},
            )
            for row in rows
        ]

    def ping(self) -> bool:
        try:
            return self._request("GET", "/api/version").status_code == 200
        except RayUnavailable:
            return False
