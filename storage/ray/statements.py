"""The merge statements of Ray's tables, built once per dialect."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import (
    Boolean,
    Float,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    false,
    func,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from storage.core import models as m
from storage.core.statements import Expr, Statement, dialect_functions

logger = logging.getLogger(__name__)


encode_json = msgspec.json.Encoder().encode

# How a task patch merges into its row (the merge statements) and into a held patch
# (``storage.ray.hold``): set once, the earliest time, ``defined`` OR-ed.
TASK_FIRST = (
    "job_id",
    "name",
    "func",
    "module",
    "task_type",
    "parent_id",
    "actor_id",
    "node_id",
    "worker_id",
    "pid",
    "error_type",
    "error_message",
)
TASK_LOW = ("pending_at", "submitted_at", "running_at", "finished_at", "failed_at")


@dataclass(frozen=True, slots=True)
class RayStatements:
    """The merge statements of Ray's tables for one dialect."""

    dialect: str
    # the session's rows, created if new
    cluster: Statement
    cluster_id: Statement
    session: Statement
    session_id: Statement
    # the body's manifest row: plain, and through cached ids guarded by their names
    body: Statement
    body_guarded: Statement
    counts: Statement
    # the merges, one per table
    node: Statement
    worker: Statement
    actor: Statement
    job: Statement
    task: Statement
    ready: Statement
    # Postgres only (None on SQLite): a body's task patches merged in one statement that
    # queues the tasks it completes (``task_bulk``) or returns their rows (``task_taken``)
    task_bulk: Statement | None
    task_taken: Statement | None
    # SQLite's paths, on a list of (task, attempt) keys
    complete: tuple[Expr, ...]
    rows: Statement
    emit_complete: Statement
    emit_keys: Statement
    emit_all_complete: Statement


N, W, J, T, R = (x.__table__ for x in (m.RayNode, m.RayWorker, m.RayJob, m.RayTask, m.RayReady))
TASK_KEYS = ["session_id", "task_id", "attempt"]


def merged_values(
    dialect: str,
    t: Any,
    ex: Any,
    first: Iterable[str] = (),
    low: Iterable[str] = (),
    high: Iterable[str] = (),
    ored: Iterable[str] = (),
) -> dict[str, Expr]:
    """ON CONFLICT's SET of a commutative merge: ``first`` set while NULL, ``low`` the
    earliest, ``high`` the latest, ``ored`` OR-ed."""
    _, lo, hi = dialect_functions(dialect)
    sets: dict[str, Expr] = {}
    sets.update({c: func.coalesce(t.c[c], ex[c]) for c in first})
    sets.update({c: lo(t.c[c], ex[c]) for c in low})
    sets.update({c: hi(t.c[c], ex[c]) for c in high})
    sets.update({c: or_(t.c[c], ex[c]) for c in ored})
    return sets


def upsert(
    dialect: str, model: Any, keys: list[str], returning: Any = None, **merge: Iterable[str]
) -> Statement:
    """One row's insert, merged into the row of its ``keys`` (:func:`merged_values`)."""
    insert, _, _ = dialect_functions(dialect)
    t = model.__table__
    ins = insert(t)
    stmt = ins.on_conflict_do_update(
        index_elements=keys, set_=merged_values(dialect, t, ins.excluded, **merge)
    )
    return stmt.returning(*returning) if returning is not None else stmt


def complete_of(
    session: Expr,
    node: Expr,
    defined: Expr,
    running: Expr,
    finished: Expr,
    failed: Expr,
    node_known: Expr | None = None,
) -> Expr:
    """Complete: defined, RUNNING and ended, on a node whose IP is known (the worker
    label needs it; a node's definition may arrive after its tasks' events)."""
    if node_known is None:
        node_known = (
            select(N.c.node_id)
            .where(N.c.session_id == session, N.c.node_id == node, N.c.ip.is_not(None))
            .exists()
        )
    return and_(
        defined.is_(True),
        running.is_not(None),
        or_(finished.is_not(None), failed.is_not(None)),
        node_known,
    )


def _taken_new(rs: Any) -> Expr:
    """A new row complete (``rs``: the patches)."""
    return complete_of(
        bindparam("p_session", type_=T.c.session_id.type),
        rs.c.node_id,
        func.coalesce(rs.c.defined, false()),
        rs.c.running_at,
        rs.c.finished_at,
        rs.c.failed_at,
    )


def _taken_merged(ex: Any) -> Expr:
    """An existing row complete once merged with the patch (``ex``: ON CONFLICT's
    excluded)."""
    # Written out: SQLAlchemy does not correlate a subquery inside ON CONFLICT's SET.
    node_known = literal_column(
        "EXISTS (SELECT 1 FROM ray_nodes AS n WHERE n.session_id = ray_tasks.session_id"
        " AND n.node_id = coalesce(ray_tasks.node_id, excluded.node_id)"
        " AND n.ip IS NOT NULL)",
        Boolean(),
    )
    return complete_of(
        None,
        None,
        or_(T.c.defined, ex.defined),
        func.coalesce(T.c.running_at, ex.running_at),
        func.coalesce(T.c.finished_at, ex.finished_at),
        func.coalesce(T.c.failed_at, ex.failed_at),
        node_known,
    )


