"""The Alembic migrations build exactly the schema the models describe, on both databases."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from backend.db import Database
from backend.migrate import alembic_config, upgrade
from backend.models import metadata
from backend.runs.search import include_object
from tests.conftest import PG_ADMIN_URL


@pytest.fixture
def empty_postgres() -> Iterator[str]:
    name = f"yatt_mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def schema_diff(url: str) -> list[object]:
    db = Database(url)
    try:
        with db.engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={"compare_type": True, "compare_server_default": True, "include_object": include_object},
            )
            return list(compare_metadata(context, metadata))
    finally:
        db.dispose()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_upgrade_from_empty_matches_the_models(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}" if kind == "sqlite" else request.getfixturevalue("empty_postgres")
    upgrade(url)
    assert schema_diff(url) == []
    upgrade(url)  # repeating is a no-op
    db = Database(url)
    try:
        assert set(metadata.tables) <= set(inspect(db.engine).get_table_names())
        with db.engine.connect() as conn:
            head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        assert head == ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    finally:
        db.dispose()


def test_drift_is_detected(tmp_path: Path) -> None:
    """The comparison above can fail: a migrated database missing an index shows a diff."""
    url = f"sqlite:///{tmp_path / 'drift.db'}"
    upgrade(url)
    db = Database(url)
    with db.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_metric_points_run_id_key_step"))
    db.dispose()
    assert any("ix_metric_points_run_id_key_step" in str(d) for d in schema_diff(url))


@pytest.mark.postgres
def test_yatt_db_upgrade_on_an_empty_postgres_database(empty_postgres: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "backend.cli", "db", "upgrade"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "YATT_DATABASE_URL": empty_postgres},
    )
    assert result.returncode == 0, result.stderr
    assert schema_diff(empty_postgres) == []


def test_yatt_db_upgrade_on_an_empty_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = subprocess.run(
        [sys.executable, "-m", "backend.cli", "db", "upgrade", "--url", url],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert schema_diff(url) == []
    db = Database(url)
    try:
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    finally:
        db.dispose()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_0003_indexes_the_runs_already_stored(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Upgrading a database with history fills the search and metric sort indexes from it."""
    from sqlalchemy import select

    from backend.runs import search

    url = f"sqlite:///{tmp_path / 'old.db'}" if kind == "sqlite" else request.getfixturevalue("empty_postgres")
    upgrade(url, "0002")
    db = Database(url)
    try:
        # rows as 0002's schema stores them (the models of today have columns it lacks)
        with db.engine.begin() as conn:
            conn.execute(text("INSERT INTO projects (id, name, description, created_at) VALUES (1, 'old', '', '2026-01-01')"))
            conn.execute(text("INSERT INTO experiments (id, project_id, name, description, tags, created_at) "
                              "VALUES (1, 1, 'gsm8k-grpo', '', '[]', '2026-01-01')"))
            conn.execute(text(
                "INSERT INTO runs (id, project_id, experiment_id, name, description, config, seed, state, attempt, "
                "max_attempts, priority, launched_by, launched_by_name, created_at, updated_at) VALUES "
                "(1, 1, 1, 'lr-sweep-1', 'older run', '{}', 0, 'queued', 1, 1, 0, 'user', '', '2026-01-01', '2026-01-01')"))
            conn.execute(text("INSERT INTO run_tags (run_id, tag) VALUES (1, 'nightly')"))
            conn.execute(text("INSERT INTO metric_summaries (run_id, key, latest, latest_step, latest_time, min, max, count) "
                              "VALUES (1, 'reward/mean', 0.4, 3, 0.0, 0.1, 0.4, 3)"))
        upgrade(url)
        with db.engine.connect() as conn:
            hits = search.matches(db.dialect, "nightly gsm8k").subquery()
            assert conn.execute(select(hits.c.run_id)).scalars().all() == [1]
            values = conn.execute(text("SELECT run_id, key, project_id, value FROM run_metric_values")).all()
            assert [tuple(v) for v in values] == [(1, "reward/mean", 1, 0.4)]
    finally:
        db.dispose()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_0006_counts_the_runs_already_stored_and_keeps_counting(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from sqlalchemy import delete, select

    from backend.auth.models import Project
    from backend.runs.models import Experiment, Run

    url = f"sqlite:///{tmp_path / 'old.db'}" if kind == "sqlite" else request.getfixturevalue("empty_postgres")
    upgrade(url, "0005")
    db = Database(url)
    try:
        with db.engine.begin() as conn:  # rows as 0005's schema stores them (no run_count yet)
            conn.execute(text("INSERT INTO projects (id, name, description, created_at) VALUES (1, 'p', '', '2026-01-01')"))
            for exp_id in (1, 2, 3):
                conn.execute(text("INSERT INTO experiments (id, project_id, name, description, tags, created_at) "
                                  "VALUES (:id, 1, :name, '', '[]', '2026-01-01')"), {"id": exp_id, "name": f"e{exp_id}"})
            conn.execute(text(
                "INSERT INTO runs (id, project_id, experiment_id, name, description, config, seed, state, attempt, "
                "max_attempts, priority, launched_by, launched_by_name, created_at, updated_at) "
                "VALUES (:id, 1, :exp, 'r', '', '{}', 0, 'queued', 1, 1, 0, 'user', '', '2026-01-01', '2026-01-01')"),
                [{"id": i, "exp": 1 if i <= 3 else 2} for i in range(1, 6)])
        upgrade(url)

        def counts() -> dict[str, int]:
            with db.read_session() as s:
                return dict(s.execute(select(Experiment.name, Experiment.run_count)).all())  # type: ignore[arg-type]

        assert counts() == {"e1": 3, "e2": 2, "e3": 0}
        with db.session() as s:  # the triggers follow whatever writes runs after the upgrade
            s.add(Run(id=10, project_id=1, experiment_id=3, name="new", description="", config={}))
            s.execute(delete(Run).where(Run.id == 1))
        assert counts() == {"e1": 2, "e2": 2, "e3": 1}
        with db.session() as s:  # a project's removal takes its experiments and runs at once
            s.execute(delete(Project).where(Project.id == 1))
        assert counts() == {}
    finally:
        db.dispose()
