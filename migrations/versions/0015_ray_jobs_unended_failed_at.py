"""ray_jobs.unended_failed_at: when a job's close wrote its unended tasks FAILED

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 01:00:00

A job whose driver exited (FINISHED, or the driver task's end) is closed with its tasks
that had not ended written FAILED (``WORKER_DIED``), as Ray's State API lists them; Ray
sends no end for them. The run's completeness then counts them as ended, and a task
pending at the job's end as one that never ran. A job closed when idle, with no end from
Ray, writes them ``lost``, and stays so if Ray's FINISHED comes later. The column is the
collector's time of the close that failed them (tasks first seen after it came later and
were written as they were); NULL if none did. Rows already present keep NULL: their
completeness reads as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ray_jobs", sa.Column("unended_failed_at", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("ray_jobs", "unended_failed_at")
