"""Derive the index from a batch. Used by the collector after the blob write, and by reindex.

Every update here commutes: counts add, times take min/max, a run's status only moves
forward. So applying the same set of batches in any order, once each (the manifest's
unique key sees to "once"), gives the same index. That is what lets a retried batch, a
crash between blob write and index update, and ``hindsight reindex`` all converge.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import zstandard
from sqlalchemy import Boolean, and_, bindparam, case, func, select, update
from sqlalchemy.orm import Session

from hindsight.schema import (
    ActivityEvent,
    Batch,
    CodeEvent,
    GraphEvent,
    RunEvent,
    SessionEvent,
    TaskEvent,
    WorkerEvent,
    decode_batch,
)
from storage import models as m
from storage import perf_index, sketch

logger = logging.getLogger(__name__)

DEFAULT_RUN = "default"
_RUN_NS = uuid.UUID("6f0e4a52-3c9e-4f5b-9a43-1d2f8b7c6e10")
_KEY_RE = re.compile(
    r"^v1/(?P<tenant>[^/]+)/(?P<cluster>[^/]+)/(?P<session>[^/]+)/(?P<agent>[^/]+)/(?P<seq>\d{12})\.json\.zst$"
)


def blob_key(tenant: str, batch: Batch) -> str:
    """Where a batch lives: listing a prefix finds a tenant's, cluster's or session's batches."""
    return f"v1/{tenant}/{batch.cluster}/{batch.session}/{batch.agent}/{batch.seq:012d}.json.zst"


def parse_blob_key(key: str) -> dict[str, Any] | None:
    """The identity encoded in a blob key, or None for a key that is not a batch."""
    match = _KEY_RE.match(key)
    if not match:
        return None
    parts: dict[str, Any] = match.groupdict()
    parts["seq"] = int(parts["seq"])
    return parts


def decode_stored(data: bytes) -> Batch:
    """A batch as the blob store holds it (zstd-compressed JSON, possibly several frames)."""
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    return decode_batch(reader.read())


def run_public_id(tenant: str, cluster: str, session: str, run_key: str) -> str:
    """The stable public id of a run (the same after a rebuild of the index)."""
    return str(uuid.uuid5(_RUN_NS, f"{tenant}/{cluster}/{session}/{run_key}"))


@dataclass
class RunSummary:
    tasks: int = 0
    errors: int = 0
    graph: int = 0
    nbytes: int = 0
    task_start: float | None = None
    task_stop: float | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    # prefix -> [count, errors, nbytes]
    prefixes: dict[str, list[int]] = field(default_factory=dict)
    # (prefix, action) -> [count, total, min, max]
    actions: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    events: list[RunEvent] = field(default_factory=list)


@dataclass
class BatchSummary:
    runs: dict[str, RunSummary] = field(default_factory=dict)
    workers: list[WorkerEvent] = field(default_factory=list)
    session: SessionEvent | None = None
    perf: list[ActivityEvent | CodeEvent] = field(default_factory=list)  # storage.perf_index


