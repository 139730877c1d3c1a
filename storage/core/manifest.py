"""The batch manifest, collapsed: an agent's ``batches`` rows older than
``HINDSIGHT_MANIFEST_COLLAPSE_SECONDS`` (and of no run still waiting to be packed) are
moved into one packed ``manifest_chunks`` row, ~20 bytes a batch instead of ~180
(decision 0037). Batch ids stay what they were, so the runs' packed batch lists still
name them.

Exactly-once stays one lookup: ``agents.collapsed_lo``/``collapsed_hi`` bound the
sequence numbers collapsed, and ingest's guarded insert, which locks the agent row
``FOR KEY SHARE``, takes a batch in that span to the slow path (:func:`contains`). A
collapse locks the agent ``FOR UPDATE SKIP LOCKED`` first: it leaves an agent with an
insert in flight to the next pass, and an insert waiting for it reads the new span.

Readers take both forms: :func:`collapsed` decodes the chunks a query selects.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import msgspec
import zstandard
from sqlalchemy import BigInteger, delete, exists, func, insert, literal, select, update
from sqlalchemy.orm import Session, sessionmaker

from storage.core import models as m
from storage.core.batches import key_of
from storage.core.statements import dialect_functions

#: At most this many batches a chunk: a collapse adds to the agent's last chunk until then.
CHUNK_BATCHES = 4096

#: A collapse takes an agent's rows only if their sequence numbers are this close to dense
#: (:func:`_dense`): span <= 2 x rows + this.
SPARSE_SLACK = 64

_encoder = msgspec.msgpack.Encoder()


class Entry(NamedTuple):
    """One batch of the manifest (a ``batches`` row's columns), with its blob key."""

    id: int
    agent_id: int
    seq: int
    key: str
    events: int
    bytes: int
    received_at: float
    t_min: float | None
    t_max: float | None


def _rel(t: float | None, t0: float) -> float | list[float] | None:
    """``t`` as its distance from ``t0``: exact, and ``t0`` plus it gives ``t`` back, for
    times within a factor of two of each other (Sterbenz); any other time as itself."""
    if t is None:
        return None
    d = t - t0
    return d if t0 + d == t else [t]


def _abs(v: float | list[float] | None, t0: float) -> float | None:
    if v is None:
        return None
    return v[0] if isinstance(v, list) else t0 + v


def pack(rows: list[Any]) -> dict[str, Any]:
    """A chunk's columns from manifest rows (``batches`` columns, ``blob_key`` "" where
    the names give the key): per batch, by sequence number, the steps of its id and seq
    from the previous one's, its events and bytes, its times as their distance from the
    chunk's earliest receive time (exact: read back, they are the row's), and its key."""
    rows = sorted(rows, key=lambda r: r.seq)
    t0 = min(r.received_at for r in rows)
    id_lo, seq_lo = min(r.id for r in rows), rows[0].seq
    flat: list[Any] = []
    prev_id, prev_seq = id_lo, seq_lo
    for r in rows:
        flat += (r.id - prev_id, r.seq - prev_seq, r.events, r.bytes)
        flat += (_rel(r.received_at, t0), _rel(r.t_min, t0), _rel(r.t_max, t0), r.blob_key)
        prev_id, prev_seq = r.id, r.seq
    timed = [r for r in rows if r.t_min is not None]
    return {
        "seq_lo": seq_lo,
        "seq_hi": rows[-1].seq,
        "id_lo": id_lo,
        "id_hi": max(r.id for r in rows),
        "batches": len(rows),
        "events": sum(r.events for r in rows),
        "bytes": sum(r.bytes for r in rows),
        "received_lo": t0,
        "received_hi": max(r.received_at for r in rows),
        "t_min": min((r.t_min for r in timed), default=None),
        "t_max": max((r.t_max for r in timed if r.t_max is not None), default=None),
        "data": zstandard.ZstdCompressor(level=3).compress(_encoder.encode(flat)),
    }


def unpack(chunk: Any, names: tuple[str, str, str, str] | None = None) -> list[Entry]:
    """The entries of a chunk row; ``names`` (tenant, cluster, session, agent) derive the
    blob keys the chunk does not store (without them: "")."""
    flat = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(bytes(chunk.data)))
    t0 = chunk.received_lo
    out = []
    b, seq = chunk.id_lo, chunk.seq_lo
    for i in range(0, len(flat), 8):
        db_, ds, events, size, recv, t_min, t_max, key = flat[i : i + 8]
        b, seq = b + db_, seq + ds
        if not key and names is not None:
            key = key_of(*names, seq)
        times = (_abs(recv, t0), _abs(t_min, t0), _abs(t_max, t0))
        out.append(Entry(b, chunk.agent_id, seq, key, events, size, *times))
    return out


