"""Request and response bodies for metrics.

Non-finite values (NaN, ±Infinity, sent as JSON `NaN`/`Infinity`, strings "nan"/"inf", or
`null`) are accepted: the point is stored with a NULL value and comes back as `null`, the key
kept, so a diverging run shows where it diverged. Min/max ignore them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from backend.fields import Step, StorableStr


class MetricPointIn(BaseModel):
    key: StorableStr = Field(..., min_length=1, max_length=200)
    step: Step
    value: float | None
    time: float | None = Field(
        None, ge=0, le=1e11, allow_inf_nan=False, description="Unix seconds; default: when received."
    )


class MetricBatch(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "batch_id": "a1-000000000042",
                    "points": [
                        {"key": "reward/mean", "step": 1, "value": 0.31, "time": 1764403200.5},
                        {"key": "throughput/tokens_per_s", "step": 1, "value": 2810.0, "time": 1764403200.5},
                    ]
                }
            ]
        }
    )

    batch_id: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$",
        description="The sender's id for this batch: a batch the run has already applied is "
        "not applied again (the answer carries `Idempotent-Replayed: true`).",
    )
    points: list[MetricPointIn]


class MetricPointOut(BaseModel):
    step: int
    value: float | None
    time: float


class MetricSeries(BaseModel):
    series: dict[str, list[MetricPointOut]]


class MetricKeyOut(BaseModel):
    key: str
    latest: float | None
    latest_step: int
    latest_time: float
    min: float | None
    max: float | None
    count: int
