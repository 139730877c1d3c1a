"""run_states: replay samples (a run's task states by prefix and the workers, over time)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 02:20:00

Indexed from ``state`` events as they arrive, insert-once per (run, time), so any order
of batches gives the same rows; derived data that ``hindsight reindex`` rebuilds.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "run_states",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("prefixes", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("workers", sa.JSON(none_as_null=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_states_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "time", name=op.f("pk_run_states")),
    )


def downgrade() -> None:
    op.drop_table("run_states")
