"""run logs: the stored copy of each attempt's Ray job log

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import backend.db

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_logs",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("updated_at", backend.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_logs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "attempt", name=op.f("pk_run_logs")),
    )


def downgrade() -> None:
    op.drop_table("run_logs")
