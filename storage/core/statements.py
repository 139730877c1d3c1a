"""The writer's SQL, built once per dialect with bind parameters.

Building SQLAlchemy statements per batch cost ~1 ms each (expression construction and
cache-key generation); a prebuilt statement's cache key is memoized, so executing it costs
little more than the driver call. Postgres and SQLite share every statement: both have
``INSERT ... ON CONFLICT`` and ``RETURNING``; ``least``/``greatest`` become SQLite's scalar
``min``/``max``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import msgspec
from sqlalchemy import Boolean, and_, bindparam, case, func, or_, select, update
from sqlalchemy.orm import Session

from storage.core import models as m

Expr = Any  # a SQLAlchemy column expression
Statement = Any  # an executable SQLAlchemy statement


@dataclass(frozen=True, slots=True)
class GetOrCreate:
    """Insert a row if its key is new (returning its id), else select the id."""

    insert: Statement
    select: Statement

    def id(self, db: Session, keys: dict[str, Any], values: dict[str, Any]) -> int:
        """The id of the row with ``keys``, inserted with ``values`` if new."""
        row_id = db.execute(self.insert, {**keys, **values}).scalar()
        if row_id is None:
            row_id = db.execute(self.select, keys).scalar_one()
        return row_id


@dataclass(frozen=True, slots=True)
class Statements:
    dialect: str
    tenant: GetOrCreate
    cluster: GetOrCreate
    session: GetOrCreate
    agent: GetOrCreate
    # the manifest row: plain, and through cached ids guarded by their names
    batch: Statement
    batch_guarded: Statement
    touch_cluster: Statement
    touch_session: Statement
    agent_update: Statement
    run_update: Statement
    run: Statement
    run_batch: Statement
    statuses: Statement
    prefixes: Statement
    actions: Statement
    worker: Statement
    session_info: Statement
    # rollups: appended per batch (no conflict possible: the batch id is in the key) ...
    hist_append: Statement
    day_append: Statement
    hour_append: Statement
    # ... and a per-run upsert (a run's workers are few and its batches arrive in order)
    run_workers: Statement
    finish_enqueue: Statement


def dialect_functions(
    dialect: str,
) -> tuple[Any, Callable[[Expr, Expr], Expr], Callable[[Expr, Expr], Expr]]:
    """``insert`` of the dialect, and NULL-tolerant ``least``/``greatest``."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        least, greatest = func.least, func.greatest
    else:
        from sqlalchemy.dialects.sqlite import insert

        least, greatest = func.min, func.max

    def lo(a: Expr, b: Expr) -> Expr:
        return least(func.coalesce(a, b), func.coalesce(b, a))

    def hi(a: Expr, b: Expr) -> Expr:
        return greatest(func.coalesce(a, b), func.coalesce(b, a))

    return insert, lo, hi


