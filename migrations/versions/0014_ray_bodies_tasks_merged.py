"""ray_bodies.tasks_merged: whether a stored body's task patches are in ray_tasks yet

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 15:20:00

A collector with a sweeper holds an acknowledged body's task patches in memory for a moment
before merging them (``storage.ray.bridge.TaskHold``: a task's definition and RUNNING come in one
body and its end in the next, and held together they are one row write instead of two).
The body's manifest row says its patches are not merged yet until the flush that merges
the last of them; if the process dies first, a sweeper merges the body again from its
stored blob. Rows already present were merged when they were written.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

HELD = {
    "postgresql_where": sa.text("tasks_merged IS false"),
    "sqlite_where": sa.text("tasks_merged IS 0"),
}


def upgrade() -> None:
    op.add_column(
        "ray_bodies",
        sa.Column("tasks_merged", sa.Boolean(), nullable=False, server_default=sa.true()),
    )
    op.create_index("ix_ray_bodies_held", "ray_bodies", ["received_at"], **HELD)


def downgrade() -> None:
    op.drop_index("ix_ray_bodies_held", "ray_bodies")
    op.drop_column("ray_bodies", "tasks_merged")
