"""One settings object for the whole service, read from `YATT_*` environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything the API, the CLI, the worker and the dashboard need to find each other."""

    model_config = SettingsConfigDict(env_prefix="YATT_", extra="ignore")

    env: Literal["development", "production"] = Field(
        "development", description="`production` refuses the embedded SQLite defaults."
    )
    data_dir: Path = Field(Path(".yatt"), description="Embedded databases, run outputs, models.")
    database_url: str = Field(
        "", description="SQLAlchemy URL; default: SQLite file `<data_dir>/yatt.db`."
    )
    broker_url: str = Field(
        "", description="Celery broker; default: kombu SQLAlchemy transport on `<data_dir>`."
    )
    ray_address: str | None = Field(None, description="Existing Ray cluster; default: local head.")
    api_url: str = Field("http://127.0.0.1:8000", description="Where clients find the API.")
    token: str | None = Field(None, description="API token the CLI and dashboard present.")
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Larger request bodies get HTTP 413."
    )
    max_metric_points: int = Field(10_000, ge=1, description="Points per POST /metrics batch.")
    run_token_ttl_s: int = Field(
        7 * 24 * 3600, ge=60,
        description="Lifetime of an attempt's run token when the run sets no max_duration_s.",
    )
    run_token_grace_s: float = Field(
        600.0, ge=0, description="Added to a run token's lifetime for the trainer's last reports."
    )
    stream_poll_s: float = Field(0.5, gt=0, description="How often SSE streams look for news.")
    sqlite_busy_timeout_ms: int = Field(30_000, ge=0)
    # dispatch (backend/dispatch): Celery worker, reconciler, Ray Jobs
    dispatch: bool = Field(
        True, description="Enqueue dispatch tasks after run state changes (false: API only)."
    )
    reconcile_interval_s: float = Field(3.0, gt=0, description="How often the reconciler runs.")
    max_concurrent_runs_per_project: int = Field(
        4, ge=1, description="Runs of one project that may hold devices at once."
    )
    start_timeout_s: float = Field(
        300.0, gt=0, description="A run `starting` longer than this without a Ray job fails."
    )
    report_grace_s: float = Field(
        20.0, ge=0, description="Wait this long for a finished trainer's last report."
    )
    worker_pool: Literal["solo", "threads"] = Field("threads", description="Never prefork.")
    worker_concurrency: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'yatt.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.data_dir / 'broker.db'}"
        if self.env == "production" and self.database_url.startswith("sqlite"):
            raise ValueError("YATT_ENV=production needs YATT_DATABASE_URL (PostgreSQL)")
        return self

    @property
    def api_base(self) -> str:
        """The API URL with the version prefix."""
        return self.api_url.rstrip("/") + "/api/v1"


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings (cached; tests call `get_settings.cache_clear()`)."""
    return Settings()