def _task_bulk_merge() -> Statement:
    """Postgres: a body's task patches merged in one statement, taking for writing each
    task the merge completes: ``emitted`` flips with the row's lock held, so exactly one
    merge sees it flip, and ``emitted_before`` tells which did. A task's row is written
    twice (definition, end), not three times, and nothing scans ray_tasks for complete
    tasks."""
    insert, _, _ = dialect_functions("postgresql")
    # The body's patches as one JSON array (msgspec encodes them as they are, unset fields
    # left out), read server-side by jsonb_to_recordset. A 666-row VALUES list (16,000
    # parameters) cost ~3x as much to send, parse and plan; one array per column ~15 ms of
    # psycopg2 adapting values, against ~1 ms to encode the JSON. jsonb without the NULLs:
    # 0.7 ms for Postgres to read 666 patches, against 2.4 ms as json with them
    # (json_to_recordset hashes every object).
    given = ("session_id", "first_seen", "end_seen", "emitted", "emitted_before")
    cols = [c for c in T.c if c.name not in given]
    rs = (
        func.jsonb_to_recordset(cast(bindparam("p_rows", type_=Text()), JSONB))
        .table_valued(*(column(c.name, c.type) for c in cols))
        .render_derived(name="x", with_types=True)
    )
    now = bindparam("p_now", type_=Float())
    ended = case((or_(rs.c.finished_at.is_not(None), rs.c.failed_at.is_not(None)), now))
    ins = insert(T).from_select(
        [*given, *(c.name for c in cols)],
        select(
            bindparam("p_session", type_=T.c.session_id.type),
            now,
            ended,
            _taken_new(rs),
            false(),
            *(
                func.coalesce(rs.c[c.name], false()) if c.name == "defined" else rs.c[c.name]
                for c in cols
            ),
        ),
    )
    ex = ins.excluded
    sets = merged_values(
        "postgresql",
        T,
        ex,
        first=TASK_FIRST,
        low=(*TASK_LOW, "first_seen", "end_seen"),
        ored=("defined",),
    )
    sets.update(emitted=or_(T.c.emitted, _taken_merged(ex)), emitted_before=T.c.emitted)
    return ins.on_conflict_do_update(index_elements=TASK_KEYS, set_=sets)


def _body_guarded(dialect: str) -> Statement:
    """The body's manifest row through the ids cached for the session's derived batches,
    guarded by their names (as ``storage.ingest.writer`` does): None when the ids are
    stale, or the body a duplicate."""
    insert, _, _ = dialect_functions(dialect)
    C, S, B = m.Cluster.__table__, m.Session.__table__, m.RayBody.__table__
    body_cols = ("session_id", "sha", "blob_key", "events", "bytes", "received_at", "tasks_merged")
    guard = select(*(bindparam(c, type_=B.c[c].type) for c in body_cols)).where(
        select(S.c.id)
        .join(C, C.c.id == S.c.cluster_id)
        .where(
            S.c.id == bindparam("session_id"),
            S.c.name == bindparam("p_session"),
            C.c.id == bindparam("p_cluster_id"),
            C.c.name == bindparam("p_cluster"),
            C.c.tenant_id == bindparam("p_tenant_id"),
        )
        .exists()
    )
    return (
        insert(B)
        .from_select(list(body_cols), guard)
        .on_conflict_do_nothing(index_elements=["session_id", "sha"])
        .returning(B.c.id)
    )


