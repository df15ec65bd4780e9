"""The dashboard's calls to the yatt API, all through `backend.client.YattClient`.

Each function is one route of docs/contracts.md; failures come back as `ApiError` with the
HTTP status (0 when the API could not be reached) and the API's own message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from backend.client import YattClient

__all__ = ["Client", "ApiError", "connect"]

Client = YattClient


class ApiError(Exception):
    """A refused or failed API call: `status` (0: unreachable), `message`, and for 422 the
    `(field path, message)` pairs the API named."""

    def __init__(self, status: int, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.errors = status, message, errors or []


def connect(api_url: str, token: str) -> YattClient:
    """A client for the API at `api_url` (base URL, without `/api/v1`)."""
    return YattClient(api_url, token)


def _request(c: YattClient, method: str, path: str, **kwargs: Any) -> Any:
    raise NotImplementedError  # filled in once backend/client.py lands


def whoami(c: YattClient) -> dict[str, Any]:
    return _request(c, "GET", "/projects")
