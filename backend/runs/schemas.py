"""Request and response bodies for experiments, runs, events and checkpoints."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.fields import MAX_DURATION_S, Size, Step, StorableDict, StorableStr, storable_json
from backend.runs.state import RunState

Tag = Annotated[StorableStr, Field(min_length=1, max_length=100)]

EXAMPLE_CONFIG: dict[str, Any] = {"algorithm": {"name": "grpo"}, "train": {"max_steps": 40}, "seed": 1}


class CIInfo(BaseModel):
    """Who launched a run from CI; extra keys are kept as sent."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "provider": "gitlab",
                    "commit": "3f2a9c1",
                    "branch": "main",
                    "pipeline_url": "https://ci.example.com/team/rlhf/-/pipelines/812",
                }
            ]
        },
    )

    provider: StorableStr | None = Field(None, max_length=50)
    commit: StorableStr | None = Field(None, max_length=100)
    branch: StorableStr | None = Field(None, max_length=200)
    pipeline_url: StorableStr | None = Field(None, max_length=1000)
    job: StorableStr | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _extras_storable(self) -> CIInfo:
        storable_json(self.model_extra or {})
        return self


class RunCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "experiment": "grpo-arith",
                    "name": "lr-5e-5",
                    "config": EXAMPLE_CONFIG,
                    "tags": ["baseline"],
                    "ci": {"commit": "3f2a9c1", "branch": "main", "pipeline_url": "https://ci/p/812"},
                }
            ]
        },
    )

    experiment: StorableStr = Field(..., min_length=1, max_length=200, description="Created if needed.")
    name: StorableStr | None = Field(None, max_length=200, description="Default: `<experiment>-<id>`.")
    description: StorableStr = Field("", max_length=10_000)
    config: StorableDict = Field(default_factory=dict, description="A TrainerConfig.")
    tags: list[Tag] = Field(default_factory=list, max_length=50)
    ci: CIInfo | None = Field(None, description="Set by CI jobs: marks the run as launched by CI.")
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first.")
    max_attempts: int = Field(1, ge=1, le=20, description="Attempts the dispatcher may make.")
    max_duration_s: float | None = Field(
        None, gt=0, le=MAX_DURATION_S, allow_inf_nan=False, description="Wall-clock limit per attempt."
    )


class ConfigValidate(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"config": EXAMPLE_CONFIG}]})

    config: StorableDict = Field(default_factory=dict)


class ConfigValid(BaseModel):
    valid: Literal[True] = True
    config: dict[str, Any]


class MetricSummaryOut(BaseModel):
    latest: float | None
    min: float | None
    max: float | None
    step: int


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    project_id: int
    experiment_id: int
    experiment: str
    name: str
    description: str
    state: RunState
    attempt: int
    max_attempts: int
    priority: int
    max_duration_s: float | None
    tags: list[str]
    launched_by: Literal["user", "ci"]
    launched_by_name: str
    ci: dict[str, Any] | None
    config: dict[str, Any]
    seed: int
    code_version: str | None
    package_versions: dict[str, Any] | None
    run_dir: str | None
    summary: dict[str, Any] | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    metrics: dict[str, MetricSummaryOut] = Field(
        default_factory=dict, description="Summaries of the sort key and the requested `metrics`."
    )

    @classmethod
    def of(cls, run: Any, metrics: dict[str, dict[str, Any]] | None = None) -> RunOut:
        data = {name: getattr(run, name) for name in cls.model_fields if name not in ("experiment", "metrics")}
        summaries = {k: MetricSummaryOut(**v) for k, v in (metrics or {}).items()}
        return cls(**data, experiment=run.experiment.name, metrics=summaries)