@functools.cache
def statements(dialect: str) -> RayStatements:
    """The merge statements for ``dialect``, built once per process (as
    ``storage.core.statements.statements``)."""
    insert, _, _ = dialect_functions(dialect)
    C, S, B = m.Cluster.__table__, m.Session.__table__, m.RayBody.__table__
    EC = m.RayEventCount.__table__
    counts = insert(EC)
    task_bulk = task_taken = None
    if dialect == "postgresql":
        up = _task_bulk_merge().returning(*T.c).cte("up")
        flipped = and_(up.c.emitted.is_(True), up.c.emitted_before.is_(False))
        task_bulk = (
            insert(R)
            .from_select(
                ["session_id", "task_id", "attempt", "job_id"],
                select(up.c.session_id, up.c.task_id, up.c.attempt, up.c.job_id).where(flipped),
            )
            .on_conflict_do_nothing(index_elements=TASK_KEYS)
        )
        # The same merge, returning the rows of the tasks it takes instead of queueing them:
        # for a caller that writes them in the same transaction (TaskHold.flush), so that a
        # task is never taken without being written, and the queue's insert and delete
        # (~17 us of Postgres a task under bench/ray_ingest.py) are spared.
        task_taken = select(*up.c).where(flipped)
    # Statements on a list of (task, attempt) keys serve SQLite's paths: Postgres merges and
    # queues in one statement (``task_bulk``), flips with SKIP LOCKED subqueries
    # (``emit_locked``) and drains the queue in one (``take_ready``).
    keys = tuple_(T.c.task_id, T.c.attempt).in_(bindparam("p_keys", expanding=True))
    session = T.c.session_id == bindparam("p_session")
    complete = (
        complete_of(
            T.c.session_id, T.c.node_id, T.c.defined, T.c.running_at, T.c.finished_at, T.c.failed_at
        ),
    )
    not_emitted = T.c.emitted.is_(False)
    return RayStatements(
        dialect=dialect,
        cluster=insert(C).on_conflict_do_nothing(index_elements=["tenant_id", "name"]),
        cluster_id=select(C.c.id).where(
            C.c.tenant_id == bindparam("tenant_id"), C.c.name == bindparam("name")
        ),
        session=insert(S).on_conflict_do_nothing(index_elements=["cluster_id", "name"]),
        session_id=select(S.c.id).where(
            S.c.cluster_id == bindparam("cluster_id"), S.c.name == bindparam("name")
        ),
        body=insert(B)
        .on_conflict_do_nothing(index_elements=["session_id", "sha"])
        .returning(B.c.id),
        body_guarded=_body_guarded(dialect),
        counts=counts.on_conflict_do_update(
            index_elements=["session_id", "kind", "event_type"],
            set_={"count": EC.c.count + counts.excluded.count},
        ),
        node=upsert(
            dialect,
            m.RayNode,
            ["session_id", "node_id"],
            first=("ip", "hostname", "name", "death_reason", "resources"),
            low=("started_at", "alive_at", "dead_at"),
            returning=(N.c.node_id, N.c.ip),
        ),
        worker=upsert(
            dialect,
            m.RayWorker,
            ["session_id", "worker_id"],
            first=("node_id", "pid", "worker_type", "job_id", "exit_type", "exit_detail"),
            low=("started_at", "ended_at"),
            returning=tuple(W.c),
        ),
        actor=upsert(
            dialect,
            m.RayActor,
            ["session_id", "actor_id"],
            first=("job_id", "class_name", "name", "node_id", "worker_id", "pid"),
            low=("alive_at", "dead_at"),
        ),
        job=upsert(
            dialect,
            m.RayJob,
            ["session_id", "job_id"],
            first=("entrypoint", "driver_pid", "driver_node"),
            low=("created_at", "finished_at", "driver_exit_at", "end_seen"),
            high=("last_event_at",),
            returning=tuple(J.c),
        ),
        task=upsert(
            dialect,
            m.RayTask,
            TASK_KEYS,
            first=TASK_FIRST,
            low=(*TASK_LOW, "first_seen", "end_seen"),
            ored=("defined",),
        ),
        ready=insert(R).on_conflict_do_nothing(index_elements=TASK_KEYS),
        task_bulk=task_bulk,
        task_taken=task_taken,
        complete=complete,
        rows=select(*T.c).where(session, keys),
        emit_complete=update(T)
        .where(session, keys, not_emitted, *complete)
        .values(emitted=True)
        .returning(*T.c),
        emit_keys=update(T).where(session, keys, not_emitted).values(emitted=True).returning(*T.c),
        emit_all_complete=update(T)
        .where(session, not_emitted, *complete)
        .values(emitted=True)
        .returning(*T.c),
    )


def statements_for(db: Session) -> RayStatements:
    """The merge statements for ``db``'s dialect."""
    return statements(db.get_bind().dialect.name)


def skip_locked_rows(q: Any, db: Session) -> Any:
    """Rows another transaction holds are left for it (Postgres); SQLite has one writer."""
    return q.with_for_update(skip_locked=True) if db.get_bind().dialect.name == "postgresql" else q


def ensure_session(
    db: Session, tenant_id: int, cluster: str, session: str, now: float
) -> tuple[int, int]:
    """(cluster id, session id), created if new."""
    st = statements_for(db)
    db.execute(
        st.cluster, {"tenant_id": tenant_id, "name": cluster, "first_seen": now, "last_seen": now}
    )
    cluster_id = db.execute(st.cluster_id, {"tenant_id": tenant_id, "name": cluster}).scalar_one()
    db.execute(
        st.session, {"cluster_id": cluster_id, "name": session, "first_seen": now, "last_seen": now}
    )
    session_id = db.execute(st.session_id, {"cluster_id": cluster_id, "name": session}).scalar_one()
    return cluster_id, session_id
