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

    from backend.auth.models import Project
    from backend.metrics.models import MetricSummary
    from backend.runs import search
    from backend.runs.models import Experiment, Run, RunTag

    url = f"sqlite:///{tmp_path / 'old.db'}" if kind == "sqlite" else request.getfixturevalue("empty_postgres")
    upgrade(url, "0002")
    db = Database(url)
    try:
        with db.session() as s:
            project = Project(name="old")
            s.add(project)
            s.flush()
            exp = Experiment(project_id=project.id, name="gsm8k-grpo", description="", tags=[])
            s.add(exp)
            s.flush()
            run = Run(project_id=project.id, experiment_id=exp.id, name="lr-sweep-1", description="older run",
                      config={}, tag_rows=[RunTag(tag="nightly")])
            s.add(run)
            s.flush()
            s.add(MetricSummary(run_id=run.id, key="reward/mean", latest=0.4, latest_step=3, latest_time=0.0,
                                min=0.1, max=0.4, count=3))
        upgrade(url)
        with db.engine.connect() as conn:
            hits = search.matches(db.dialect, "nightly gsm8k").subquery()
            assert conn.execute(select(hits.c.run_id)).scalars().all() == [run.id]
            values = conn.execute(text("SELECT run_id, key, project_id, value FROM run_metric_values")).all()
            assert [tuple(v) for v in values] == [(run.id, "reward/mean", project.id, 0.4)]
    finally:
        db.dispose()
