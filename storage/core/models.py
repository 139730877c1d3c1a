"""The index: SQLAlchemy 2.0 models. Alembic (migrations/) owns the schema.

Everything here is derived from the blob store and can be rebuilt by ``hindsight reindex``.
Times are Unix epoch seconds (float), as on the wire.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
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
    # The span of sequence numbers moved into ``manifest_chunks`` (None: none): a batch in
    # it may be a duplicate though no ``batches`` row says so (storage.core.manifest).
    collapsed_lo: Mapped[int | None] = mapped_column(BigInteger)
    collapsed_hi: Mapped[int | None] = mapped_column(BigInteger)


class Batch(Base):
    """The manifest: one row per stored batch; its unique key makes ingest idempotent."""

    __tablename__ = "batches"
    __table_args__ = (UniqueConstraint("agent_id", "seq"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    # "": the key the names give (storage.core.batches.blob_key; migration 0019); read
    # through storage.runs.packed.keyed
    blob_key: Mapped[str] = mapped_column(String(1024))
    events: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Float)
    # The earliest and latest event time the batch holds (None: no timed event), so the
    # batches of a session around a run are chosen by what they describe, not by when they
    # arrived (a reindex receives everything again).
    t_min: Mapped[float | None] = mapped_column(Float)
    t_max: Mapped[float | None] = mapped_column(Float)


class ManifestChunk(Base):
    """An agent's older ``batches`` rows packed into one (``storage.core.manifest``): the
    batches' ids, sequence numbers, sizes and times, ~20 bytes a batch; the columns bound
    them so that readers decode only the chunks a window or an id range reaches."""

    __tablename__ = "manifest_chunks"
    agent_id: Mapped[int] = mapped_column(
        ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True
    )
    seq_lo: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    seq_hi: Mapped[int] = mapped_column(BigInteger)
    id_lo: Mapped[int] = mapped_column(BigInteger)
    id_hi: Mapped[int] = mapped_column(BigInteger)
    batches: Mapped[int] = mapped_column(Integer)
    events: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)
    received_lo: Mapped[float] = mapped_column(Float)
    received_hi: Mapped[float] = mapped_column(Float)
    t_min: Mapped[float | None] = mapped_column(Float)
    t_max: Mapped[float | None] = mapped_column(Float)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Run(Base):
    """What a user calls one job; for Dask, one top-level span or computation."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("session_id", "run_key"),
        Index("ix_runs_tenant_started", "tenant_id", "started_at", "id"),
        Index("ix_runs_cluster_started", "cluster_id", "started_at", "id"),
        # Runs by name: the name filter and "previous runs of the same job" (regressions).
        Index("ix_runs_tenant_name", "tenant_id", "name", "started_at"),
        # The runs still running only: the finish workers' look for silent ones
        # (storage.jobs.silent.close_silent) scanned every run once a minute (migration 0013).
        Index(
            "ix_runs_running",
            "session_id",
            postgresql_where=text("status = 'running'"),
            sqlite_where=text("status = 'running'"),
        ),
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
    # When the finishers (storage.jobs.finish) last completed for this run's data; None before.
    finished_work_at: Mapped[float | None] = mapped_column(Float)
    # The digest of the run's detail object (``storage.runs.detail``): its replay samples
    # and profile, moved out of the index when it finished. None: they are in the index.
    detail_digest: Mapped[str | None] = mapped_column(String(32))


