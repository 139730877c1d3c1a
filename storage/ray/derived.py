"""Derived batches: Ray's records written as protocol batches and indexed by the ordinary writer."""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zstandard
from sqlalchemy import (
    select,
)
from sqlalchemy.orm import Session

from hindsight.schema import (
    Batch,
    RunEvent,
    SchemaError,
    SessionEvent,
    TaskEvent,
    WorkerEvent,
    decode_batch,
    encode_batch,
)
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.idcache import IdCache
from storage.ingest.writer import index_batch
from storage.ray.bodies import AGENT, STORE_LEVEL, derived_key, in_chunks
from storage.ray.translate import session_started, task_event

logger = logging.getLogger(__name__)


class Lookups:
    """Node IPs and worker pids of a session, for worker labels (cached per process: a
    node's IP and a worker's pid never change)."""

    _cache: dict[tuple[str, int, str], Any] = {}

    @classmethod
    def _get(
        cls, db: Session, session_id: int, ids: Iterable[str | None], key: Any, value: Any
    ) -> dict[str, Any]:
        table = key.class_.__tablename__
        want = {i for i in ids if i}
        out = {
            i: cls._cache[(table, session_id, i)]
            for i in want
            if (table, session_id, i) in cls._cache
        }
        missing = want - set(out)
        if missing:
            rows = db.execute(
                select(key, value).where(
                    key.class_.session_id == session_id, key.in_(missing), value.is_not(None)
                )
            )
            for i, v in rows:
                out[i] = v
                if len(cls._cache) > 200_000:
                    cls._cache.clear()
                cls._cache[(table, session_id, i)] = v
        return out

    @classmethod
    def ips(cls, db: Session, session_id: int, nodes: Iterable[str | None]) -> dict[str, str]:
        return cls._get(db, session_id, nodes, m.RayNode.node_id, m.RayNode.ip)

    @classmethod
    def pids(cls, db: Session, session_id: int, workers: Iterable[str | None]) -> dict[str, int]:
        return cls._get(db, session_id, workers, m.RayWorker.worker_id, m.RayWorker.pid)


@functools.lru_cache(maxsize=8)
def row_type(fields: tuple[str, ...]) -> Any:
    return collections.namedtuple("RayTaskRow", fields)


def tasks_as_events(db: Session, session_id: int, rows: list[Any]) -> list[TaskEvent]:
    if rows and hasattr(rows[0], "_fields"):
        # Plain tuples: a Row's attribute costs ~5x a namedtuple's, and task_event reads ~30.
        make = row_type(tuple(rows[0]._fields))._make
        rows = [make(r) for r in rows]
    undefined = [r.task_id for r in rows if not r.defined]
    if undefined:
        rows = _borrow_definitions(db, session_id, rows, undefined)
    pids = Lookups.pids(db, session_id, (r.worker_id for r in rows if not r.pid))
    ips = Lookups.ips(db, session_id, (r.node_id for r in rows))
    return [task_event(r, ips.get(r.node_id or ""), pids.get(r.worker_id or "")) for r in rows]


#: What an attempt whose definition never came takes from another attempt of its task
#: (not its job: the run's counts select tasks by their own row's job).
_DEFINED = ("name", "func", "module", "task_type", "parent_id", "actor_id")


def _borrow_definitions(
    db: Session, session_id: int, rows: list[Any], task_ids: list[str]
) -> list[Any]:
    """Rows whose definition never came, named from another attempt of the same task (Ray
    sends a restarted actor's creation task's later attempt as a RUNNING alone). They keep
    ``defined`` false: ``attrs.defined`` still says the definition of this attempt never came."""
    T = m.RayTask
    known: dict[str, Any] = {}
    for chunk in in_chunks(sorted(set(task_ids))):
        q = (
            select(T.task_id, *(getattr(T, c) for c in _DEFINED))
            .where(T.session_id == session_id, T.task_id.in_(chunk), T.defined.is_(True))
            .order_by(T.task_id, T.attempt)  # the first attempt defined
        )
        for r in db.execute(q):
            known.setdefault(r.task_id, r)
    out = []
    for r in rows:
        d = known.get(r.task_id) if not r.defined else None
        if d is not None:
            r = r._replace(**{c: getattr(r, c) or getattr(d, c) for c in _DEFINED})
        out.append(r)
    return out


@dataclass
class Derived:
    """Protocol records derived from one merge, to be indexed as one batch."""

    tasks: list[TaskEvent] = field(default_factory=list)
    runs: list[RunEvent] = field(default_factory=list)
    workers: list[WorkerEvent] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tasks or self.runs or self.workers)


def _valid(batch: Batch) -> Batch:
    """The batch as readers will decode it; events the protocol cannot hold are dropped
    (logged), so one odd value never blocks a node's exporter."""
    try:
        return decode_batch(encode_batch(batch))
    except SchemaError as exc:
        logger.error("derived Ray batch failed validation (%s); dropping the events that fail", exc)
    good = []
    for ev in batch.events:
        probe = msgspec.structs.replace(batch, events=[ev])
        try:
            decode_batch(encode_batch(probe))
            good.append(ev)
        except SchemaError as exc:
            logger.error("dropping a derived Ray event: %s: %r", exc, ev)
    return decode_batch(encode_batch(msgspec.structs.replace(batch, events=good)))


def write_derived(
    db: Session,
    blobs: BlobStore,
    *,
    tenant_id: int,
    tenant: str,
    cluster: str,
    session: str,
    derived: Derived,
    now: float,
    cache: IdCache | None = None,
) -> str | None:
    """Store the derived records as one protocol batch (named by its content) and index it
    with the ordinary writer. Returns the blob key, None if there was nothing to write."""
    if not derived:
        return None
    started = session_started(session)
    events: list[Any] = []
    if started is not None:
        events.append(
            SessionEvent(time=started, config={"scheduler": "ray", "ray_session": session})
        )
    events += sorted(derived.runs, key=lambda e: (e.id, e.event, e.time))
    events += sorted(derived.workers, key=lambda e: (e.address, e.event, e.time))
    events += sorted(derived.tasks, key=lambda e: (e.key, e.attrs.get("attempt", 0)))
    body = msgspec.json.encode(events)
    seq = int(hashlib.sha256(body).hexdigest()[:13], 16)
    batch = Batch(schema=1, cluster=cluster, session=session, agent=AGENT, seq=seq, events=events)
    # encode_batch(batch), byte for byte, without encoding the events a second time (the
    # second encoding was ~4% of a collector's CPU under Ray ingest): events is the last
    # field a derived batch has.
    head = encode_batch(msgspec.structs.replace(batch, events=[]))
    assert head.endswith(b'"events":[]}')
    data = zstandard.ZstdCompressor(level=STORE_LEVEL).compress(head[:-3] + body + b"}")
    key = derived_key(tenant, cluster, session, seq)
    if not blobs.put(key, data, if_absent=True):
        data = blobs.get(key)  # index what is stored (the same content, by its name)
    index_batch(
        db,
        tenant_id=tenant_id,
        tenant=tenant,
        batch=batch,
        blob_key=key,
        size=len(data),
        now=now,
        cache=cache,
    )
    return key
