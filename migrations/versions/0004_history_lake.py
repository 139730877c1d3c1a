"""history lake: lake_partitions, lake_files, lake_runs

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 00:00:00

The lake's catalog in the index: which partitions exist, their live files with the
statistics the query service prunes by, and where each run is. Derived from the lake's
manifests in the blob store (``storage/lake/build.py``); a rebuilt index gets it back from them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "lake_partitions",
        sa.Column("id", _id, nullable=False),
        sa.Column("tenant_id", _id, nullable=False),
        sa.Column("cluster_id", _id, nullable=False),
        sa.Column("day", sa.String(length=10), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("vacuum_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["cluster_id"],
            ["clusters.id"],
            name=op.f("fk_lake_partitions_cluster_id_clusters"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_lake_partitions_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lake_partitions")),
        sa.UniqueConstraint("cluster_id", "day", name=op.f("uq_lake_partitions_cluster_id_day")),
    )
    with op.batch_alter_table("lake_partitions", schema=None) as batch_op:
        batch_op.create_index("ix_lake_partitions_tenant_day", ["tenant_id", "day"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_lake_partitions_vacuum_at"), ["vacuum_at"], unique=False
        )
    op.create_table(
        "lake_files",
        sa.Column("id", _id, nullable=False),
        sa.Column("partition_id", _id, nullable=False),
        sa.Column("tbl", sa.String(length=16), nullable=False),
        sa.Column("key", sa.String(length=1024), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("t_min", sa.Float(), nullable=True),
        sa.Column("t_max", sa.Float(), nullable=True),
        sa.Column("runs", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("stats", sa.JSON(none_as_null=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["partition_id"],
            ["lake_partitions.id"],
            name=op.f("fk_lake_files_partition_id_lake_partitions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lake_files")),
    )
    with op.batch_alter_table("lake_files", schema=None) as batch_op:
        batch_op.create_index("ix_lake_files_partition_tbl", ["partition_id", "tbl"], unique=False)
    op.create_table(
        "lake_runs",
        sa.Column("run_id", _id, nullable=False),
        sa.Column("partition_id", _id, nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["partition_id"],
            ["lake_partitions.id"],
            name=op.f("fk_lake_runs_partition_id_lake_partitions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_lake_runs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_lake_runs")),
    )
    with op.batch_alter_table("lake_runs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_lake_runs_partition_id"), ["partition_id"], unique=False
        )


def downgrade() -> None:
    op.drop_table("lake_runs")
    op.drop_table("lake_files")
    op.drop_table("lake_partitions")