class RunStatusCount(Base):
    __tablename__ = "run_status_counts"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    status: Mapped[str] = mapped_column(String(32), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class RunBatch(Base):
    """Which batches hold a run's events (to read its tasks from the blob store); once the
    run has finished, packed into its ``run_batch_lists`` row."""

    __tablename__ = "run_batches"
    # by batch: a collapse of the manifest asks whether a batch is a run's still
    __table_args__ = (Index("ix_run_batches_batch_id", "batch_id"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[int] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    tasks: Mapped[int] = mapped_column(Integer)


class RunBatchList(Base):
    """A finished run's ``run_batches`` rows packed into one (``storage.runs.packed``):
    the ids of the batches holding its records and its tasks in each. Readers merge it
    with any ``run_batches`` rows a late batch wrote since."""

    __tablename__ = "run_batch_lists"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class RunWorkerList(Base):
    """A finished run's ``run_workers`` rows packed into one (``storage.runs.packed``).
    Readers merge it with any ``run_workers`` rows a late batch wrote since."""

    __tablename__ = "run_worker_lists"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


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
    # The duration histogram once the run has finished, packed (``storage.runs.packed``);
    # while it runs, its histograms are ``run_prefix_hist`` rows. Readers add both.
    hist: Mapped[bytes | None] = mapped_column(LargeBinary)


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


class RunPrefixHist(Base):
    """Per-run per-prefix per-action duration histogram (log buckets, ``storage.analysis.sketch``):
    ``buckets`` maps a bucket number (as a string) to a count.

    Counts add, so histograms of several batches, runs or clusters merge by summing, and
    quantiles over any set of runs come from the index alone. Ingest appends a row per
    batch (``batch_id``) without reading or locking anything; readers sum the rows and the
    packed histogram; when the run has finished, ``storage.runs.packed`` sums them into
    ``run_prefix_actions.hist`` and deletes them (a row with ``batch_id`` 0 remains only
    for a histogram without its action row, or of an index not packed since).
    """

    __tablename__ = "run_prefix_hist"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    prefix: Mapped[str] = mapped_column(String(1024), primary_key=True)
    action: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, default=0)
    buckets: Mapped[dict[str, Any]] = mapped_column(JSON(none_as_null=True))


class RunWorker(Base):
    """Per-run per-worker seconds by action: the workers a run used and where their time went."""

    __tablename__ = "run_workers"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    worker: Mapped[str] = mapped_column(String(1024), primary_key=True)
    tasks: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    compute: Mapped[float] = mapped_column(Float)
    transfer: Mapped[float] = mapped_column(Float)
    disk_read: Mapped[float] = mapped_column(Float)
    disk_write: Mapped[float] = mapped_column(Float)
    other: Mapped[float] = mapped_column(Float)
    first_start: Mapped[float | None] = mapped_column(Float)
    last_stop: Mapped[float | None] = mapped_column(Float)


class PrefixDay(Base):
    """Duration histogram per cluster, prefix, action and day (of each phase's start): the
    rollup behind day-bucketed prefix histories, so a history over thousands of runs reads
    about one row per cluster and day. Appended per batch and folded like
    ``run_prefix_hist``."""

    __tablename__ = "prefix_days"
    __table_args__ = (Index("ix_prefix_days_prefix_day", "prefix", "action", "day"),)
    cluster_id: Mapped[int] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )
    prefix: Mapped[str] = mapped_column(String(1024), primary_key=True)
    action: Mapped[str] = mapped_column(String(64), primary_key=True)
    day: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    batch_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, default=0)
    count: Mapped[int] = mapped_column(BigInteger)
    total: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)
    # The histogram packed (storage.analysis.sketch.pack_hist; migration 0020): ~2 bytes a
    # bucket where its JSON ``buckets`` took ~10 (those of earlier rows; {} since)
    buckets: Mapped[dict[str, Any]] = mapped_column(JSON(none_as_null=True))
    hist: Mapped[bytes | None] = mapped_column(LargeBinary)


class ClusterHour(Base):
    """Per-cluster per-hour task totals (by the task's first start): tasks, errors, seconds.
    Appended per batch and folded like ``run_prefix_hist``."""

    __tablename__ = "cluster_hours"
    cluster_id: Mapped[int] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )
    hour: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    batch_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, default=0)
    tasks: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    compute: Mapped[float] = mapped_column(Float)
    transfer: Mapped[float] = mapped_column(Float)
    disk: Mapped[float] = mapped_column(Float)
    nbytes: Mapped[int] = mapped_column(BigInteger)


class LakePartition(Base):
    """One (tenant, cluster, day) partition of the history lake (``storage/lake/build.py``): the
    row writers lock to commit to it, and the ``seq`` of its newest manifest. Derived from
    the manifests in the blob store, like every other table from the batches."""

    __tablename__ = "lake_partitions"
    __table_args__ = (
        UniqueConstraint("cluster_id", "day"),
        Index("ix_lake_partitions_tenant_day", "tenant_id", "day"),
    )
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    day: Mapped[str] = mapped_column(String(10))  # UTC date, YYYY-MM-DD
    seq: Mapped[int] = mapped_column(BigInteger, default=0)
    # When the oldest superseded file of the partition may be deleted (None: none waits).
    vacuum_at: Mapped[float | None] = mapped_column(Float, index=True)


