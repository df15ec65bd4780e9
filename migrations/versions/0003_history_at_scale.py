"""history at scale: the metric sort index and the full-text search index over runs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from backend.runs import search

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_metric_values",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"],
            name=op.f("fk_run_metric_values_project_id_projects"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_metric_values_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "key", name=op.f("pk_run_metric_values")),
    )
    op.create_index(
        "ix_run_metric_values_sort", "run_metric_values", ["project_id", "key", "value", "run_id"]
    )
    op.create_index("ix_runs_project_id_experiment_id", "runs", ["project_id", "experiment_id"])
    op.execute(
        "INSERT INTO run_metric_values (run_id, key, project_id, value) "
        "SELECT s.run_id, s.key, r.project_id, s.latest "
        "FROM metric_summaries s JOIN runs r ON r.id = s.run_id"
    )
    conn = op.get_bind()
    search.install(conn)
    search.rebuild(conn)


def downgrade() -> None:
    search.uninstall(op.get_bind())
    op.drop_index("ix_runs_project_id_experiment_id", table_name="runs")
    op.drop_index("ix_run_metric_values_sort", table_name="run_metric_values")
    op.drop_table("run_metric_values")
