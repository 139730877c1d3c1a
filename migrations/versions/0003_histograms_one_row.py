"""run histograms: one row per run, prefix and action (buckets as JSON); prefix_days

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 00:15:00

A row per bucket cost ingest ~500 upserted rows per 5,000-task batch; one row per
(run, prefix, action) merged under a row lock costs ~20. The histograms are derived data:
``hindsight reindex`` rebuilds them (the old rows are not converted). ``prefix_days`` holds
the same histograms per cluster and day for cross-run histories.
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
    op.create_table(
        "prefix_days",
        sa.Column("cluster_id", _id, nullable=False),
        sa.Column("prefix", sa.String(length=1024), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("day", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.Column("max", sa.Float(), nullable=False),
        sa.Column("buckets", sa.JSON(none_as_null=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["cluster_id"],
            ["clusters.id"],
            name=op.f("fk_prefix_days_cluster_id_clusters"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "cluster_id", "prefix", "action", "day", name=op.f("pk_prefix_days")
        ),
    )
    with op.batch_alter_table("prefix_days", schema=None) as batch_op:
        batch_op.create_index(
            "ix_prefix_days_prefix_day", ["prefix", "action", "day"], unique=False
        )


def downgrade() -> None:
    op.drop_table("prefix_days")
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