def collapsed(db: Session, *where: Any) -> list[Entry]:
    """The entries of the chunks ``where`` selects (on ``ManifestChunk`` and ``Agent``),
    with their blob keys."""
    C, A, S, K, T = m.ManifestChunk, m.Agent, m.Session, m.Cluster, m.Tenant
    q = (
        select(C, T.name, K.name, S.name, A.name)
        .join(A, A.id == C.agent_id)
        .join(S, S.id == A.session_id)
        .join(K, K.id == S.cluster_id)
        .join(T, T.id == K.tenant_id)
        .where(*where)
    )
    return [e for chunk, *names in db.execute(q) for e in unpack(chunk, tuple(names))]


def contains(db: Session, agent_id: int, seq: int) -> bool:
    """Whether the agent's batch ``seq`` is in one of its chunks. A chunk's sequence numbers
    are kept by the process (a reindex, or a spool pushed late, asks of every batch of a
    chunk in turn): a chunk only ever changes by a collapse adding batches to it, which
    changes its ``batches``, and batch ids are never handed out twice, so a kept set named
    by the chunk's bounds and count is never stale."""
    C = m.ManifestChunk
    out = False
    database = str(db.get_bind().url)
    for seq_lo, n, id_lo, id_hi in db.execute(
        select(C.seq_lo, C.batches, C.id_lo, C.id_hi).where(
            C.agent_id == agent_id, C.seq_lo <= seq, C.seq_hi >= seq
        )
    ):
        name = (database, agent_id, seq_lo, n, id_lo, id_hi)
        seqs = _kept.get(name)
        if seqs is None:
            chunk = db.scalars(select(C).where(C.agent_id == agent_id, C.seq_lo == seq_lo)).one()
            seqs = frozenset(e.seq for e in unpack(chunk))
            with _kept_lock:  # threads of a collector process share it
                while _kept and len(_kept) >= KEPT_CHUNKS:
                    _kept.pop(next(iter(_kept)))
                _kept[name] = seqs
        out = out or seq in seqs
    return out


#: How many chunks' sequence numbers :func:`contains` keeps (~36 KB each at 4,096 batches).
KEPT_CHUNKS = 64
_kept: dict[tuple[str, int, int, int, int, int], frozenset[int]] = {}
_kept_lock = threading.Lock()


def _collapsible(db: Session, before: float) -> list[Any]:
    """Manifest rows received before ``before`` and of no run waiting to be packed."""
    B, RB = m.Batch, m.RunBatch
    where = [B.received_at < before, ~exists().where(RB.batch_id == B.id)]
    if db.get_bind().dialect.name == "sqlite":
        # SQLite hands out the highest id + 1 (the table has no AUTOINCREMENT): the newest
        # row stays, so that no id is handed out twice (rollups and runs' batch lists name
        # batches by id). A Postgres sequence never goes back.
        where.append(B.id < select(func.max(B.id)).scalar_subquery())
    return where


