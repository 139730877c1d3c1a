"""append-only rollups (a row per batch, folded when the run finishes); finish_jobs

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 23:00:00

``run_prefix_hist``, ``prefix_days`` and ``cluster_hours`` gain ``batch_id`` in their
primary keys: ingest appends a row per batch instead of locking, reading and rewriting a
shared row (``storage.runs.rollups``). Existing rows keep ``batch_id`` 0, the folded row.
``finish_jobs`` queues the work done once a run has finished (``storage.jobs.finish``), and
``runs.finished_work_at`` records when it last completed. ``prefix_hours`` (unwritten
since 0003) is dropped.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_KEYS = {
    "run_prefix_hist": ["run_id", "prefix", "action"],
    "prefix_days": ["cluster_id", "prefix", "action", "day"],
    "cluster_hours": ["cluster_id", "hour"],
}


def _rekey(table: str, keys: list[str]) -> None:
    with op.batch_alter_table(table, schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("batch_id", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.drop_constraint(f"pk_{table}", type_="primary")
        batch_op.create_primary_key(f"pk_{table}", keys)


def upgrade() -> None:
    for table, keys in _KEYS.items():
        _rekey(table, [*keys, "batch_id"])
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("finished_work_at", sa.Float(), nullable=True))
    op.create_table(
        "finish_jobs",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("due_at", sa.Float(), nullable=False),
        sa.Column("claimed_until", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_finish_jobs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_finish_jobs")),
    )
    op.create_index("ix_finish_jobs_due_at", "finish_jobs", ["due_at"], unique=False)
    op.drop_index("ix_prefix_hours_prefix_hour", table_name="prefix_hours")
    op.drop_table("prefix_hours")
    # Every finished run gets its finished-run work (the compacted copy is now written then).
    op.execute(
        "INSERT INTO finish_jobs (run_id, due_at, attempts) "
        "SELECT id, 0, 0 FROM runs WHERE status <> 'running'"
    )


def downgrade() -> None:
    op.create_table(
        "prefix_hours",
        sa.Column("cluster_id", _id, nullable=False),
        sa.Column("prefix", sa.String(length=1024), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("hour", sa.BigInteger(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["cluster_id"],
            ["clusters.id"],
            name=op.f("fk_prefix_hours_cluster_id_clusters"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "cluster_id", "prefix", "action", "hour", "bucket", name=op.f("pk_prefix_hours")
        ),
    )
    op.create_index(
        "ix_prefix_hours_prefix_hour", "prefix_hours", ["prefix", "action", "hour"], unique=False
    )
    op.drop_index("ix_finish_jobs_due_at", table_name="finish_jobs")
    op.drop_table("finish_jobs")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("finished_work_at")
    # Folded rows only: appended rows must be folded (storage.runs.rollups.fold_all) first.
    for table, keys in _KEYS.items():
        op.execute(f"DELETE FROM {table} WHERE batch_id <> 0")
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.create_primary_key(f"pk_{table}", keys)
            batch_op.drop_column("batch_id")
