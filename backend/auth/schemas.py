"""Request and response bodies for projects and tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.fields import MAX_DURATION_S, StorableStr


class ProjectOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    description: str
    created_at: datetime


class TokenCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"name": "gitlab-ci", "role": "write", "expires_in_s": 7776000}]},
    )

    name: StorableStr = Field(..., min_length=1, max_length=200)
    role: Literal["read", "write", "admin"]
    expires_in_s: float | None = Field(
        None, gt=0, le=MAX_DURATION_S, allow_inf_nan=False,
        description="Default: never expires; at most ten years.",
    )


class TokenOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    role: str
    prefix: str
    run_id: int | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(..., description="The secret; shown once, only its hash is stored.")


class WhoAmI(BaseModel):
    project: str
    project_id: int
    token_name: str
    role: str
    run_id: int | None
