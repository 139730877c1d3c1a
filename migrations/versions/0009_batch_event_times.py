"""batches.t_min / t_max: the event-time range a batch holds

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 01:30:00

A run's metrics, worker-side events and profile cycles are in its session's batches
"around" the run. Picking those by arrival time broke after ``reindex`` (which receives
every batch again, now); the batches' own event times do not change. Batches indexed
before this revision have no times and are still picked by arrival until a reindex.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("t_min", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("t_max", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("t_max")
        batch_op.drop_column("t_min")
