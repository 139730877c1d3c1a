"""The index: SQLAlchemy 2.0 models. Alembic (migrations/) owns the schema.

Everything here is derived from the blob store and can be rebuilt by ``hindsight reindex``.
Times are Unix epoch seconds (float), as on the wire.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only autoincrements INTEGER PRIMARY KEY; Postgres gets a BIGINT identity.
Id = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    # none_as_null: Python None is SQL NULL (not JSON 'null'), so IS NULL tests work.
    type_annotation_map = {
        dict[str, Any]: JSON(none_as_null=True),
        list[Any]: JSON(none_as_null=True),
    }


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[float] = mapped_column(Float)


class Token(Base):
    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # sha256 of the token; the token itself is never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(128))
    name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class Cluster(Base):
    __tablename__ = "clusters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)


class Session(Base):
    """One scheduler lifetime of a cluster."""

    __tablename__ = "sessions"
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    info: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class Agent(Base):
    """One agent instance (scheduler or worker process) of a session: its sequence state."""

    __tablename__ = "agents"
    __table_args__ = (UniqueConstraint("session_id", "name"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    batches: Mapped[int] = mapped_column(BigInteger, default=0)
    events: Mapped[int] = mapped_column(BigInteger, default=0)
    max_seq: Mapped[int] = mapped_column(BigInteger, default=-1)
    final_seq: Mapped[int | None] = mapped_column(BigInteger)
    # Cumulative drop counters reported by the agent, as of batch ``dropped_seq``.
    dropped: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    dropped_seq: Mapped[int] = mapped_column(BigInteger, default=-1)


class Batch(Base):
    """The manifest: one row per stored batch; its unique key makes ingest idempotent."""

    __tablename__ = "batches"
    __table_args__ = (UniqueConstraint("agent_id", "seq"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    blob_key: Mapped[str] = mapped_column(String(1024))
    events: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Float)


class Run(Base):
    """What a user calls one job; for Dask, one top-level span or computation."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("session_id", "run_key"),
        Index("ix_runs_tenant_started", "tenant_id", "started_at", "id"),
        Index("ix_runs_cluster_started", "cluster_id", "started_at", "id"),
    )
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    # Deterministic public id: uuid5 of tenant/cluster/session/run key, so a rebuilt
    # index hands out the same ids.
    public_id: Mapped[str] = mapped_column(String(36), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    run_key: Mapped[str] = mapped_column(String(1024))
    name: Mapped[str | None] = mapped_column(String(1024))
    span: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    client: Mapped[str | None] = mapped_column(String(1024))
    status: Mapped[str] = mapped_column(String(16), default="running")
    # From run events (the scheduler's view) ...
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    # ... and from task startstops (makespan = task_stop - task_start).
    task_start: Mapped[float | None] = mapped_column(Float)
    task_stop: Mapped[float | None] = mapped_column(Float)
    task_count: Mapped[int] = mapped_column(BigInteger, default=0)
    error_count: Mapped[int] = mapped_column(BigInteger, default=0)
    graph_count: Mapped[int] = mapped_column(BigInteger, default=0)
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)


class RunStatusCount(Base):
    __tablename__ = "run_status_counts"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    status: Mapped[str] = mapped_column(String(32), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class RunBatch(Base):
    """Which batches hold a run's events (to read its tasks from the blob store)."""

    __tablename__ = "run_batches"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[int] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    tasks: Mapped[int] = mapped_column(Integer)


class RunPrefix(Base):
    """Per-run per-prefix rollup of task records."""

    __tablename__ = "run_prefixes"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    prefix: Mapped[str] = mapped_column(String(1024), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    nbytes: Mapped[int] = mapped_column(BigInteger)


class RunPrefixAction(Base):
    """Per-run per-prefix per-action durations (compute, transfer, disk-read, ...)."""

    __tablename__ = "run_prefix_actions"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    prefix: Mapped[str] = mapped_column(String(1024), primary_key=True)
    action: Mapped[str] = mapped_column(String(64), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    total: Mapped[float] = mapped_column(Float)
    min: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)


class Worker(Base):
    __tablename__ = "workers"
    __table_args__ = (UniqueConstraint("session_id", "address"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    address: Mapped[str] = mapped_column(String(1024))
    name: Mapped[str | None] = mapped_column(String(1024))
    nthreads: Mapped[int | None] = mapped_column(Integer)
    memory_limit: Mapped[int | None] = mapped_column(BigInteger)
    joined_at: Mapped[float | None] = mapped_column(Float)
    left_at: Mapped[float | None] = mapped_column(Float)
    left_reason: Mapped[str | None] = mapped_column(Text)
