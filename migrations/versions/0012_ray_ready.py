"""ray_ready: complete Ray tasks queued by the merge that completed them

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-23 07:00:00

A task used to be written in three steps: its merges (definition and RUNNING, then its end),
then the sweeper's ``UPDATE ray_tasks SET emitted=true`` over every complete unwritten task
it could find, a scan of the partial indexes and their dead entries that cost half of
Postgres's time under load (bench/ray_ingest.py). The merge that completes a task now flips
``emitted`` itself and queues the task in ``ray_ready`` in the same statement
(``emitted_before`` tells it the flip happened there); the sweeper drains the queue.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column(
        "ray_tasks",
        sa.Column("emitted_before", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "ray_ready",
        sa.Column("session_id", _id, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("session_id", "task_id", "attempt", name=op.f("pk_ray_ready")),
    )


def downgrade() -> None:
    # Queued tasks go back to "complete, not yet written": the sweeper finds them again.
    op.execute(
        "UPDATE ray_tasks SET emitted = false WHERE EXISTS (SELECT 1 FROM ray_ready r WHERE "
        "r.session_id = ray_tasks.session_id AND r.task_id = ray_tasks.task_id "
        "AND r.attempt = ray_tasks.attempt)"
    )
    op.drop_table("ray_ready")
    with op.batch_alter_table("ray_tasks") as batch:
        batch.drop_column("emitted_before")
