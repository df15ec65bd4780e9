"""Fresh, throwaway databases for the benchmarks: a SQLite file, or a PostgreSQL database that is
dropped afterwards (`YATT_BENCH_PG_ADMIN` names the admin connection)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

PG_ADMIN = os.environ.get("YATT_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def fresh_database(kind: str, sqlite_path: Path, prefix: str = "yatt_bench") -> Iterator[str]:
    """The SQLAlchemy URL of an empty database: `sqlite_path` for "sqlite", else a new PostgreSQL
    database named `<prefix>_<random>`, dropped when the block ends."""
    if kind == "sqlite":
        yield f"sqlite:///{sqlite_path}"
        return
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