@functools.cache
def statements(dialect: str) -> Statements:
    """The writer's statements for ``dialect`` (built once per process)."""
    insert, lo, hi = dialect_functions(dialect)
    T, C, S, A, B = (x.__table__ for x in (m.Tenant, m.Cluster, m.Session, m.Agent, m.Batch))

    def get_or_create(table: Any, keys: tuple[str, ...]) -> GetOrCreate:
        ins = insert(table).on_conflict_do_nothing(index_elements=list(keys)).returning(table.c.id)
        sel = select(table.c.id).where(*(table.c[k] == bindparam(k) for k in keys))
        return GetOrCreate(ins, sel)

    batch_cols = ("agent_id", "seq", "blob_key", "events", "bytes", "received_at", "t_min", "t_max")
    agent_id = bindparam("agent_id", type_=B.c.agent_id.type)
    guard = (
        select(
            agent_id.label("agent_id"),
            *(bindparam(c, type_=B.c[c].type).label(c) for c in batch_cols[1:]),
        )
        .select_from(A.join(S, S.c.id == A.c.session_id).join(C, C.c.id == S.c.cluster_id))
        .where(
            A.c.id == agent_id,
            A.c.name == bindparam("p_agent"),
            S.c.id == bindparam("p_session_id"),
            S.c.name == bindparam("p_session"),
            C.c.id == bindparam("p_cluster_id"),
            C.c.name == bindparam("p_cluster"),
            C.c.tenant_id == bindparam("p_tenant_id"),
            # a sequence number in the collapsed span may be a duplicate: the slow path
            # looks (storage.core.manifest); the lock makes a collapse wait for this insert,
            # or this insert read the span a collapse left
            or_(
                A.c.collapsed_hi.is_(None),
                bindparam("seq", type_=B.c.seq.type) > A.c.collapsed_hi,
                bindparam("seq", type_=B.c.seq.type) < A.c.collapsed_lo,
            ),
        )
        .with_for_update(of=A, key_share=True)
    )

    def touch(t: Any) -> Statement:
        # Only take the row lock when last_seen is stale: concurrent batches of one cluster
        # then do not queue behind each other on the cluster and session rows.
        return (
            update(t)
            .where(t.c.id == bindparam("p_id"), t.c.last_seen < bindparam("p_stale"))
            .values(last_seen=bindparam("p_now"))
        )

    return Statements(
        dialect=dialect,
        tenant=get_or_create(T, ("name",)),
        cluster=get_or_create(C, ("tenant_id", "name")),
        session=get_or_create(S, ("cluster_id", "name")),
        agent=get_or_create(A, ("session_id", "name")),
        batch=insert(B)
        .on_conflict_do_nothing(index_elements=["agent_id", "seq"])
        .returning(B.c.id),
        batch_guarded=insert(B)
        .from_select(list(batch_cols), guard)
        .on_conflict_do_nothing(index_elements=["agent_id", "seq"])
        .returning(B.c.id),
        touch_cluster=touch(C),
        touch_session=touch(S),
        agent_update=_agent_update(A, hi),
        run_update=_run_update(lo, hi),
        run=_run_upsert(insert, lo, hi),
        run_batch=insert(m.RunBatch.__table__),
        statuses=_adding(insert, m.RunStatusCount.__table__, ["run_id", "status"], ("count",)),
        prefixes=_adding(
            insert, m.RunPrefix.__table__, ["run_id", "prefix"], ("count", "errors", "nbytes")
        ),
        actions=_actions_upsert(insert, lo, hi),
        worker=_worker_upsert(insert, lo, hi),
        session_info=update(S)
        .where(S.c.id == bindparam("p_id"), S.c.info.is_(None))
        .values(info=bindparam("p_info", type_=S.c.info.type)),
        hist_append=insert(m.RunPrefixHist.__table__),
        day_append=insert(m.PrefixDay.__table__),
        hour_append=insert(m.ClusterHour.__table__),
        run_workers=_run_workers_upsert(insert, lo, hi),
        finish_enqueue=_finish_enqueue(insert, hi),
    )


def _adding(insert: Any, table: Any, keys: list[str], columns: tuple[str, ...]) -> Statement:
    """Upsert that adds ``columns`` to an existing row."""
    ins = insert(table)
    return ins.on_conflict_do_update(
        index_elements=keys, set_={c: table.c[c] + ins.excluded[c] for c in columns}
    )


def _agent_update(A: Any, hi: Callable[[Expr, Expr], Expr]) -> Statement:
    seq = bindparam("p_seq", type_=A.c.max_seq.type)
    newer_drops = and_(bindparam("p_has_dropped", type_=Boolean), A.c.dropped_seq < seq)
    return (
        update(A)
        .where(A.c.id == bindparam("p_id"))
        .values(
            batches=A.c.batches + 1,
            events=A.c.events + bindparam("p_events", type_=A.c.events.type),
            max_seq=hi(A.c.max_seq, seq),
            final_seq=case((bindparam("p_final", type_=Boolean), seq), else_=A.c.final_seq),
            # Drop counters are cumulative: the highest sequence number's copy is the total.
            dropped=case(
                (newer_drops, bindparam("p_dropped", type_=A.c.dropped.type)), else_=A.c.dropped
            ),
            dropped_seq=case((newer_drops, seq), else_=A.c.dropped_seq),
        )
    )