class LakeFile(Base):
    """A live file of a lake partition as its newest manifest lists it, with the
    statistics the query service prunes by."""

    __tablename__ = "lake_files"
    __table_args__ = (Index("ix_lake_files_partition_tbl", "partition_id", "tbl"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    partition_id: Mapped[int] = mapped_column(ForeignKey("lake_partitions.id", ondelete="CASCADE"))
    tbl: Mapped[str] = mapped_column(String(16))
    key: Mapped[str] = mapped_column(String(1024))
    rows: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)
    t_min: Mapped[float | None] = mapped_column(Float)
    t_max: Mapped[float | None] = mapped_column(Float)
    runs: Mapped[list[Any]] = mapped_column(JSON(none_as_null=True))
    stats: Mapped[dict[str, Any]] = mapped_column(JSON(none_as_null=True))


class LakeRun(Base):
    """Which lake partition holds a run, at which version of its data (``tag``)."""

    __tablename__ = "lake_runs"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    partition_id: Mapped[int] = mapped_column(
        ForeignKey("lake_partitions.id", ondelete="CASCADE"), index=True
    )
    tag: Mapped[str] = mapped_column(String(64))


class RunActivity(Base):
    """A run's fine performance metrics (Dask's ``Span.cumulative_worker_metrics``): the
    value of each (context, prefix, activity, unit) as of ``time``. Values are cumulative,
    so the latest sample wins (ties: the larger value), which commutes."""

    __tablename__ = "run_activity"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    context: Mapped[str] = mapped_column(String(64), primary_key=True)
    prefix: Mapped[str] = mapped_column(String(1024), primary_key=True)
    activity: Mapped[str] = mapped_column(String(64), primary_key=True)
    unit: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    time: Mapped[float] = mapped_column(Float)


class RunMetrics(Base):
    """A finished run's fine metrics (what its ``run_activity`` rows held) packed into one
    row (``storage.runs.packed``): read one run at a time, or summed across runs, so one
    row a run instead of one per (context, prefix, activity, unit). Readers merge it with
    any ``run_activity`` rows a late batch wrote since."""

    __tablename__ = "run_metrics"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class RunState(Base):
    """A replay sample of a run (a ``state`` event): its task states by prefix,
    ``{prefix: [waiting, processing, memory, released, erred]}``, and the cluster's
    workers, ``{address: [managed, unmanaged, spilled, limit, processing]}``, at ``time``.
    Replay at T reads the latest row at or before T (the primary key's order)."""

    __tablename__ = "run_states"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    time: Mapped[float] = mapped_column(Float, primary_key=True)
    prefixes: Mapped[dict[str, Any]] = mapped_column(JSON(none_as_null=True))
    workers: Mapped[dict[str, Any]] = mapped_column(JSON(none_as_null=True))


class RunCode(Base):
    """The code that submitted a computation of a run (client frames, innermost first)."""

    __tablename__ = "run_code"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    # sha256 of the frames as sent: the same submission stored once, in any order.
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    time: Mapped[float] = mapped_column(Float)
    frames: Mapped[list[Any]] = mapped_column(JSON(none_as_null=True))


class RunProfile(Base):
    """A run's statistical profile: one call tree per (prefix, worker), zstd-compressed
    (``storage.runs.profiles``). ``prefix`` or ``worker`` "" is the merge over all of them;
    the ("", "") row is always written, so its presence says the profile was built."""

    __tablename__ = "run_profiles"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    prefix: Mapped[str] = mapped_column(String(1024), primary_key=True)
    worker: Mapped[str] = mapped_column(String(1024), primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    nodes: Mapped[int] = mapped_column(Integer)
    interval: Mapped[float] = mapped_column(Float)
    # The version of the inputs the tree was built from (see storage.runs.profiles.inputs_tag).
    tag: Mapped[str] = mapped_column(String(64))
    data: Mapped[bytes] = mapped_column(LargeBinary)


# ---------------------------------------------------------------- Ray (issue 12)
# What Ray's event exporter tells about a session, merged from events that arrive in any
# order, more than once, from different nodes (``storage/ray/``). Every column merges
# commutatively (set while NULL, min, max, OR), so a retried or reordered body changes
# nothing; ``ray_tasks.emitted`` is the one transition that happens once: a task reaches
# the writer (as a derived batch of protocol records) exactly once.


class RayBody(Base):
    """The manifest of stored exporter bodies: one row per (session, content hash)."""

    __tablename__ = "ray_bodies"
    __table_args__ = (
        UniqueConstraint("session_id", "sha"),
        Index(
            "ix_ray_bodies_held",
            "received_at",
            postgresql_where=text("tasks_merged IS false"),
            sqlite_where=text("tasks_merged IS 0"),
        ),
    )
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    sha: Mapped[str] = mapped_column(String(64))
    blob_key: Mapped[str] = mapped_column(String(1024))
    events: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Float)
    # False while its task patches are held by the collector that took it (TaskHold in
    # storage/ray/hold.py); a sweeper merges a body left so by a dead process from its blob.
    tasks_merged: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class RayEventCount(Base):
    """Events received and skipped (not understood) per session and event type."""

    __tablename__ = "ray_event_counts"
    session_id: Mapped[int] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # received | skipped
    event_type: Mapped[str] = mapped_column(String(128), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class RayJob(Base):
    """A Ray job (one driver): a Hindsight run whose run key is the job id (hex)."""

    __tablename__ = "ray_jobs"
    session_id: Mapped[int] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    entrypoint: Mapped[str | None] = mapped_column(Text)
    driver_pid: Mapped[int | None] = mapped_column(BigInteger)
    driver_node: Mapped[str | None] = mapped_column(String(64))
    # Ray's times (the exporter's clocks) ...
    created_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    driver_exit_at: Mapped[float | None] = mapped_column(Float)
    # ... and the collector's: when the end was first seen, when anything last arrived.
    end_seen: Mapped[float | None] = mapped_column(Float)
    last_event_at: Mapped[float] = mapped_column(Float)
    closed_at: Mapped[float | None] = mapped_column(Float)
    closed_by: Mapped[str | None] = mapped_column(String(16))
    # The close that wrote the job's unended tasks FAILED, as Ray does at a driver's exit
    # (collector's clock; NULL: none did, e.g. closed when idle).
    unended_failed_at: Mapped[float | None] = mapped_column(Float)


_UNWRITTEN: dict[str, Any] = {
    "postgresql_where": text("emitted IS false"),
    "sqlite_where": text("emitted IS 0"),
}


class RayTask(Base):
    """One attempt of a Ray task, merged from its definition and lifecycle events."""

    __tablename__ = "ray_tasks"
    # Indexes over the tasks not yet written only (migration 0011); no foreign key: checking
    # the session row for every inserted task cost ~40% of the insert (retention deletes a
    # session's tasks itself).
    __table_args__ = (
        Index("ix_ray_tasks_job", "session_id", "job_id", **_UNWRITTEN),
        Index("ix_ray_tasks_pending", "end_seen", **_UNWRITTEN),
    )
    session_id: Mapped[int] = mapped_column(Id, primary_key=True)
    task_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(64))
    defined: Mapped[bool] = mapped_column(Boolean, default=False)
    name: Mapped[str | None] = mapped_column(String(1024))
    func: Mapped[str | None] = mapped_column(String(1024))
    module: Mapped[str | None] = mapped_column(String(1024))
    task_type: Mapped[str | None] = mapped_column(String(32))
    parent_id: Mapped[str | None] = mapped_column(String(64))
    actor_id: Mapped[str | None] = mapped_column(String(64))
    node_id: Mapped[str | None] = mapped_column(String(64))
    worker_id: Mapped[str | None] = mapped_column(String(64))
    pid: Mapped[int | None] = mapped_column(BigInteger)
    pending_at: Mapped[float | None] = mapped_column(Float)
    submitted_at: Mapped[float | None] = mapped_column(Float)
    running_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    failed_at: Mapped[float | None] = mapped_column(Float)
    error_type: Mapped[str | None] = mapped_column(String(128))
    error_message: Mapped[str | None] = mapped_column(Text)
    # Collector times: first seen, and when its end (FINISHED/FAILED) was first seen.
    first_seen: Mapped[float] = mapped_column(Float)
    end_seen: Mapped[float | None] = mapped_column(Float)
    # Taken for writing: set once, by the merge that completes the task (which queues it in
    # ``ray_ready`` in the same statement) or by the sweeper. ``emitted_before`` is what
    # ``emitted`` was before the last merge: the merge's RETURNING tells the task it just
    # completed from one already taken (Postgres 15 cannot return the old row).
    emitted: Mapped[bool] = mapped_column(Boolean, default=False)
    emitted_before: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class RayReady(Base):
    """Complete Ray tasks waiting to be written (the queue between a body's merge and the
    sweeper's derived batch). A row is inserted exactly once per task attempt, by the merge
    that completed it, and deleted by the transaction that writes it. No foreign key, as
    for ``ray_tasks`` (retention deletes a session's rows itself)."""

    __tablename__ = "ray_ready"
    session_id: Mapped[int] = mapped_column(Id, primary_key=True)
    task_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(64))


