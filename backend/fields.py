"""Input types shaped like the columns they land in, so bad input is a 422 naming its field
and never a database error (a 500): ids within their column's integer range, text without
characters PostgreSQL or SQLite cannot store, durations a `timedelta` can hold."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, Field

INT32_MAX = 2**31 - 1  # `Integer` columns (ids of runs, experiments, tokens) on PostgreSQL
INT64_MAX = 2**63 - 1  # `BigInteger` columns (steps, sizes, event ids)
MAX_STEP = 2**53 - 1  # the largest integer every JSON client (JavaScript included) reads exactly
MAX_DURATION_S = 10 * 365 * 24 * 3600.0  # ten years: far inside what `timedelta` holds


def storable_text(value: str) -> str:
    """`value` unchanged, or ValueError when a database cannot store it."""
    if "\x00" in value:
        raise ValueError("NUL characters (\\u0000) cannot be stored")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("unpaired UTF-16 surrogates cannot be stored") from None
    return value


# Text that PostgreSQL and SQLite can both store (no NUL, valid Unicode).
StorableStr = Annotated[str, AfterValidator(storable_text)]


def storable_json(value: Any) -> Any:
    """`value` unchanged, or ValueError when any key or string inside it cannot be stored."""
    if isinstance(value, str):
        storable_text(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            storable_json(k)
            storable_json(v)
    elif isinstance(value, list | tuple):
        for v in value:
            storable_json(v)
    return value


# A free-form JSON object (a config, event data, a summary) whose every string is storable.
StorableDict = Annotated[dict[str, Any], AfterValidator(storable_json)]

RunIdPath = Annotated[int, Path(ge=1, le=INT32_MAX, description="A run id.")]
ExperimentIdPath = Annotated[int, Path(ge=1, le=INT32_MAX, description="An experiment id.")]
TokenIdPath = Annotated[int, Path(ge=1, le=INT32_MAX, description="A token id.")]

Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Size = Annotated[int, Field(ge=0, le=INT64_MAX)]
