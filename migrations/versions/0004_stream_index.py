"""metric points by (run_id, id): the live stream reads a run's points after an id

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 11:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_metric_points_run_id_id", "metric_points", ["run_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_metric_points_run_id_id", table_name="metric_points")