def _run_merge(
    new: Callable[[str], Expr], lo: Callable[[Expr, Expr], Expr], hi: Callable[[Expr, Expr], Expr]
) -> dict[str, Expr]:
    """How a batch's figures for a run merge into its row (``new(column)``: the batch's)."""
    R = m.Run.__table__

    def rank(col: Expr) -> Expr:
        # a run closed "lost" (its scheduler went silent) takes the end its agent sends later
        return case({"running": 0, "lost": 1, "finished": 2}, value=col, else_=3)

    return {
        "name": func.coalesce(R.c.name, new("name")),
        "span": case((R.c.span.is_(None), new("span")), else_=R.c.span),
        "client": func.coalesce(R.c.client, new("client")),
        "status": case((rank(new("status")) > rank(R.c.status), new("status")), else_=R.c.status),
        "started_at": lo(R.c.started_at, new("started_at")),
        "finished_at": hi(R.c.finished_at, new("finished_at")),
        "task_start": lo(R.c.task_start, new("task_start")),
        "task_stop": hi(R.c.task_stop, new("task_stop")),
        "task_count": R.c.task_count + new("task_count"),
        "error_count": R.c.error_count + new("error_count"),
        "graph_count": R.c.graph_count + new("graph_count"),
        "nbytes": R.c.nbytes + new("nbytes"),
        "last_seen": hi(R.c.last_seen, new("last_seen")),
    }


def _run_update(lo: Callable[[Expr, Expr], Expr], hi: Callable[[Expr, Expr], Expr]) -> Statement:
    """A batch's figures merged into its run's row if the run exists. Tried before
    :func:`_run_upsert`: an upsert takes a run id from the sequence even when it updates, so
    run ids would grow with batches, not runs (and the partitions with them, decision 0038)."""
    R = m.Run.__table__

    def new(c: str) -> Expr:  # a column's own name is SQLAlchemy's for the SET clause
        return bindparam(f"p_{c}", type_=R.c[c].type)

    return (
        update(R)
        .where(R.c.session_id == new("session_id"), R.c.run_key == new("run_key"))
        .values(_run_merge(new, lo, hi))
        .returning(R.c.id, R.c.status)
    )


def _run_upsert(
    insert: Any, lo: Callable[[Expr, Expr], Expr], hi: Callable[[Expr, Expr], Expr]
) -> Statement:
    """A run's first batch: the row inserted, or merged into one a concurrent batch made."""
    R = m.Run.__table__
    ins = insert(R)
    return ins.on_conflict_do_update(
        index_elements=["session_id", "run_key"],
        set_=_run_merge(lambda c: ins.excluded[c], lo, hi),
    ).returning(R.c.id, R.c.status)


def _actions_upsert(
    insert: Any, lo: Callable[[Expr, Expr], Expr], hi: Callable[[Expr, Expr], Expr]
) -> Statement:
    PA = m.RunPrefixAction.__table__
    ins = insert(PA)
    return ins.on_conflict_do_update(
        index_elements=["run_id", "prefix", "action"],
        set_={
            "count": PA.c.count + ins.excluded.count,
            "total": PA.c.total + ins.excluded.total,
            "min": lo(PA.c.min, ins.excluded.min),
            "max": hi(PA.c.max, ins.excluded.max),
        },
    )