class RayNode(Base):
    __tablename__ = "ray_nodes"
    session_id: Mapped[int] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    ip: Mapped[str | None] = mapped_column(String(256))
    hostname: Mapped[str | None] = mapped_column(String(1024))
    name: Mapped[str | None] = mapped_column(String(1024))
    started_at: Mapped[float | None] = mapped_column(Float)
    alive_at: Mapped[float | None] = mapped_column(Float)
    dead_at: Mapped[float | None] = mapped_column(Float)
    death_reason: Mapped[str | None] = mapped_column(Text)
    resources: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class RayWorker(Base):
    """A Ray worker process (or driver): joins and leaves like a Dask worker."""

    __tablename__ = "ray_workers"
    session_id: Mapped[int] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    worker_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_id: Mapped[str | None] = mapped_column(String(64))
    pid: Mapped[int | None] = mapped_column(BigInteger)
    worker_type: Mapped[str | None] = mapped_column(String(32))
    job_id: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    exit_type: Mapped[str | None] = mapped_column(String(64))
    exit_detail: Mapped[str | None] = mapped_column(Text)


class RayActor(Base):
    __tablename__ = "ray_actors"
    session_id: Mapped[int] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    actor_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(64))
    class_name: Mapped[str | None] = mapped_column(String(1024))
    name: Mapped[str | None] = mapped_column(String(1024))
    node_id: Mapped[str | None] = mapped_column(String(64))
    worker_id: Mapped[str | None] = mapped_column(String(64))
    pid: Mapped[int | None] = mapped_column(BigInteger)
    alive_at: Mapped[float | None] = mapped_column(Float)
    dead_at: Mapped[float | None] = mapped_column(Float)


