"""Shared fixtures: real databases and a live API server.

- `postgres_url` (session): a fresh PostgreSQL database `yatt_test_<random>` on 127.0.0.1,
  migrated, dropped at the end of the session.
- `live_api`: a live API (uvicorn in a thread, free port) and a fresh project with an admin
  token; SQLite by default. Over both databases:
  `@pytest.mark.parametrize("live_api", DATABASES, indirect=True)`.
  The server is shared per database for the session; each test gets its own project, so
  tests cannot see each other's runs.
- `fresh_api`: the same with a server and SQLite database of its own, for tests that look
  across projects (the dispatcher's queue) or need an empty database.
- `start_api(database_url, **settings)`: start one yourself; call `.stop()` when done.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import uvicorn

from backend.app import create_app
from backend.auth import service as auth_service
from backend.auth.models import Role
from backend.client import YattClient
from backend.db import Database
from backend.migrate import upgrade
from backend.runs.models import Run
from backend.settings import Settings

PG_ADMIN_URL = os.environ.get("YATT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test")
DATABASES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]

# each test's share of busy cores, summed at the end of the run (the CI-time target)
pytest_plugins = ["tests.cpu_use"]


def long_context_model(directory: Path) -> str:
    """A config.json of the `micro` preset's shape with a 32,768-token context: small weights, but
    a vLLM-CPU KV cache that can use 4 GiB in bf16 (a default step's 16 prompts × 8 samples at
    full length; the preset's 512 tokens cap it at 64 MiB), so `rollout.kv_cache_gb` is what a
    memory refusal turns on."""
    import json

    from trainer.models import PRESETS

    p = PRESETS["micro"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": p.hidden, "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads, "num_key_value_heads": p.kv_heads,
        "intermediate_size": p.intermediate, "vocab_size": p.bpe_vocab,
        "max_position_embeddings": 32768, "tie_word_embeddings": True}))
    return str(directory)


@dataclass
class LiveServer:
    """A running API: its base URL, its database and settings."""

    url: str
    database: Database
    settings: Settings
    _server: uvicorn.Server = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    def make_token(self, project: str, role: str = "admin") -> str:
        """A new token for `project` (created if needed)."""
        with self.database.session() as s:
            proj = auth_service.get_or_create_project(db_session=s, name=project)
            _, value = auth_service.create_token(
                db_session=s, project_id=proj.id, name=f"test-{role}", role=Role(role)
            )
        return value

    def run_token(self, run_id: int) -> str:
        """A run token for the run's current attempt, minted as the dispatcher does."""
        with self.database.session() as s:
            run = s.get(Run, run_id)
            assert run is not None
            return auth_service.create_run_token(
                db_session=s, project_id=run.project_id, run_id=run_id, attempt=run.attempt, ttl_s=600
            )

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self.database.dispose()


def start_api(database_url: str, data_dir: Path, **settings: Any) -> LiveServer:
    """Migrate `database_url` and serve the API on a free port in a background thread.

    API only by default (`dispatch=False`): runs stay queued unless a test moves them.
    """
    upgrade(database_url)
    settings.setdefault("dispatch", False)
    settings.setdefault("dispatch", False)  # API only: no Celery messages from these servers
    cfg = Settings(data_dir=data_dir, database_url=database_url, stream_poll_s=0.1, **settings)
    database = Database(database_url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(cfg, database), log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", database, cfg, server, thread)


@dataclass
class LiveAPI:
    """A live server plus a fresh project and its admin token (and a client using it)."""

    server: LiveServer
    project: str
    token: str
    client: YattClient

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def database(self) -> Database:
        return self.server.database

    def start_attempt(self, run_id: int) -> str:
        """Move a run to `running` as the dispatcher would (retrying it first if it failed) and
        return a run token for its current attempt, as the trainer gets it."""
        from backend.runs import lifecycle
        from backend.runs.state import RunState

        with self.database.session() as s:
            run = lifecycle.get_any(db_session=s, run_id=run_id)
            assert run is not None
            if run.state == RunState.failed:
                lifecycle.retry(db_session=s, run_id=run_id)
            if run.state == RunState.queued:
                lifecycle.transition(db_session=s, run_id=run_id, to_state=RunState.starting)
            if run.state == RunState.starting:
                lifecycle.transition(db_session=s, run_id=run_id, to_state=RunState.running)
            return auth_service.create_run_token(
                db_session=s, project_id=run.project_id, run_id=run_id, attempt=run.attempt, ttl_s=600
            )

    def seed_metrics(self, run_id: int, points: list[dict[str, Any]]) -> None:
        """Store points through the ingest service, for tests about reading them (not about who may post)."""
        from backend.metrics.schemas import MetricPointIn
        from backend.metrics.service import ingest

        with self.database.session() as s:
            ingest(db_session=s, run_id=run_id, points=[MetricPointIn(**p) for p in points])

    def run_client(self, run_id: int) -> YattClient:
        """A client holding the run token of a newly started attempt of `run_id`."""
        return YattClient(self.url, self.start_attempt(run_id), retries=0)

    def client_for(self, role: str, project: str | None = None) -> YattClient:
        """A client with a new token of `role` in this (or another) project."""
        return YattClient(self.url, self.server.make_token(project or self.project, role), retries=0)


@pytest.fixture(autouse=True)
def _main_module_restored() -> Iterator[None]:
    """Streamlit's AppTest runs dashboard/app.py as ``__main__`` and leaves it there; a child that
    multiprocessing spawns re-runs the parent's main module, so after the dashboard tests every
    spawned rank would run the dashboard and die before its target. Each test ends with the
    main module it started with."""
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this session (dropped afterwards)."""
    name = f"yatt_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        yield url
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def database_url_for(kind: str, request: pytest.FixtureRequest, tmp: Path) -> str:
    """A database URL of `kind` ("sqlite": a new file under `tmp`; "postgresql": the session's)."""
    if kind == "sqlite":
        return f"sqlite:///{tmp / 'yatt.db'}"
    if kind == "postgresql":
        return str(request.getfixturevalue("postgres_url"))
    raise ValueError(f"unknown database kind {kind!r}")


@pytest.fixture(scope="session")
def _api_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    servers: dict[str, LiveServer] = {}
    yield servers
    for server in servers.values():
        server.stop()


def _new_project(server: LiveServer) -> LiveAPI:
    project = f"test-{uuid.uuid4().hex[:8]}"
    token = server.make_token(project, "admin")
    return LiveAPI(server, project, token, YattClient(server.url, token, retries=0))


@pytest.fixture(params=["sqlite"])
def live_api(
    request: pytest.FixtureRequest,
    _api_servers: dict[str, LiveServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiveAPI]:
    """A live API with a fresh project and its admin token (param: "sqlite" or "postgresql")."""
    kind = request.param
    if kind not in _api_servers:
        tmp = tmp_path_factory.mktemp(f"api-{kind}")
        _api_servers[kind] = start_api(database_url_for(kind, request, tmp), tmp)
    api = _new_project(_api_servers[kind])
    try:
        yield api
    finally:
        api.client.close()


@pytest.fixture
def fresh_api(tmp_path: Path) -> Iterator[LiveAPI]:
    """A live API with its own new SQLite database, and an admin token."""
    server = start_api(f"sqlite:///{tmp_path / 'yatt.db'}", tmp_path)
    api = _new_project(server)
    try:
        yield api
    finally:
        api.client.close()
        server.stop()
