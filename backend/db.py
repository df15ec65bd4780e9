"""Engine, sessions and the declarative base: the only place that knows the database URL.

SQLite runs in WAL mode with a busy timeout, because the API, the worker and the trainer's
reporters write at once. Work that must happen only once a transaction is durable (enqueueing
a Celery task) is registered with `after_commit(session, fn)` and runs when the session commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Integer, MetaData, create_engine, event, text
from sqlalchemy.engine import Dialect, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from backend.settings import Settings, get_settings

log = logging.getLogger(__name__)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

READ_ONLY = "yatt_read_only"

# SQLite only auto-increments an `INTEGER PRIMARY KEY`; PostgreSQL gets a real bigint.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite forgets the zone otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[Any]: JSON()}


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(UTC)


def make_engine(url: str, *, busy_timeout_ms: int = 30_000, echo: bool = False) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout and foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=20)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        echo=echo,
        connect_args={"check_same_thread": False, "timeout": busy_timeout_ms / 1000},
    )

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        # pysqlite's own transaction handling defers BEGIN; take it over so that
        # `BEGIN IMMEDIATE` below is what actually starts a write transaction.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: Any) -> None:
        # A write transaction takes the lock when it starts: one that reads and later writes
        # would otherwise fail with "database is locked" (WAL snapshot upgrade) without
        # waiting for busy_timeout. Read-only sessions keep WAL's concurrent readers.
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class Database:
    """An engine and its session factory."""

    def __init__(self, url: str, *, busy_timeout_ms: int = 30_000, echo: bool = False):
        self.url = url
        self.engine = make_engine(url, busy_timeout_ms=busy_timeout_ms, echo=echo)
        self.sessionmaker = sessionmaker(self.engine, expire_on_commit=False)
        self.read_sessionmaker = sessionmaker(
            self.engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False
        )

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Database:
        settings = settings or get_settings()
        return cls(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits when the block ends and rolls back on an exception."""
        with self.sessionmaker() as db_session:
            try:
                yield db_session
                db_session.commit()
            except BaseException:
                db_session.rollback()
                raise

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A session for reads only; on SQLite it never waits for writers."""
        with self.read_sessionmaker() as db_session:
            try:
                yield db_session
            finally:
                db_session.rollback()

    def ping(self) -> None:
        """Raise unless the database answers."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def after_commit(db_session: Session, fn: Callable[[], None]) -> None:
    """Run `fn` once `db_session` commits; dropped if it rolls back."""
    db_session.info.setdefault("after_commit", []).append(fn)


@event.listens_for(Session, "after_commit")
def _run_after_commit(db_session: Session) -> None:
    for fn in db_session.info.pop("after_commit", []):
        try:
            fn()
        except Exception:  # the row is committed; the reconciler re-drives a lost message
            log.exception("after-commit callback %r failed", fn)


@event.listens_for(Session, "after_rollback")
def _drop_after_commit(db_session: Session) -> None:
    db_session.info.pop("after_commit", None)
