"""runs: a partial index over the runs still running

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 06:10:00

Every finish worker (one per service process) looks once a minute for the Dask runs still
running in sessions gone silent (``storage.jobs.finish.close_silent``). Without an index on the
status that was a scan of the whole ``runs`` table whenever fewer than a page of such runs
existed, which is always: ~1,000,000 rows a minute per process at 10^6 runs. The index
holds only the running runs, as few as the runs in flight.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

RUNNING = {
    "postgresql_where": sa.text("status = 'running'"),
    "sqlite_where": sa.text("status = 'running'"),
}


def upgrade() -> None:
    op.create_index("ix_runs_running", "runs", ["session_id"], **RUNNING)


def downgrade() -> None:
    op.drop_index("ix_runs_running", "runs")
