"""Alembic environment: the schema is `backend.models.metadata`, the URL is yatt's settings
(or the `sqlalchemy.url` a caller put on the Config, as `yatt db upgrade --url` and the tests do)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from backend.db import Database
from backend.models import metadata
from backend.runs.search import include_object
from backend.settings import get_settings

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().database_url


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    context.configure(
        connection=connection,
        url=url,
        target_metadata=metadata,
        compare_type=True,
        compare_server_default=True,
        include_object=include_object,  # the search index is made by backend.runs.search
        # SQLite cannot ALTER most things: batch mode rebuilds the table instead.
        render_as_batch=True,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    _configure(url=_url())
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # a caller lent us its connection
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    db = Database(_url())
    try:
        with db.engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
            conn.commit()
    finally:
        db.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
