"""`yatt db upgrade`: run the Alembic migrations under `migrations/` against a database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from backend.settings import get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str | None = None) -> Config:
    """An Alembic Config for yatt's migrations and `url` (default: YATT_DATABASE_URL)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", (url or get_settings().database_url).replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Bring the database at `url` up to `revision`."""
    command.upgrade(alembic_config(url), revision)


def current(url: str | None = None) -> None:
    """Print the database's current revision."""
    command.current(alembic_config(url))
