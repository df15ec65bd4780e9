"""The API while its PostgreSQL is down and after it comes back (the quick half of the fault
drill in test_fault_drills.py): 503 with a readable message at once, never a 500 or a hang,
and every route serving again once the server is back, without restarting the API."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, start_api
from tests.fault_servers import ThrowawayPostgres

pytestmark = pytest.mark.postgres


@pytest.fixture
def postgres() -> Iterator[ThrowawayPostgres]:
    server = ThrowawayPostgres()
    try:
        server.start()
        server.create_database("yatt")
        yield server
    finally:
        server.destroy()


@pytest.fixture
def api(postgres: ThrowawayPostgres, tmp_path: Path) -> Iterator[LiveServer]:
    server = start_api(postgres.url_for("yatt"), tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_database_down_answers_503_and_the_api_recovers_when_it_returns(
    postgres: ThrowawayPostgres, api: LiveServer
) -> None:
    token = api.make_token("outage")
    client = httpx.Client(base_url=f"{api.url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    created = client.post("/experiments", json={"name": "before-the-outage"})
    assert created.status_code == 201, created.text

    postgres.stop("fast")
    for method, path, body in [("GET", "/experiments", None), ("POST", "/experiments", {"name": "during"}),
                               ("GET", f"/experiments/{created.json()['id']}", None), ("GET", "/runs", None)]:
        t0 = time.monotonic()
        resp = client.request(method, path, json=body)
        assert resp.status_code == 503, (method, path, resp.status_code, resp.text)
        assert resp.json() == {"detail": "database unavailable; retry shortly"}
        assert resp.headers["retry-after"] == "1"
        assert time.monotonic() - t0 < 5, (method, path)
    ready = httpx.get(f"{api.url}/readyz", timeout=10)
    assert ready.status_code == 503 and ready.json()["detail"] == "database unavailable"

    postgres.start()
    listed = client.get("/experiments")  # the pool's closed connections are replaced (pre-ping)
    assert listed.status_code == 200, listed.text
    assert [e["name"] for e in listed.json()] == ["before-the-outage"]  # the refused POST stored nothing
    assert httpx.get(f"{api.url}/readyz", timeout=10).status_code == 200
    client.close()
