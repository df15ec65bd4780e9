"""Small parts of the service that need no server: settings, CI metadata, cursors, errors."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from backend.cli_service import ci_metadata
from backend.client import _error_of
from backend.metrics.service import finite_or_none
from backend.runs.listing import InvalidQuery, _decode_cursor, _encode_cursor
from backend.settings import Settings


def test_settings_defaults_live_under_the_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("YATT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("YATT_DATABASE_URL", raising=False)
    monkeypatch.delenv("YATT_BROKER_URL", raising=False)
    s = Settings()
    assert s.database_url == f"sqlite:///{tmp_path}/yatt.db"
    assert s.broker_url == f"sqla+sqlite:///{tmp_path}/broker.db"
    assert s.api_base == "http://127.0.0.1:8000/api/v1"
    monkeypatch.setenv("YATT_DATABASE_URL", "postgresql+psycopg://u@db/yatt")
    assert Settings().database_url == "postgresql+psycopg://u@db/yatt"


def test_production_refuses_the_embedded_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("YATT_DATABASE_URL", raising=False)
    with pytest.raises(ValidationError, match="YATT_DATABASE_URL"):
        Settings(env="production")


def test_ci_metadata_from_gitlab_github_or_nothing() -> None:
    gitlab = ci_metadata({"GITLAB_CI": "true", "CI_COMMIT_SHA": "abc", "CI_COMMIT_REF_NAME": "main",
                          "CI_PIPELINE_URL": "https://gl/p/1"})
    assert gitlab is not None and gitlab["provider"] == "gitlab" and gitlab["commit"] == "abc"
    github = ci_metadata({"GITHUB_ACTIONS": "true", "GITHUB_SHA": "def", "GITHUB_REF_NAME": "dev",
                          "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "o/r", "GITHUB_RUN_ID": "7"})
    assert github is not None and github["pipeline_url"] == "https://github.com/o/r/actions/runs/7"
    assert ci_metadata({"HOME": "/root"}) is None


def test_cursor_round_trip_and_refusals() -> None:
    cursor = _encode_cursor("-reward/mean", 0, 0.1 + 0.2, 17)
    assert _decode_cursor(cursor, "-reward/mean") == (0, 0.1 + 0.2, 17)
    with pytest.raises(InvalidQuery, match="sort"):
        _decode_cursor(cursor, "created_at")
    with pytest.raises(InvalidQuery):
        _decode_cursor("not-base64!!", "created_at")


def test_non_finite_values_become_none() -> None:
    assert finite_or_none(1.5) == 1.5
    assert [finite_or_none(v) for v in (math.nan, math.inf, -math.inf, None)] == [None] * 4


def test_client_errors_carry_field_paths() -> None:
    body = {"detail": [{"loc": ["body", "config", "train", "lr"], "path": "train.lr", "msg": "must be > 0"},
                       {"loc": ["body", "experiment"], "msg": "Field required"}]}
    err = _error_of(httpx.Response(422, json=body))
    assert err.status == 422
    assert err.errors == [("train.lr", "must be > 0"), ("experiment", "Field required")]
    assert _error_of(httpx.Response(409, json={"detail": "run 3 is running"})).message == "run 3 is running"
    assert _error_of(httpx.Response(502, text="bad gateway")).message == "bad gateway"


def test_free_ports_are_distinct_bindable_and_avoid_the_excluded():
    """Ports for a Ray head's many listeners, picked together: one at a time the kernel may offer
    the same port twice (a head once got one port for its GCS and its dashboard)."""
    import socket

    from backend.dispatch.local_ray import free_ports

    taken = free_ports(3)
    ports = free_ports(200, exclude=taken)
    assert len(set(ports)) == 200 and not set(ports) & set(taken)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free once handed out