class RunListItem(BaseModel):
    """A run as the History table shows it: `GET /runs/{id}` has the config and the rest."""

    id: int
    project_id: int
    experiment_id: int
    experiment: str
    name: str
    state: RunState
    attempt: int
    max_attempts: int
    priority: int
    tags: list[str]
    launched_by: Literal["user", "ci"]
    launched_by_name: str
    ci: dict[str, Any] | None
    summary: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    metrics: dict[str, MetricSummaryOut] = Field(
        default_factory=dict, description="Summaries of the sort key and the requested `metrics`."
    )
    score: float | None = Field(None, description="Relevance to `q` when sorted by relevance; higher is better.")

    @classmethod
    def of(cls, run: Any, metrics: dict[str, dict[str, Any]] | None = None, score: float | None = None) -> RunListItem:
        skip = ("experiment", "metrics", "score")
        data = {name: getattr(run, name) for name in cls.model_fields if name not in skip}
        summaries = {k: MetricSummaryOut(**v) for k, v in (metrics or {}).items()}
        return cls(**data, experiment=run.experiment.name, metrics=summaries, score=score)


class RunPage(BaseModel):
    items: list[RunListItem]
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page.")


class StateUpdate(BaseModel):
    """A state report from the trainer (run token) or the dispatcher."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"state": "running"},
                {"state": "succeeded", "summary": {"reward/mean": 0.82}},
                {"state": "failed", "reason": "CUDA out of memory at step 31"},
            ]
        },
    )

    state: RunState
    reason: StorableStr | None = Field(None, max_length=20_000)
    summary: StorableDict | None = None
    code_version: StorableStr | None = Field(None, max_length=200)
    package_versions: StorableDict | None = None
    run_dir: StorableStr | None = Field(None, max_length=1000)


class RunAction(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"reason": "superseded by run 12"}]}
    )

    reason: StorableStr | None = Field(None, max_length=2000)


class AttemptOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    number: int
    state: RunState
    submission_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None


class ExperimentCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"name": "grpo-arith", "description": "Does GRPO learn 2-digit sums?", "tags": ["arith"]}]
        },
    )

    name: StorableStr = Field(..., min_length=1, max_length=200)
    description: StorableStr = Field("", max_length=10_000)
    tags: list[Tag] = Field(default_factory=list, max_length=50)


class ExperimentOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    description: str
    tags: list[str]
    created_at: datetime
    run_count: int = 0


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: StorableStr = Field(..., min_length=1, max_length=50, examples=["placement", "phase_spans"])
    message: StorableStr = Field("", max_length=20_000)
    data: StorableDict | None = None
    time: datetime | None = Field(None, description="Unix seconds or ISO-8601; default: now.")


class EventBatch(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "batch_id": "a1-000000000043",
                    "events": [
                        {"kind": "placement", "message": "colocate on 2 devices", "data": {"mode": "colocate", "devices": 2}}
                    ],
                }
            ]
        },
    )

    batch_id: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$",
        description="The sender's id for this batch: a batch the run has already applied is "
        "not applied again (the answer carries `Idempotent-Replayed: true`).",
    )
    events: list[EventIn] = Field(..., max_length=10_000)


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    attempt: int
    time: datetime
    kind: str
    message: str
    data: dict[str, Any] | None


class CheckpointIn(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"step": 20, "path": "runs/7/checkpoints/step-20", "size_bytes": 73400320, "metrics": {"reward/mean": 0.61}}
            ]
        },
    )

    step: Step
    path: StorableStr = Field(..., min_length=1, max_length=1000)
    size_bytes: Size | None = None
    metrics: StorableDict | None = None


class CheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    attempt: int
    step: int
    path: str
    size_bytes: int | None
    metrics: dict[str, Any] | None
    created_at: datetime


class Accepted(BaseModel):
    accepted: int


class CompareRun(BaseModel):
    """One run of a comparison: its row, its config, its metric keys and the chosen series."""

    run: RunListItem
    config: dict[str, Any]
    keys: list[str] = Field(description="Every metric key the run has reported.")
    series: dict[str, list[dict[str, Any]]] = Field(
        description="The chosen keys' points (`step`, `value`, `time`), at most `max_points` each."
    )


class Comparison(BaseModel):
    runs: list[CompareRun]
