"""run histograms: one row per run, prefix and action (buckets as JSON)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 00:15:00

A row per bucket cost ingest ~500 upserted rows per 5,000-task batch; one row per
(run, prefix, action) merged under a row lock costs ~20. The histograms are derived data:
``hindsight reindex`` rebuilds them (the old rows are not converted).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.drop_table("run_prefix_hist")
    op.create_table(
        "run_prefix_hist",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("prefix", sa.String(length=1024), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("buckets", sa.JSON(none_as_null=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_prefix_hist_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "prefix", "action", name=op.f("pk_run_prefix_hist")),
    )


def downgrade() -> None:
    op.drop_table("run_prefix_hist")
    op.create_table(
        "run_prefix_hist",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("prefix", sa.String(length=1024), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_prefix_hist_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "prefix", "action", "bucket", name=op.f("pk_run_prefix_hist")
        ),
    )
