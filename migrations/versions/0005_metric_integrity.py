"""metric integrity: one point per (run, key, step), applied batch ids, per-block extremes,
attempt-scoped run tokens

Existing duplicates are folded (the newest row of each (run, key, step) is kept), then the
summaries' count/min/max are recomputed from what is stored and the blocks are built.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import backend.db

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_B = 64  # backend.metrics.models.BLOCK_STEPS when this revision was written


def upgrade() -> None:
    op.add_column("metric_points", sa.Column("attempt", sa.Integer(), server_default="1", nullable=False))
    op.add_column("api_tokens", sa.Column("attempt", sa.Integer(), nullable=True))
    op.execute(
        "DELETE FROM metric_points WHERE id NOT IN "
        "(SELECT max(id) FROM metric_points GROUP BY run_id, key, step)"
    )
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_points_run_id_key_step")
        batch_op.create_index("ix_metric_points_run_id_key_step", ["run_id", "key", "step"], unique=True)

    op.create_table(
        "metric_batches",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("points", sa.Integer(), nullable=False),
        sa.Column("created_at", backend.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_metric_batches_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "batch_id", name=op.f("pk_metric_batches")),
    )
    op.create_table(
        "metric_blocks",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("block", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=True),
        sa.Column("min_step", sa.BigInteger(), nullable=True),
        sa.Column("max_value", sa.Float(), nullable=True),
        sa.Column("max_step", sa.BigInteger(), nullable=True),
        sa.Column("nonfinite_step", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_metric_blocks_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "key", "block", name=op.f("pk_metric_blocks")),
    )
    op.execute(
        f"""
        INSERT INTO metric_blocks (run_id, key, block, count, min_value, max_value, nonfinite_step)
        SELECT run_id, key, step / {_B}, count(*), min(value), max(value),
               min(CASE WHEN value IS NULL THEN step END)
        FROM metric_points GROUP BY run_id, key, step / {_B}
        """
    )
    in_block = (
        "p.run_id = metric_blocks.run_id AND p.key = metric_blocks.key "
        f"AND p.step >= metric_blocks.block * {_B} AND p.step < (metric_blocks.block + 1) * {_B}"
    )
    op.execute(
        f"""
        UPDATE metric_blocks SET
          min_step = (SELECT min(p.step) FROM metric_points p WHERE {in_block} AND p.value = metric_blocks.min_value),
          max_step = (SELECT min(p.step) FROM metric_points p WHERE {in_block} AND p.value = metric_blocks.max_value)
        """
    )
    of_key = "b.run_id = metric_summaries.run_id AND b.key = metric_summaries.key"
    op.execute(
        f"""
        UPDATE metric_summaries SET
          count = (SELECT coalesce(sum(b.count), 0) FROM metric_blocks b WHERE {of_key}),
          min = (SELECT min(b.min_value) FROM metric_blocks b WHERE {of_key}),
          max = (SELECT max(b.max_value) FROM metric_blocks b WHERE {of_key}),
          latest = (SELECT p.value FROM metric_points p WHERE p.run_id = metric_summaries.run_id
                    AND p.key = metric_summaries.key AND p.step = metric_summaries.latest_step)
        """
    )


def downgrade() -> None:
    op.drop_table("metric_blocks")
    op.drop_table("metric_batches")
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_points_run_id_key_step")
        batch_op.create_index("ix_metric_points_run_id_key_step", ["run_id", "key", "step"], unique=False)
        batch_op.drop_column("attempt")
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_column("attempt")
