"""experiment run counts: `experiments.run_count`, kept by triggers, counted from the runs stored

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 14:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from backend.runs import run_counts

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("experiments", sa.Column("run_count", sa.Integer(), server_default="0", nullable=False))
    conn = op.get_bind()
    # triggers first: on PostgreSQL creating them locks out run inserts until this commits, so
    # no run lands between the count below and the first trigger call
    run_counts.install(conn)
    run_counts.recount(conn)


def downgrade() -> None:
    run_counts.uninstall(op.get_bind())
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.drop_column("run_count")
