"""A whole yatt stack in subprocesses for integration tests: a local Ray head, the API and the
worker, on free ports, against a fresh PostgreSQL database and a Redis broker (or the embedded
SQLite defaults). Each part can be killed and started again, as the fault tests need.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg

from backend.dispatch.local_ray import free_ports

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379"


def free_port() -> int:
    return free_ports(1)[0]


def start_test_head(settings: Any, *, devices: int, log_path: Path, exclude: set[int] | frozenset[int] = frozenset(),
                    timeout_s: float = 120.0, attempts: int = 3) -> Any:
    """A local Ray head on free ports, tried again on fresh ones when `ray start` exits: a port
    found free can be taken before Ray's GCS binds it (in CI, 2026-12-06: "Failed to start the grpc
    server", `ray start` exiting with 1) by another test's server or Ray's own workers."""
    from backend.dispatch.local_ray import start_head

    for attempt in range(attempts):
        port, dashboard_port = free_ports(2, exclude=exclude)
        try:
            return start_head(settings, port=port, dashboard_port=dashboard_port, devices=devices,
                              log_path=log_path, timeout_s=timeout_s)
        except RuntimeError:  # exited early; a head that started and never answered is not retried
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def create_pg_database(prefix: str) -> tuple[str, str]:
    """A fresh PostgreSQL database; returns (SQLAlchemy URL, name)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}", name


def drop_pg_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class ServerExited(RuntimeError):
    """A server the stack started exited before it answered."""


class Stack:
    """Ray head + API + worker as child processes sharing one environment."""

    def __init__(self, root: Path, *, database_url: str, broker_url: str, extra_env: dict[str, str] | None = None):
        self.root = root
        self.data_dir = root / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.env = {
            **os.environ,
            "YATT_DATA_DIR": str(self.data_dir),
            "YATT_DATABASE_URL": database_url,
            "YATT_BROKER_URL": broker_url,
            "YATT_API_URL": self.api_url,
            "YATT_RECONCILE_INTERVAL_S": "1",
            "YATT_REPORT_GRACE_S": "3",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        self.env.pop("YATT_RAY_ADDRESS", None)
        self.env.pop("YATT_TOKEN", None)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.head: Any = None

    # --- parts ----------------------------------------------------------------------------

    def yatt(self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "backend.cli", *args], env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=timeout, check=check,
        )

    def start_ray(self, devices: int = 2) -> None:
        """A local Ray head offering `devices` (0: every run must go to another node)."""
        from backend.settings import Settings

        settings = Settings(data_dir=self.data_dir, database_url="sqlite://")
        self.head = start_test_head(settings, devices=devices, log_path=self.root / "ray-head.log",
                                    exclude={self.api_port})

    def start(self, name: str) -> None:
        for attempt in range(3):
            args = {"api": ["api", "--port", str(self.api_port)], "worker": ["worker"]}[name]
            log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115
            proc = self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "backend.cli", *args], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            if name != "api":
                return
            try:
                self.wait_http(f"{self.api_url}/healthz", 60, proc=proc)
                return
            except ServerExited:
                # its port was free when chosen, and taken since (Ray's head starts in between
                # and binds ports of its own): another port, unless a worker knows this URL
                self.procs.pop(name)
                if attempt == 2 or "worker" in self.procs:
                    raise
                self.api_port = free_port()
                self.api_url = f"http://127.0.0.1:{self.api_port}"
                self.env["YATT_API_URL"] = self.api_url

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def up(self, head_devices: int = 2) -> Stack:
        self.yatt("db", "upgrade")
        self.start_ray(head_devices)
        self.start("api")
        self.start("worker")
        return self

    def down(self) -> None:
        from backend.dispatch.local_ray import stop_head

        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        if self.head is not None:
            stop_head(self.head)

    def wait_http(self, url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Until ``url`` answers 200; `ServerExited` if ``proc`` (what serves it) exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ServerExited(f"{url}: its server exited ({proc.returncode}); see logs under {self.root}")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url} did not answer; see logs under {self.root}")

    # --- helpers --------------------------------------------------------------------------

    def token(self, project: str = "ci", role: str = "admin") -> str:
        out = self.yatt("token", "create", "--project", project, "--role", role)
        return out.stdout.strip().splitlines()[-1]

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.root.glob("*.log"))
        )
