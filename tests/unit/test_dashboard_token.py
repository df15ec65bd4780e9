"""The dashboard sends the server's YATT_TOKEN only to the API it was configured for."""

from __future__ import annotations

import pytest

from dashboard.session import server_token_for


def test_server_token_goes_only_to_the_configured_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YATT_API_URL", "http://127.0.0.1:8000")
    monkeypatch.setenv("YATT_TOKEN", "yatt_server-admin")
    assert server_token_for("http://127.0.0.1:8000") == "yatt_server-admin"
    assert server_token_for("http://127.0.0.1:8000/ ") == "yatt_server-admin"
    # a visitor's URL typed into the login box with the token field left empty
    assert server_token_for("https://evil.example.com") == ""
    assert server_token_for("http://127.0.0.1:8001") == ""
    monkeypatch.delenv("YATT_API_URL")  # the default URL is the configured one
    assert server_token_for("http://127.0.0.1:8000") == "yatt_server-admin"
