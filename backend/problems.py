"""The shape of every error answer, documented once for every route: `{"detail": ...}`, a
message a person can act on, or for validation errors a list naming each field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorOut(BaseModel):
    """An error: `detail` is a message, or (422) a list of errors, each with its field's `loc`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"detail": "run 7 not found"},
                {"detail": [{"loc": ["body", "name"], "msg": "String should have at most 200 characters",
                             "type": "string_too_long"}]},
            ]
        }
    )

    detail: str | list[dict[str, Any]] = Field(..., description="What went wrong.")


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": description}


# Answers any route under /api/v1 may give besides its own.
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {
        **_error("The body cannot be parsed (not UTF-8 JSON); the HTTP server answers a malformed "
                 "request line in plain text."),
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    401: _error("No token, or an invalid, expired or revoked one."),
    403: _error("The token's role or scope does not allow this."),
    404: _error("No such resource in the token's project."),
    413: _error("The request body is larger than the limit."),
    422: _error("The request does not validate; each error names its field."),
    503: _error("The database is unavailable (down or restarting); retry after `Retry-After` seconds."),
}