class ProfileFrame(Base):
    """A code location of the tenant's profiles, stored once: ``run_profiles`` trees refer
    to frames by id. ``digest`` is the sha1 of name, filename and first line (a function's
    identity); ``line_number`` and ``line`` are one sampled line, for display."""

    __tablename__ = "profile_frames"
    __table_args__ = (UniqueConstraint("tenant_id", "digest"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    digest: Mapped[str] = mapped_column(String(40))
    name: Mapped[str] = mapped_column(String(1024))
    filename: Mapped[str] = mapped_column(String(1024))
    first_line: Mapped[int] = mapped_column(BigInteger)
    line_number: Mapped[int] = mapped_column(BigInteger)
    line: Mapped[str] = mapped_column(String(1024))


class FinishJob(Base):
    """A run whose finished-run work (``storage.jobs.finish``) is due: queued when a batch
    leaves the run finished or erred, due once no batch has touched it for a while.

    A worker claims a job by setting ``claimed_until`` (a lease, so a crashed worker's job
    comes back), runs the finishers, and deletes the job only if ``due_at`` is unchanged:
    a batch that arrived meanwhile moved ``due_at`` and the run is finished again."""

    __tablename__ = "finish_jobs"
    __table_args__ = (Index("ix_finish_jobs_due_at", "due_at"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    due_at: Mapped[float] = mapped_column(Float)
    claimed_until: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)


class AlertRule(Base):
    """A tenant's alert rule: runs of a job (``job``: a run name, or a prefix of one ending
    in ``*``) and/or cluster that its explanation judges slower by at least ``min_change``
    (``on_slower``), or that have failures (``on_failures``), are posted to ``url``. Not
    derived from the blob store: a rebuilt index keeps none (as tokens)."""

    __tablename__ = "alert_rules"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(256))
    cluster: Mapped[str | None] = mapped_column(String(256))
    job: Mapped[str | None] = mapped_column(String(1024))
    on_slower: Mapped[bool] = mapped_column(Boolean, server_default=true())
    min_change: Mapped[float] = mapped_column(Float, server_default=text("0.2"))
    on_failures: Mapped[bool] = mapped_column(Boolean, server_default=false())
    url: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(16))  # "json" (signed) or "slack"
    # The HMAC-SHA256 key of the "json" format's signature. Kept as given (signing needs
    # it), shown once, when the rule is made.
    secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)


class AlertDelivery(Base):
    """One alert of one rule about one run, posted until the receiver takes it
    (at-least-once). ``idempotency_key`` is the same for every attempt: (rule, run). The
    run is named by its public id, so a rebuilt run is not alerted twice."""

    __tablename__ = "alert_deliveries"
    __table_args__ = (
        UniqueConstraint("rule_id", "run"),
        Index("ix_alert_deliveries_status_next_at", "status", "next_at"),
    )
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    rule_id: Mapped[int] = mapped_column(ForeignKey("alert_rules.id", ondelete="CASCADE"))
    run: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str] = mapped_column(String(128))
    reasons: Mapped[list[Any]] = mapped_column(JSON(none_as_null=True))
    body: Mapped[dict[str, Any]] = mapped_column(JSON(none_as_null=True))
    status: Mapped[str] = mapped_column(String(16))  # pending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_at: Mapped[float] = mapped_column(Float)
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float)