def summarize(batch: Batch) -> BatchSummary:
    """One pass over the events: everything the index needs, before touching the database.

    The collector's hottest loop after decoding: consecutive tasks nearly always share a
    run, successes skip the status table, and per-prefix action entries carry their own
    earliest start and latest stop, from which run totals are derived once at the end.
    """
    out = BatchSummary()
    runs = out.runs
    # run key -> {prefix: [count, errors, nbytes, {action: [n, total, min, max, first, last]}]}
    per_run: dict[str, dict[str, list[Any]]] = {}
    # run key -> {status: count} for statuses other than "memory"
    other_status: dict[str, dict[str, int]] = {}
    last_rk: str | None = None
    prefixes: dict[str, list[Any]] = {}
    for ev in batch.events:
        if type(ev) is TaskEvent:
            rk = ev.run or DEFAULT_RUN
            if rk != last_rk:
                last_rk = rk
                prefixes = per_run.get(rk)  # type: ignore[assignment]
                if prefixes is None:
                    prefixes = per_run[rk] = {}
            p = prefixes.get(ev.prefix)
            if p is None:
                p = prefixes[ev.prefix] = [0, 0, 0, {}]
            p[0] += 1
            status = ev.status
            if status != "memory":
                counts = other_status.setdefault(rk, {})
                counts[status] = counts.get(status, 0) + 1
                if status == "erred":
                    p[1] += 1
            if ev.nbytes:
                p[2] += ev.nbytes
            actions = p[3]
            for ss in ev.startstops:
                start = ss.start
                stop = ss.stop
                d = stop - start
                a = actions.get(ss.action)
                if a is None:
                    actions[ss.action] = [1, d, d, d, start, stop]
                else:
                    a[0] += 1
                    a[1] += d
                    if d < a[2]:
                        a[2] = d
                    elif d > a[3]:
                        a[3] = d
                    if start < a[4]:
                        a[4] = start
                    if stop > a[5]:
                        a[5] = stop
        elif type(ev) is GraphEvent:
            rs = runs.get(ev.run or DEFAULT_RUN)
            if rs is None:
                rs = runs[ev.run or DEFAULT_RUN] = RunSummary()
            rs.graph += 1
        elif type(ev) is RunEvent:
            rs = runs.get(ev.id)
            if rs is None:
                rs = runs[ev.id] = RunSummary()
            rs.events.append(ev)
        elif type(ev) is WorkerEvent:
            out.workers.append(ev)
        elif type(ev) is SessionEvent:
            out.session = ev
        elif type(ev) is ActivityEvent or type(ev) is CodeEvent:
            out.perf.append(ev)
            if ev.run not in runs:
                runs[ev.run] = RunSummary()

    for rk, prefixes in per_run.items():
        rs = runs.get(rk)
        if rs is None:
            rs = runs[rk] = RunSummary()
        for prefix, (count, errors, nbytes, actions) in prefixes.items():
            rs.tasks += count
            rs.errors += errors
            rs.nbytes += nbytes
            rs.prefixes[prefix] = [count, errors, nbytes]
            for action, (n, total, lo, hi, first, last) in actions.items():
                rs.actions[(prefix, action)] = [n, total, lo, hi]
                if rs.task_start is None or first < rs.task_start:
                    rs.task_start = first
                if rs.task_stop is None or last > rs.task_stop:
                    rs.task_stop = last
        others = other_status.get(rk, {})
        rs.statuses = dict(others)
        if rs.tasks > sum(others.values()):
            rs.statuses["memory"] = rs.tasks - sum(others.values())
    return out


@dataclass
class Rollups:
    """The query rollups of one batch (``storage.sketch`` histograms, per-worker and
    per-hour sums). Like the rest of the index, every figure adds or takes min/max."""

    # run key -> (prefix, action) -> {bucket: count}
    hists: dict[str, dict[tuple[str, str], dict[int, int]]] = field(default_factory=dict)
    # run key -> worker -> [tasks, errors, compute, transfer, disk-read, disk-write, other,
    #                       first start, last stop]
    workers: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    # hour -> [tasks, errors, compute, transfer, disk, nbytes]
    hours: dict[int, list[Any]] = field(default_factory=dict)
    # (prefix, action, day) -> [{bucket: count}, count, total, max]
    days: dict[tuple[str, str, int], list[Any]] = field(default_factory=dict)


# Times past 2**40 s (year 36812) or infinite cannot be real; they would overflow the hour
# columns. Such phases are left out of the rollups, not rejected.
_MAX_TIME = float(1 << 40)


