"""run_prefix_actions.hist, run_metrics, run_batch_lists: a finished run's per-batch rows packed

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-29 07:10:00

When a run finishes, its ``run_prefix_hist`` rows (one per batch, prefix and action)
are packed into the ``hist`` column of the run's ``run_prefix_actions`` row, and its
``run_activity`` rows (one per context, prefix, activity and unit) into one
``run_metrics`` row, and its ``run_batches`` rows into one ``run_batch_lists`` row
(``storage.runs.packed``). Runs indexed before this revision keep
their rows until ``hindsight reindex --detail`` packs them; readers read both.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("run_prefix_actions", sa.Column("hist", sa.LargeBinary(), nullable=True))
    op.create_table(
        "run_metrics",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_metrics_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_metrics")),
    )
    op.create_table(
        "run_batch_lists",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_run_batch_lists_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_batch_lists")),
    )


def downgrade() -> None:
    op.drop_table("run_batch_lists")
    op.drop_table("run_metrics")
    with op.batch_alter_table("run_prefix_actions") as batch:
        batch.drop_column("hist")
