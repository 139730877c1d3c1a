"""why a run was slow: fine performance metrics, submitting code, statistical profiles

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 00:00:00

``run_activity`` and ``run_code`` are indexed from ``activity`` and ``code`` events as they
arrive (latest-sample-wins and insert-once, both commutative); ``run_profiles`` is built
once a run has finished, from the ``profile`` events of its workers. All three are derived
data: ``hindsight reindex`` rebuilds them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _run_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["run_id"], ["runs.id"], name=op.f(f"fk_{table}_run_id_runs"), ondelete="CASCADE"
    )


def upgrade() -> None:
    op.create_table(
        "run_activity",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("context", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=1024), nullable=False),
        sa.Column("activity", sa.String(length=64), nullable=False),
        sa.Column("unit", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        _run_fk("run_activity"),
        sa.PrimaryKeyConstraint(
            "run_id", "context", "prefix", "activity", "unit", name=op.f("pk_run_activity")
        ),
    )
    op.create_table(
        "run_code",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("frames", sa.JSON(none_as_null=True), nullable=False),
        _run_fk("run_code"),
        sa.PrimaryKeyConstraint("run_id", "digest", name=op.f("pk_run_code")),
    )
    op.create_table(
        "run_profiles",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("prefix", sa.String(length=1024), nullable=False),
        sa.Column("worker", sa.String(length=1024), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("interval", sa.Float(), nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        _run_fk("run_profiles"),
        sa.PrimaryKeyConstraint("run_id", "prefix", "worker", name=op.f("pk_run_profiles")),
    )


def downgrade() -> None:
    op.drop_table("run_profiles")
    op.drop_table("run_code")
    op.drop_table("run_activity")