def _worker_upsert(
    insert: Any, lo: Callable[[Expr, Expr], Expr], hi: Callable[[Expr, Expr], Expr]
) -> Statement:
    W = m.Worker.__table__
    ins = insert(W)
    ex = ins.excluded
    return ins.on_conflict_do_update(
        index_elements=["session_id", "address"],
        set_={
            "name": func.coalesce(W.c.name, ex.name),
            "nthreads": func.coalesce(W.c.nthreads, ex.nthreads),
            "memory_limit": func.coalesce(W.c.memory_limit, ex.memory_limit),
            "joined_at": lo(W.c.joined_at, ex.joined_at),
            "left_at": hi(W.c.left_at, ex.left_at),
            "left_reason": func.coalesce(ex.left_reason, W.c.left_reason),
        },
    )


def _run_workers_upsert(
    insert: Any, lo: Callable[[Expr, Expr], Expr], hi: Callable[[Expr, Expr], Expr]
) -> Statement:
    RW = m.RunWorker.__table__
    ins = insert(RW)
    ex = ins.excluded
    sums = ("tasks", "errors", "compute", "transfer", "disk_read", "disk_write", "other")
    return ins.on_conflict_do_update(
        index_elements=["run_id", "worker"],
        set_={
            **{c: RW.c[c] + ex[c] for c in sums},
            "first_start": lo(RW.c.first_start, ex.first_start),
            "last_stop": hi(RW.c.last_stop, ex.last_stop),
        },
    )


def _finish_enqueue(insert: Any, hi: Callable[[Expr, Expr], Expr]) -> Statement:
    F = m.FinishJob.__table__
    ins = insert(F)
    return ins.on_conflict_do_update(
        index_elements=["run_id"], set_={"due_at": hi(F.c.due_at, ins.excluded.due_at)}
    )


@dataclass(frozen=True, slots=True)
class _Template:
    """A statement as psycopg2 SQL: ``head`` + one ``row`` per parameter set + ``tail``
    (an INSERT's VALUES list takes many rows; any other statement exactly one). An INSERT's
    row is also kept with positional placeholders (``row_at``) and the parameter each takes
    (``order``): all its rows are then rendered by one ``mogrify`` of a flat list."""

    head: str
    row: str
    tail: str
    defaults: dict[str, Any]
    many: bool
    row_at: str = ""
    order: tuple[str, ...] = ()


@functools.cache
def _template(name: str, keys: tuple[str, ...]) -> _Template:
    """The psycopg2 SQL of a statement given parameters ``keys`` (an INSERT names only the
    columns it is given, as SQLAlchemy does per execution)."""
    from psycopg2.extensions import adapt
    from sqlalchemy.dialects.postgresql import psycopg2

    stmt = getattr(statements("postgresql"), name)
    column_keys = list(keys) if stmt.is_insert else None
    compiled = stmt.compile(dialect=psycopg2.dialect(), column_keys=column_keys)
    sql = compiled.string
    # literals of the statement; not the Python-side column defaults SQLAlchemy would fill
    prefetch = {c.key for c in getattr(compiled, "insert_prefetch", ())}
    defaults = {k: v for k, v in compiled.params.items() if k not in keys and k not in prefetch}
    missing = set(re.findall(r"%\((\w+)\)s", sql)) - set(keys) - set(defaults)
    if missing:  # e.g. a column with a Python-side default, which SQLAlchemy would fill in
        raise ValueError(f"statement {name!r} needs {sorted(missing)}: the writer must pass them")
    if sql.startswith("INSERT") and " VALUES (" in sql:
        head, _, rest = sql.partition(" VALUES ")
        depth = 0
        for i, ch in enumerate(rest):  # the end of the VALUES row: its closing parenthesis
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                # literals outside the row (e.g. an upsert's CASE values) rendered once
                lits = {k: adapt(v).getquoted().decode() for k, v in defaults.items()}
                row = rest[: i + 1]
                order = tuple(re.findall(r"%\((\w+)\)s", row))
                return _Template(
                    (head + " VALUES ") % lits,
                    row,
                    rest[i + 1 :] % lits,
                    {},
                    True,
                    re.sub(r"%\((\w+)\)s", "%s", row),
                    order,
                )
    return _Template("", sql, "", defaults, False)