def rollups(batch: Batch) -> Rollups:
    """One pass over a batch's task events for the query rollups.

    Hot (it runs on every batch the collector indexes): one dict entry per run, prefix,
    action and day takes each phase; histograms and day rollups are summed from those
    few entries at the end."""
    out = Rollups()
    log2 = math.log2
    floor = math.floor
    zero = sketch.ZERO
    sub = sketch.SUBDIV
    hours = out.hours
    days = out.days
    last_rk: str | None = None
    hists: dict[tuple[str, str], Any] = {}
    workers: dict[str, list[Any]] = {}
    for ev in batch.events:
        if type(ev) is not TaskEvent:
            continue
        rk = ev.run or DEFAULT_RUN
        if rk != last_rk:
            last_rk = rk
            got = out.hists.get(rk)
            if got is None:
                hists = out.hists[rk] = {}
                workers = out.workers[rk] = {}
            else:
                hists = got
                workers = out.workers[rk]
        erred = ev.status == "erred"
        w = None
        if ev.worker is not None:
            w = workers.get(ev.worker)
            if w is None:
                w = workers[ev.worker] = [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, None, None]
            w[0] += 1
            if erred:
                w[1] += 1
        if not ev.startstops:
            continue
        prefix = ev.prefix
        first = last = None
        comp = tr = dr = dw = other = 0.0
        for ss in ev.startstops:
            start = ss.start
            stop = ss.stop
            if not (start < _MAX_TIME and stop < _MAX_TIME):
                continue  # absurd or infinite times (still counted by summarize): no bucket
            d = stop - start
            action = ss.action
            b = floor(log2(d) * sub) if d > 0.0 else zero
            # One entry per (prefix, action, day) of this run; the run histogram and the
            # day rollup are both sums of these, taken once at the end.
            per_day = hists.get((prefix, action))
            if per_day is None:
                per_day = hists[(prefix, action)] = {}
            day = int(start // 86400)
            e = per_day.get(day)
            if e is None:
                per_day[day] = [{b: 1}, 1, d, d]
            else:
                eb = e[0]
                eb[b] = eb.get(b, 0) + 1
                e[1] += 1
                e[2] += d
                if d > e[3]:
                    e[3] = d
            if first is None or start < first:
                first = start
            if last is None or stop > last:
                last = stop
            if action == "compute":
                comp += d
            elif action == "transfer":
                tr += d
            elif action == "disk-read":
                dr += d
            elif action == "disk-write":
                dw += d
            else:
                other += d
        if first is None:
            continue
        if w is not None:
            w[2] += comp
            w[3] += tr
            w[4] += dr
            w[5] += dw
            w[6] += other
            if w[7] is None or first < w[7]:
                w[7] = first
            if w[8] is None or last > w[8]:
                w[8] = last
        hour = int(first // 3600)
        c = hours.get(hour)
        if c is None:
            c = hours[hour] = [0, 0, 0.0, 0.0, 0.0, 0]
        c[0] += 1
        if erred:
            c[1] += 1
        c[2] += comp
        c[3] += tr
        c[4] += dr + dw
        if ev.nbytes:
            c[5] += ev.nbytes
    for per_run in out.hists.values():
        for (prefix, action), per_day in per_run.items():
            hist: dict[int, int] = {}
            for day, (eb, n, total, hi) in per_day.items():
                for b, k in eb.items():
                    hist[b] = hist.get(b, 0) + k
                dk = (prefix, action, day)
                dd = days.get(dk)
                if dd is None:
                    days[dk] = [dict(eb), n, total, hi]
                else:
                    db_ = dd[0]
                    for b, k in eb.items():
                        db_[b] = db_.get(b, 0) + k
                    dd[1] += n
                    dd[2] += total
                    if hi > dd[3]:
                        dd[3] = hi
            per_run[(prefix, action)] = hist  # type: ignore[assignment]
    return out


@functools.cache
def _statements(dialect: str) -> SimpleNamespace:
    """The index's statements, built once per dialect with bind parameters.

    Building SQLAlchemy statements per batch cost ~1 ms each (expression construction and
    cache-key generation); a prebuilt statement's cache key is memoized, so executing it
    costs little more than the driver call.
    """
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

    T, C, S, A, B = (x.__table__ for x in (m.Tenant, m.Cluster, m.Session, m.Agent, m.Batch))
    R, RS, RB, P, PA, W = (
        x.__table__
        for x in (m.Run, m.RunStatusCount, m.RunBatch, m.RunPrefix, m.RunPrefixAction, m.Worker)
    )
    st = SimpleNamespace()

    def get_or_create(table: Any, keys: tuple[str, ...]) -> tuple[Any, Any]:
        ins = insert(table).on_conflict_do_nothing(index_elements=list(keys)).returning(table.c.id)
        sel = select(table.c.id).where(*(table.c[k] == bindparam(k) for k in keys))
        return ins, sel

    st.tenant = get_or_create(T, ("name",))
    st.cluster = get_or_create(C, ("tenant_id", "name"))
    st.session = get_or_create(S, ("cluster_id", "name"))
    st.agent = get_or_create(A, ("session_id", "name"))

    batch_cols = ("agent_id", "seq", "blob_key", "events", "bytes", "received_at")
    st.batch = (
        insert(B).on_conflict_do_nothing(index_elements=["agent_id", "seq"]).returning(B.c.id)
    )
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
        )
    )
    st.batch_guarded = (
        insert(B)
        .from_select(list(batch_cols), guard)
        .on_conflict_do_nothing(index_elements=["agent_id", "seq"])
        .returning(B.c.id)
    )

    # Only take the row lock when last_seen is stale: concurrent batches of one cluster
    # then do not queue behind each other on the cluster and session rows.
    st.touch = {
        t.name: update(t)
        .where(t.c.id == bindparam("p_id"), t.c.last_seen < bindparam("p_stale"))
        .values(last_seen=bindparam("p_now"))
        for t in (C, S)
    }

    seq = bindparam("p_seq", type_=A.c.max_seq.type)
    newer_drops = and_(bindparam("p_has_dropped", type_=Boolean), A.c.dropped_seq < seq)
    st.agent_update = (
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

    ins = insert(R)
    ex = ins.excluded
    rank = lambda col: case({"running": 0, "finished": 1}, value=col, else_=2)  # noqa: E731
    st.run = ins.on_conflict_do_update(
        index_elements=["session_id", "run_key"],
        set_={
            "name": func.coalesce(R.c.name, ex.name),
            "span": case((R.c.span.is_(None), ex.span), else_=R.c.span),
            "client": func.coalesce(R.c.client, ex.client),
            "status": case((rank(ex.status) > rank(R.c.status), ex.status), else_=R.c.status),
            "started_at": lo(R.c.started_at, ex.started_at),
            "finished_at": hi(R.c.finished_at, ex.finished_at),
            "task_start": lo(R.c.task_start, ex.task_start),
            "task_stop": hi(R.c.task_stop, ex.task_stop),
            "task_count": R.c.task_count + ex.task_count,
            "error_count": R.c.error_count + ex.error_count,
            "graph_count": R.c.graph_count + ex.graph_count,
            "nbytes": R.c.nbytes + ex.nbytes,
            "last_seen": hi(R.c.last_seen, ex.last_seen),
        },
    ).returning(R.c.id)
    st.run_batch = insert(RB)
    ins = insert(RS)
    st.statuses = ins.on_conflict_do_update(
        index_elements=["run_id", "status"], set_={"count": RS.c.count + ins.excluded.count}
    )
    ins = insert(P)
    st.prefixes = ins.on_conflict_do_update(
        index_elements=["run_id", "prefix"],
        set_={
            "count": P.c.count + ins.excluded.count,
            "errors": P.c.errors + ins.excluded.errors,
            "nbytes": P.c.nbytes + ins.excluded.nbytes,
        },
    )
    ins = insert(PA)
    st.actions = ins.on_conflict_do_update(
        index_elements=["run_id", "prefix", "action"],
        set_={
            "count": PA.c.count + ins.excluded.count,
            "total": PA.c.total + ins.excluded.total,
            "min": lo(PA.c.min, ins.excluded.min),
            "max": hi(PA.c.max, ins.excluded.max),
        },
    )
    ins = insert(W)
    ex = ins.excluded
    st.worker = ins.on_conflict_do_update(
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
    H, RW, CH = (x.__table__ for x in (m.RunPrefixHist, m.RunWorker, m.ClusterHour))
    ins = insert(H)
    # Histograms merge by read-modify-write: make sure the rows exist, lock them, add.
    st.hist_ensure = ins.on_conflict_do_nothing(index_elements=["run_id", "prefix", "action"])
    st.hist_lock = (
        select(H.c.prefix, H.c.action, H.c.buckets)
        .where(
            H.c.run_id == bindparam("p_run"),
            H.c.prefix.in_(bindparam("p_prefixes", expanding=True)),
        )
        .order_by(H.c.prefix, H.c.action)
        .with_for_update()
    )
    PD = m.PrefixDay.__table__
    st.day_ensure = insert(PD).on_conflict_do_nothing(
        index_elements=["cluster_id", "prefix", "action", "day"]
    )
    st.day_lock = (
        select(PD.c.prefix, PD.c.action, PD.c.day, PD.c.count, PD.c.total, PD.c.max, PD.c.buckets)
        .where(PD.c.cluster_id == bindparam("p_cluster"),
               PD.c.prefix.in_(bindparam("p_prefixes", expanding=True)),
               PD.c.day.in_(bindparam("p_days", expanding=True)))
        .order_by(PD.c.prefix, PD.c.action, PD.c.day)
        .with_for_update()
    )  # fmt: skip
    st.day_update = (
        update(PD)
        .where(PD.c.cluster_id == bindparam("b_cluster"), PD.c.prefix == bindparam("b_prefix"),
               PD.c.action == bindparam("b_action"), PD.c.day == bindparam("b_day"))
        .values(count=bindparam("b_count", type_=PD.c.count.type),
                total=bindparam("b_total", type_=PD.c.total.type),
                max=bindparam("b_max", type_=PD.c.max.type),
                buckets=bindparam("b_buckets", type_=PD.c.buckets.type))
    )  # fmt: skip
    st.hist_update = (
        update(H)
        .where(H.c.run_id == bindparam("b_run"), H.c.prefix == bindparam("b_prefix"),
               H.c.action == bindparam("b_action"))
        .values(buckets=bindparam("b_buckets", type_=H.c.buckets.type))
    )  # fmt: skip
    ins = insert(RW)
    ex = ins.excluded
    st.run_workers = ins.on_conflict_do_update(
        index_elements=["run_id", "worker"],
        set_={
            **{
                c: RW.c[c] + ex[c]
                for c in (
                    "tasks",
                    "errors",
                    "compute",
                    "transfer",
                    "disk_read",
                    "disk_write",
                    "other",
                )
            },
            "first_start": lo(RW.c.first_start, ex.first_start),
            "last_stop": hi(RW.c.last_stop, ex.last_stop),
        },
    )
    ins = insert(CH)
    st.cluster_hours = ins.on_conflict_do_update(
        index_elements=["cluster_id", "hour"],
        set_={
            c: CH.c[c] + ins.excluded[c]
            for c in ("tasks", "errors", "compute", "transfer", "disk", "nbytes")
        },
    )
    st.session_info = (
        update(S)
        .where(S.c.id == bindparam("p_id"), S.c.info.is_(None))
        .values(info=bindparam("p_info", type_=S.c.info.type))
    )
    return st


def _stmts(db: Session) -> SimpleNamespace:
    return _statements(db.get_bind().dialect.name)


def _get_or_create(
    db: Session, pair: tuple[Any, Any], keys: dict[str, Any], values: dict[str, Any]
) -> int:
    ins, sel = pair
    row_id = db.execute(ins, {**keys, **values}).scalar()
    if row_id is None:
        row_id = db.execute(sel, keys).scalar_one()
    return row_id


def ensure_tenant(db: Session, name: str, now: float) -> int:
    """The id of tenant ``name``, created if new."""
    return _get_or_create(db, _stmts(db).tenant, {"name": name}, {"created_at": now})


class IdCache:
    """Ids of the clusters, sessions and agents this process has indexed batches for.

    Saves the three look-ups a batch would otherwise cost. A cached id is only ever used
    through :func:`_insert_batch_guarded`, which checks in the same statement that the id
    still names this tenant/cluster/session/agent, so a pruned or rebuilt index can never
    be written through a stale id.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._ids: dict[tuple[int, str, str, str], tuple[int, int, int]] = {}
        self._touched: dict[tuple[str, int], float] = {}
        self._max = max_entries

    def get(self, key: tuple[int, str, str, str]) -> tuple[int, int, int] | None:
        return self._ids.get(key)

    def put(self, key: tuple[int, str, str, str], ids: tuple[int, int, int]) -> None:
        if len(self._ids) >= self._max:
            self._ids.clear()
            self._touched.clear()
        self._ids[key] = ids

    def forget(self, key: tuple[int, str, str, str]) -> None:
        self._ids.pop(key, None)

    def due(self, table: str, row_id: int, now: float, every: float = 10.0) -> bool:
        """Whether this process should refresh ``last_seen`` on the row (at most every 10 s)."""
        if now - self._touched.get((table, row_id), 0.0) < every:
            return False
        self._touched[(table, row_id)] = now
        return True


_STATUS_RANK = {"running": 0, "finished": 1, "erred": 2}


def index_batch(
    db: Session,
    *,
    tenant_id: int,
    tenant: str,
    batch: Batch,
    blob_key: str,
    size: int,
    now: float,
    summary: BatchSummary | None = None,
    cache: IdCache | None = None,
) -> bool:
    """Apply one stored batch to the index. Returns False (and changes nothing) if this
    batch identity was already indexed. The caller owns the transaction."""
    st = _stmts(db)
    row = {
        "seq": batch.seq,
        "blob_key": blob_key,
        "events": len(batch.events),
        "bytes": size,
        "received_at": now,
    }
    key = (tenant_id, batch.cluster, batch.session, batch.agent)
    ids = cache.get(key) if cache else None
    batch_id = None
    if ids is not None:
        # Through cached ids, guarded: the insert happens only if they still name this
        # tenant/cluster/session/agent, so a pruned or rebuilt index is never written
        # through a stale id. None means duplicate or stale: take the slow path.
        batch_id = db.execute(
            st.batch_guarded,
            {**row, "agent_id": ids[2], "p_agent": batch.agent, "p_session_id": ids[1],
             "p_session": batch.session, "p_cluster_id": ids[0], "p_cluster": batch.cluster,
             "p_tenant_id": tenant_id},
        ).scalar()  # fmt: skip
    if batch_id is None:
        cluster_id = _get_or_create(
            db,
            st.cluster,
            {"tenant_id": tenant_id, "name": batch.cluster},
            {"first_seen": now, "last_seen": now},
        )
        session_id = _get_or_create(
            db,
            st.session,
            {"cluster_id": cluster_id, "name": batch.session},
            {"first_seen": now, "last_seen": now},
        )
        agent_id = _get_or_create(
            db, st.agent, {"session_id": session_id, "name": batch.agent},
            {"batches": 0, "events": 0, "max_seq": -1, "dropped_seq": -1},
        )  # fmt: skip
        ids = (cluster_id, session_id, agent_id)
        if cache:
            cache.put(key, ids)
        batch_id = db.execute(st.batch, {**row, "agent_id": agent_id}).scalar()
        if batch_id is None:
            return False
    cluster_id, session_id, agent_id = ids

    for table, row_id in (("clusters", cluster_id), ("sessions", session_id)):
        if cache is None or cache.due(table, row_id, now):
            db.execute(st.touch[table], {"p_id": row_id, "p_stale": now - 10, "p_now": now})
    db.execute(
        st.agent_update,
        {"p_id": agent_id, "p_events": len(batch.events), "p_seq": batch.seq, "p_final": batch.final,
         "p_has_dropped": bool(batch.dropped), "p_dropped": dict(batch.dropped) if batch.dropped else None},
    )  # fmt: skip

    summary = summary or summarize(batch)
    extra = rollups(batch)
    run_ids: dict[str, int] = {}
    for run_key in sorted(summary.runs):
        run_ids[run_key] = _index_run(
            db,
            st,
            tenant,
            tenant_id,
            cluster_id,
            session_id,
            batch,
            batch_id,
            run_key,
            summary.runs[run_key],
            now,
        )
    workers = sorted(summary.workers, key=lambda w: (w.address, w.time))
    for ev in workers:
        joined = ev.event == "joined"
        db.execute(
            st.worker,
            {"session_id": session_id, "address": ev.address, "name": ev.name, "nthreads": ev.nthreads,
             "memory_limit": ev.memory_limit, "joined_at": ev.time if joined else None,
             "left_at": None if joined else ev.time, "left_reason": None if joined else ev.reason},
        )  # fmt: skip
    if summary.session is not None:
        info = {
            "time": summary.session.time,
            "address": summary.session.address,
            "versions": summary.session.versions,
            "config": summary.session.config,
        }
        db.execute(st.session_info, {"p_id": session_id, "p_info": info})
    if summary.perf:
        perf_index.index_perf(db, run_ids, summary.perf)
    # Last: the rollups lock rows that every batch of the run (histograms) or of the whole
    # cluster (day and hour rollups) updates, and hold them until commit. Taken at the end,
    # concurrent batches queue only for these few statements, not the whole transaction.
    _index_rollups(db, st, cluster_id, run_ids, extra)
    return True


def _index_run(
    db: Session,
    st: SimpleNamespace,
    tenant: str,
    tenant_id: int,
    cluster_id: int,
    session_id: int,
    batch: Batch,
    batch_id: int,
    run_key: str,
    rs: RunSummary,
    now: float,
) -> int:
    started = [e for e in rs.events if e.event == "started"]
    ended = [e for e in rs.events if e.event != "started"]
    first = min(started, key=lambda e: e.time) if started else None
    status = max((e.event for e in ended), key=_STATUS_RANK.__getitem__, default="running")
    run_id = db.execute(
        st.run,
        {
            "public_id": run_public_id(tenant, batch.cluster, batch.session, run_key),
            "tenant_id": tenant_id,
            "cluster_id": cluster_id,
            "session_id": session_id,
            "run_key": run_key,
            "name": first.name if first else None,
            "span": list(first.span) if first and first.span else None,
            "client": first.client if first else None,
            "status": status,
            # The earliest evidence of the run: its started event, else its first task, else now.
            "started_at": first.time
            if first
            else (rs.task_start if rs.task_start is not None else now),
            "finished_at": max((e.time for e in ended), default=None),
            "task_start": rs.task_start,
            "task_stop": rs.task_stop,
            "task_count": rs.tasks,
            "error_count": rs.errors,
            "graph_count": rs.graph,
            "nbytes": rs.nbytes,
            "first_seen": now,
            "last_seen": now,
        },
    ).scalar_one()
    if rs.tasks or rs.graph:
        db.execute(st.run_batch, {"run_id": run_id, "batch_id": batch_id, "tasks": rs.tasks})
    if rs.statuses:
        db.execute(
            st.statuses,
            [{"run_id": run_id, "status": s, "count": c} for s, c in sorted(rs.statuses.items())],
        )
    if rs.prefixes:
        db.execute(
            st.prefixes,
            [
                {"run_id": run_id, "prefix": p, "count": c, "errors": e, "nbytes": nb}
                for p, (c, e, nb) in sorted(rs.prefixes.items())
            ],
        )
    if rs.actions:
        db.execute(
            st.actions,
            [
                {
                    "run_id": run_id,
                    "prefix": p,
                    "action": a,
                    "count": c,
                    "total": t,
                    "min": lo,
                    "max": hi,
                }
                for (p, a), (c, t, lo, hi) in sorted(rs.actions.items())
            ],
        )
    return run_id


def _index_rollups(
    db: Session, st: SimpleNamespace, cluster_id: int, run_ids: dict[str, int], r: Rollups
) -> None:
    """Upsert the query rollups; rows in a fixed order so concurrent batches lock alike."""
    for rk in sorted(r.hists):
        run_id = run_ids[rk]
        hists = r.hists[rk]
        if not hists:
            continue
        keys = sorted(hists)
        db.execute(
            st.hist_ensure,
            [{"run_id": run_id, "prefix": p, "action": a, "buckets": {}} for p, a in keys],
        )
        stored = {
            (p, a): b
            for p, a, b in db.execute(
                st.hist_lock, {"p_run": run_id, "p_prefixes": sorted({p for p, _ in keys})}
            )
        }
        updates = []
        for p, a in keys:
            merged = dict(stored.get((p, a)) or {})
            for b, c in hists[(p, a)].items():
                k = str(b)
                merged[k] = merged.get(k, 0) + c
            updates.append({"b_run": run_id, "b_prefix": p, "b_action": a, "b_buckets": merged})
        db.execute(st.hist_update, updates)
    rows = [
        {"run_id": run_ids[rk], "worker": w, "tasks": v[0], "errors": v[1], "compute": v[2],
         "transfer": v[3], "disk_read": v[4], "disk_write": v[5], "other": v[6],
         "first_start": v[7], "last_stop": v[8]}
        for rk in sorted(r.workers) for w, v in sorted(r.workers[rk].items())
    ]  # fmt: skip
    if rows:
        db.execute(st.run_workers, rows)
    if r.hours:
        db.execute(
            st.cluster_hours,
            [
                {
                    "cluster_id": cluster_id,
                    "hour": h,
                    "tasks": v[0],
                    "errors": v[1],
                    "compute": v[2],
                    "transfer": v[3],
                    "disk": v[4],
                    "nbytes": v[5],
                }
                for h, v in sorted(r.hours.items())
            ],  # fmt: skip
        )
    if r.days:
        keys = sorted(r.days)
        db.execute(
            st.day_ensure,
            [{"cluster_id": cluster_id, "prefix": p, "action": a, "day": d, "count": 0,
              "total": 0.0, "max": 0.0, "buckets": {}} for p, a, d in keys],
        )  # fmt: skip
        stored = {
            (p, a, d): (c, t, mx, b)
            for p, a, d, c, t, mx, b in db.execute(
                st.day_lock,
                {"p_cluster": cluster_id, "p_prefixes": sorted({k[0] for k in keys}),
                 "p_days": sorted({k[2] for k in keys})},
            )
        }  # fmt: skip
        updates = []
        for key in keys:
            c0, t0, mx0, b0 = stored.get(key) or (0, 0.0, 0.0, {})
            hist, c, t, mx = r.days[key]
            merged = dict(b0 or {})
            for b, n in hist.items():
                merged[str(b)] = merged.get(str(b), 0) + n
            updates.append({"b_cluster": cluster_id, "b_prefix": key[0], "b_action": key[1],
                            "b_day": key[2], "b_count": c0 + c, "b_total": t0 + t,
                            "b_max": max(mx0, mx), "b_buckets": merged})  # fmt: skip
        db.execute(st.day_update, updates)