def collapse(db: Session, agent_id: int, before: float) -> int:
    """Move the agent's ``batches`` rows received before ``before`` and of no run waiting
    to be packed (no ``run_batches`` row) into its chunks; returns how many. The caller
    owns the transaction."""
    A, B, C = m.Agent, m.Batch, m.ManifestChunk
    # another process collapsing it, or an insert in flight (FOR KEY SHARE): the next pass
    locked = select(A.id).where(A.id == agent_id).with_for_update(skip_locked=True)
    if db.execute(locked).first() is None:
        return 0
    first, last_seq, n = db.execute(
        select(func.min(B.seq), func.max(B.seq), func.count()).where(
            B.agent_id == agent_id, *_collapsible(db, before)
        )
    ).one()
    if not n or not _dense(first, last_seq, n):
        return 0
    gone = db.execute(
        delete(B)
        .where(B.agent_id == agent_id, *_collapsible(db, before))
        .returning(B.id, B.seq, B.blob_key, B.events, B.bytes, B.received_at, B.t_min, B.t_max)
    ).all()
    if not gone:
        return 0
    rows: list[Any] = list(gone)
    last = db.scalars(
        select(C).where(C.agent_id == agent_id).order_by(C.seq_hi.desc()).limit(1)
    ).first()
    if last is not None and last.batches + len(rows) <= CHUNK_BATCHES:
        rows += [
            _Row(e.id, e.seq, e.key, e.events, e.bytes, e.received_at, e.t_min, e.t_max)
            for e in unpack(last)
        ]
        db.execute(delete(C).where(C.agent_id == agent_id, C.seq_lo == last.seq_lo))
    chunk = pack(rows)
    db.execute(insert(C).values(agent_id=agent_id, **chunk))
    _, lo, hi = dialect_functions(db.get_bind().dialect.name)
    seq_lo = literal(chunk["seq_lo"], BigInteger)
    seq_hi = literal(chunk["seq_hi"], BigInteger)
    db.execute(
        update(A)
        .where(A.id == agent_id)
        .values(collapsed_lo=lo(A.collapsed_lo, seq_lo), collapsed_hi=hi(A.collapsed_hi, seq_hi))
    )
    return len(gone)


class _Row(NamedTuple):
    id: int
    seq: int
    blob_key: str
    events: int
    bytes: int
    received_at: float
    t_min: float | None
    t_max: float | None


def collapse_due(
    sessions: sessionmaker[Session], *, age: float, now: float | None = None, limit: int = 200
) -> int:
    """Collapse the manifest rows received more than ``age`` seconds before ``now`` of up
    to ``limit`` agents, an agent a transaction; returns how many rows went (0: none are
    due)."""
    now = time.time() if now is None else now
    B = m.Batch
    with sessions() as db:
        agents = db.scalars(
            select(B.agent_id)
            .where(*_collapsible(db, now - age))
            .group_by(B.agent_id)
            .having(_dense(func.min(B.seq), func.max(B.seq), func.count()))
            .limit(limit)
        ).all()
    done = 0
    for agent_id in agents:
        with sessions.begin() as db:
            done += collapse(db, agent_id, now - age)
    return done


def _dense(lo: Any, hi: Any, n: Any) -> Any:
    """Sequence numbers ``lo``..``hi`` of ``n`` rows close enough to an agent's 0, 1, 2 ...
    Ray's derived batches are numbered by a hash of their body: a span over such numbers
    would send every later batch of the agent to the slow path."""
    return hi - lo + 1 <= 2 * n + SPARSE_SLACK


def agent_times(db: Session, *where: Any) -> dict[str, tuple[float | None, float | None]]:
    """The earliest and latest event time of the batches of each agent ``where`` selects
    (on ``Agent``), by agent name: manifest rows and chunks alike."""
    A = m.Agent
    out: dict[str, tuple[float | None, float | None]] = {}
    for table in (m.Batch, m.ManifestChunk):
        q = (
            select(A.name, func.min(table.t_min), func.max(table.t_max))
            .join(table, table.agent_id == A.id)
            .where(*where)
            .group_by(A.name)
        )
        for name, first, last in db.execute(q):
            f0, l0 = out.get(name, (None, None))
            out[name] = (_least(f0, first), _most(l0, last))
    return out


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
