"""Every table, imported in one place so Alembic and `create_all` see the whole schema."""

from backend.auth.models import ApiToken, Project, Role
from backend.db import Base
from backend.dispatch.models import RunLog
from backend.metrics.models import AppliedBatch, MetricBlock, MetricPoint, MetricSummary
from backend.metrics.sort_index import RunMetricValue
from backend.runs.models import (
    AppliedEventBatch,
    Checkpoint,
    Experiment,
    Run,
    RunAttempt,
    RunEvent,
    RunTag,
)

metadata = Base.metadata

__all__ = [
    "ApiToken",
    "AppliedBatch",
    "AppliedEventBatch",
    "Base",
    "Checkpoint",
    "Experiment",
    "MetricBlock",
    "MetricPoint",
    "MetricSummary",
    "Project",
    "Role",
    "Run",
    "RunAttempt",
    "RunEvent",
    "RunLog",
    "RunMetricValue",
    "RunTag",
    "metadata",
]
