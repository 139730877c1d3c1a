"""The merge statements of Ray's tables, built once per dialect."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from types import SimpleNamespace
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

logger = logging.getLogger(__name__)


encode_json = msgspec.json.Encoder().encode

# How a task patch merges into its row (the merge statements) and into a held patch
# (``_fold``): set once, the earliest time, ``defined`` OR-ed.
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


@functools.cache
def _statements(dialect: str) -> SimpleNamespace:
    """The merge statements, built once per dialect (see ``storage.ingest.writer._statements``)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        def lo(a: Any, b: Any) -> Any:
            return func.least(func.coalesce(a, b), func.coalesce(b, a))

        def hi(a: Any, b: Any) -> Any:
            return func.greatest(func.coalesce(a, b), func.coalesce(b, a))
    else:
        from sqlalchemy.dialects.sqlite import insert

        def lo(a: Any, b: Any) -> Any:
            return func.min(func.coalesce(a, b), func.coalesce(b, a))

        def hi(a: Any, b: Any) -> Any:
            return func.max(func.coalesce(a, b), func.coalesce(b, a))

    st = SimpleNamespace(dialect=dialect, insert=insert)

    def upsert(
        model: Any,
        keys: list[str],
        first: Iterable[str] = (),
        low: Iterable[str] = (),
        high: Iterable[str] = (),
        ored: Iterable[str] = (),
        returning: Any = None,
        bulk: bool = False,
        taken: Any = None,
    ) -> Any:
        t = model.__table__
        ins = insert(t)
        if bulk:
            # Postgres: the body's patches as one JSON array (msgspec encodes them as they
            # are, unset fields left out), read server-side by jsonb_to_recordset. A 666-row
            # VALUES list (16,000 parameters) cost ~3x as much to send, parse and plan; one
            # array per column ~15 ms of psycopg2 adapting values, against ~1 ms to encode
            # the JSON. jsonb without the NULLs: 0.7 ms for Postgres to read 666 patches,
            # against 2.4 ms as json with them (json_to_recordset hashes every object).
            given = ("session_id", "first_seen", "end_seen", "emitted", "emitted_before")
            cols = [c for c in t.c if c.name not in given]
            rs = (
                func.jsonb_to_recordset(cast(bindparam("p_rows", type_=Text()), JSONB))
                .table_valued(*(column(c.name, c.type) for c in cols))
                .render_derived(name="x", with_types=True)
            )
            now = bindparam("p_now", type_=Float())
            ended = case((or_(rs.c.finished_at.is_not(None), rs.c.failed_at.is_not(None)), now))
            ins = ins.from_select(
                [*given, *(c.name for c in cols)],
                select(
                    bindparam("p_session", type_=t.c.session_id.type),
                    now,
                    ended,
                    taken(rs) if taken is not None else false(),
                    false(),
                    *(
                        func.coalesce(rs.c[c.name], false())
                        if c.name == "defined"
                        else rs.c[c.name]
                        for c in cols
                    ),
                ),
            )
        ex = ins.excluded
        sets: dict[str, Any] = {}
        sets.update({c: func.coalesce(t.c[c], ex[c]) for c in first})
        sets.update({c: lo(t.c[c], ex[c]) for c in low})
        sets.update({c: hi(t.c[c], ex[c]) for c in high})
        sets.update({c: or_(t.c[c], ex[c]) for c in ored})
        if taken is not None:
            sets.update(emitted=or_(t.c.emitted, taken(None)), emitted_before=t.c.emitted)
        stmt = ins.on_conflict_do_update(index_elements=keys, set_=sets)
        return stmt.returning(*returning) if returning is not None else stmt

    N, W, A, J, T = (x.__table__ for x in (m.RayNode, m.RayWorker, m.RayActor, m.RayJob, m.RayTask))
    R = m.RayReady.__table__

    def complete_of(
        session: Any,
        node: Any,
        defined: Any,
        running: Any,
        finished: Any,
        failed: Any,
        node_known: Any = None,
    ) -> Any:
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

    C, S, B = m.Cluster.__table__, m.Session.__table__, m.RayBody.__table__
    st.cluster = insert(C).on_conflict_do_nothing(index_elements=["tenant_id", "name"])
    st.cluster_id = select(C.c.id).where(
        C.c.tenant_id == bindparam("tenant_id"), C.c.name == bindparam("name")
    )
    st.session = insert(S).on_conflict_do_nothing(index_elements=["cluster_id", "name"])
    st.session_id = select(S.c.id).where(
        S.c.cluster_id == bindparam("cluster_id"), S.c.name == bindparam("name")
    )
    st.body = (
        insert(B).on_conflict_do_nothing(index_elements=["session_id", "sha"]).returning(B.c.id)
    )
    # Through the ids cached for the session's derived batches, guarded by their names (as
    # ``storage.ingest.writer`` does): None when the ids are stale, or the body a duplicate.
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
    st.body_guarded = (
        insert(B)
        .from_select(list(body_cols), guard)
        .on_conflict_do_nothing(index_elements=["session_id", "sha"])
        .returning(B.c.id)
    )
    EC = m.RayEventCount.__table__
    ins = insert(EC)
    st.counts = ins.on_conflict_do_update(
        index_elements=["session_id", "kind", "event_type"],
        set_={"count": EC.c.count + ins.excluded.count},
    )
    st.node = upsert(
        m.RayNode,
        ["session_id", "node_id"],
        first=("ip", "hostname", "name", "death_reason", "resources"),
        low=("started_at", "alive_at", "dead_at"),
        returning=(N.c.node_id, N.c.ip),
    )
    st.worker = upsert(
        m.RayWorker,
        ["session_id", "worker_id"],
        first=("node_id", "pid", "worker_type", "job_id", "exit_type", "exit_detail"),
        low=("started_at", "ended_at"),
        returning=tuple(W.c),
    )
    st.actor = upsert(
        m.RayActor,
        ["session_id", "actor_id"],
        first=("job_id", "class_name", "name", "node_id", "worker_id", "pid"),
        low=("alive_at", "dead_at"),
    )
    st.job = upsert(
        m.RayJob,
        ["session_id", "job_id"],
        first=("entrypoint", "driver_pid", "driver_node"),
        low=("created_at", "finished_at", "driver_exit_at", "end_seen"),
        high=("last_event_at",),
        returning=tuple(J.c),
    )
    st.task = upsert(
        m.RayTask,
        ["session_id", "task_id", "attempt"],
        first=TASK_FIRST,
        low=(*TASK_LOW, "first_seen", "end_seen"),
        ored=("defined",),
    )
    st.ready = insert(R).on_conflict_do_nothing(index_elements=["session_id", "task_id", "attempt"])
    st.task_bulk = st.task_taken = None
    if dialect == "postgresql":
        # The merge takes a task it completes for writing in the same statement: ``emitted``
        # flips (with the row's lock held, so exactly one merge sees it flip) and the task
        # is queued in ray_ready. Its row is written twice (definition, end), not three
        # times, and nothing scans ray_tasks for complete tasks.
        def taken(rs: Any) -> Any:
            """Complete after the merge: of a new row (``rs``, the patches) or of the
            existing row merged with the patch (``rs`` None: ON CONFLICT's SET)."""
            if rs is not None:
                return complete_of(
                    bindparam("p_session", type_=T.c.session_id.type),
                    rs.c.node_id,
                    func.coalesce(rs.c.defined, false()),
                    rs.c.running_at,
                    rs.c.finished_at,
                    rs.c.failed_at,
                )
            ex = insert(T).excluded
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

        merged = upsert(
            m.RayTask,
            ["session_id", "task_id", "attempt"],
            first=TASK_FIRST,
            low=(*TASK_LOW, "first_seen", "end_seen"),
            ored=("defined",),
            bulk=True,
            taken=taken,
        )
        up = merged.returning(*T.c).cte("up")
        flipped = and_(up.c.emitted.is_(True), up.c.emitted_before.is_(False))
        st.task_bulk = (
            insert(R)
            .from_select(
                ["session_id", "task_id", "attempt", "job_id"],
                select(up.c.session_id, up.c.task_id, up.c.attempt, up.c.job_id).where(flipped),
            )
            .on_conflict_do_nothing(index_elements=["session_id", "task_id", "attempt"])
        )
        # The same merge, returning the rows of the tasks it takes instead of queueing them:
        # for a caller that writes them in the same transaction (TaskHold.flush), so that a
        # task is never taken without being written, and the queue's insert and delete
        # (~17 us of Postgres a task under bench/ray_ingest.py) are spared.
        st.task_taken = select(*up.c).where(flipped)
    # Statements on a list of (task, attempt) keys serve SQLite's paths: Postgres merges and
    # queues in one statement (``task_bulk``), flips with SKIP LOCKED subqueries
    # (``emit_locked``) and drains the queue in one (``take_ready``).
    keys = tuple_(T.c.task_id, T.c.attempt).in_(bindparam("p_keys", expanding=True))
    complete = (
        complete_of(
            T.c.session_id, T.c.node_id, T.c.defined, T.c.running_at, T.c.finished_at, T.c.failed_at
        ),
    )
    st.complete = complete
    st.rows = select(*T.c).where(T.c.session_id == bindparam("p_session"), keys)
    st.emit_complete = (
        update(T)
        .where(T.c.session_id == bindparam("p_session"), keys, T.c.emitted.is_(False), *complete)
        .values(emitted=True)
        .returning(*T.c)
    )
    st.emit_keys = (
        update(T)
        .where(T.c.session_id == bindparam("p_session"), keys, T.c.emitted.is_(False))
        .values(emitted=True)
        .returning(*T.c)
    )
    st.emit_all_complete = (
        update(T)
        .where(T.c.session_id == bindparam("p_session"), T.c.emitted.is_(False), *complete)
        .values(emitted=True)
        .returning(*T.c)
    )
    return st


def statements_for(db: Session) -> SimpleNamespace:
    return _statements(db.get_bind().dialect.name)


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
