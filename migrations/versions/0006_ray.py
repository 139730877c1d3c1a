"""Ray's event exporter: stored bodies, event counts, and the merge tables of jobs, tasks,
nodes, workers and actors (storage/ray/bridge.py)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 22:57:45

Derived data like every table of the index: ``hindsight reindex`` rebuilds it from the
stored exporter bodies (``ray/v1/...``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ray_actors",
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("actor_id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("class_name", sa.String(length=1024), nullable=True),
        sa.Column("name", sa.String(length=1024), nullable=True),
        sa.Column("node_id", sa.String(length=64), nullable=True),
        sa.Column("worker_id", sa.String(length=64), nullable=True),
        sa.Column("pid", sa.BigInteger(), nullable=True),
        sa.Column("alive_at", sa.Float(), nullable=True),
        sa.Column("dead_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_actors_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "actor_id", name=op.f("pk_ray_actors")),
    )
    op.create_table(
        "ray_bodies",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("sha", sa.String(length=64), nullable=False),
        sa.Column("blob_key", sa.String(length=1024), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_bodies_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ray_bodies")),
        sa.UniqueConstraint("session_id", "sha", name=op.f("uq_ray_bodies_session_id_sha")),
    )
    op.create_table(
        "ray_event_counts",
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("event_type", sa.String(length=128), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_event_counts_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "session_id", "kind", "event_type", name=op.f("pk_ray_event_counts")
        ),
    )
    op.create_table(
        "ray_jobs",
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("entrypoint", sa.Text(), nullable=True),
        sa.Column("driver_pid", sa.BigInteger(), nullable=True),
        sa.Column("driver_node", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("driver_exit_at", sa.Float(), nullable=True),
        sa.Column("end_seen", sa.Float(), nullable=True),
        sa.Column("last_event_at", sa.Float(), nullable=False),
        sa.Column("closed_at", sa.Float(), nullable=True),
        sa.Column("closed_by", sa.String(length=16), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_jobs_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "job_id", name=op.f("pk_ray_jobs")),
    )
    op.create_table(
        "ray_nodes",
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("node_id", sa.String(length=64), nullable=False),
        sa.Column("ip", sa.String(length=256), nullable=True),
        sa.Column("hostname", sa.String(length=1024), nullable=True),
        sa.Column("name", sa.String(length=1024), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("alive_at", sa.Float(), nullable=True),
        sa.Column("dead_at", sa.Float(), nullable=True),
        sa.Column("death_reason", sa.Text(), nullable=True),
        sa.Column("resources", sa.JSON(none_as_null=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_nodes_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "node_id", name=op.f("pk_ray_nodes")),
    )
    op.create_table(
        "ray_tasks",
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("task_id", sa.String(length=64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("defined", sa.Boolean(), nullable=False),
        sa.Column("name", sa.String(length=1024), nullable=True),
        sa.Column("func", sa.String(length=1024), nullable=True),
        sa.Column("module", sa.String(length=1024), nullable=True),
        sa.Column("task_type", sa.String(length=32), nullable=True),
        sa.Column("parent_id", sa.String(length=64), nullable=True),
        sa.Column("actor_id", sa.String(length=64), nullable=True),
        sa.Column("node_id", sa.String(length=64), nullable=True),
        sa.Column("worker_id", sa.String(length=64), nullable=True),
        sa.Column("pid", sa.BigInteger(), nullable=True),
        sa.Column("pending_at", sa.Float(), nullable=True),
        sa.Column("submitted_at", sa.Float(), nullable=True),
        sa.Column("running_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("failed_at", sa.Float(), nullable=True),
        sa.Column("error_type", sa.String(length=128), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("first_seen", sa.Float(), nullable=False),
        sa.Column("end_seen", sa.Float(), nullable=True),
        sa.Column("emitted", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_tasks_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "task_id", "attempt", name=op.f("pk_ray_tasks")),
    )
    op.create_index("ix_ray_tasks_job", "ray_tasks", ["session_id", "job_id", "emitted"])
    op.create_index("ix_ray_tasks_pending", "ray_tasks", ["emitted", "end_seen"])

    op.create_table(
        "ray_workers",
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("worker_id", sa.String(length=64), nullable=False),
        sa.Column("node_id", sa.String(length=64), nullable=True),
        sa.Column("pid", sa.BigInteger(), nullable=True),
        sa.Column("worker_type", sa.String(length=32), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("exit_type", sa.String(length=64), nullable=True),
        sa.Column("exit_detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_ray_workers_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "worker_id", name=op.f("pk_ray_workers")),
    )


def downgrade() -> None:
    op.drop_table("ray_workers")
    op.drop_index("ix_ray_tasks_pending", "ray_tasks")
    op.drop_index("ix_ray_tasks_job", "ray_tasks")

    op.drop_table("ray_tasks")
    op.drop_table("ray_nodes")
    op.drop_table("ray_jobs")
    op.drop_table("ray_event_counts")
    op.drop_table("ray_bodies")
    op.drop_table("ray_actors")