_json = msgspec.json.Encoder()
_JSON_TYPES = (dict, list)


def _adapt(row: dict[str, Any]) -> dict[str, Any]:
    # JSON columns are the only ones given dicts and lists (psycopg2 cannot adapt them)
    return {
        k: _json.encode(v).decode() if isinstance(v, _JSON_TYPES) else v for k, v in row.items()
    }


def _flat(rows: list[dict[str, Any]], order: tuple[str, ...]) -> list[Any]:
    """Every row's parameters in ``order``, one flat list, JSON values encoded."""
    flat = (
        list(chain.from_iterable(map(itemgetter(*order), rows)))
        if len(order) > 1
        else [r[order[0]] for r in rows]
    )
    for i, v in enumerate(flat):
        if isinstance(v, _JSON_TYPES):
            flat[i] = _json.encode(v).decode()
    return flat


class Pipeline:
    """The writer's statements whose results it does not read. On Postgres they are
    rendered by psycopg2 and sent together, in order, in one round trip at :meth:`flush`
    (SQLAlchemy's per-statement work and a round trip each were ~40% of the index step);
    elsewhere each is executed through SQLAlchemy as it is added. Execution still goes
    through SQLAlchemy, so a driver error is wrapped (a 503, not a 500) and a dead
    connection is dropped from the pool, as for any other statement."""

    _NO_PARAMS = {"no_parameters": True}  # the SQL is rendered: no %-formatting by the driver

    def __init__(self, db: Session, st: Statements) -> None:
        self.db = db
        self.st = st
        self.parts: list[str] = []
        self._mogrify: Any = None

    @property
    def raw(self) -> bool:
        return self.st.dialect == "postgresql"

    def _render(self, sql: str, params: dict[str, Any] | list[Any]) -> str:
        import psycopg2
        from sqlalchemy.exc import DBAPIError

        try:
            if self._mogrify is None:
                # psycopg2 renders client-side, in the connection's encoding
                self._mogrify = self.db.connection().connection.cursor().mogrify
            return self._mogrify(sql, params).decode()
        except psycopg2.Error as exc:  # wrapped as SQLAlchemy wraps it: a 503, not a 500
            raise DBAPIError.instance(sql, params, exc, psycopg2.Error) from exc

    def add(self, name: str, rows: dict[str, Any] | list[dict[str, Any]]) -> None:
        if not rows:
            return
        if not self.raw:
            self.db.execute(getattr(self.st, name), rows)
            return
        many = rows if isinstance(rows, list) else [rows]
        keys = many[0].keys()
        if any(r.keys() != keys for r in many):
            raise ValueError(f"rows of {name!r} must all have the same keys")
        t = _template(name, tuple(keys))
        if t.many and t.order:
            # all rows in one mogrify: a call and a dict per row were most of this step
            rows_sql = self._render(",".join([t.row_at] * len(many)), _flat(many, t.order))
            self.parts.append(t.head + rows_sql + t.tail)
            return
        rendered = [self._render(t.row, {**t.defaults, **_adapt(r)}) for r in many]
        if t.many:
            self.parts.append(t.head + ",".join(rendered) + t.tail)
        else:
            self.parts.extend(rendered)

    def _send(self) -> Any:
        sql = ";\n".join(self.parts)
        self.parts.clear()
        return self.db.connection().exec_driver_sql(sql, execution_options=self._NO_PARAMS)

    def one(self, name: str, row: dict[str, Any]) -> Any:
        """Execute one statement now (after what is pending) and return its first row."""
        if not self.raw:
            return self.db.execute(getattr(self.st, name), row).first()
        self.add(name, row)
        return self._send().first()

    def flush(self) -> None:
        if self.parts:
            self._send()
