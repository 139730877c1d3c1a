"""Task patches a collector process holds a moment before it merges them."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
from sqlalchemy import (
    select,
    update,
)
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.idcache import IdCache
from storage.ray.bodies import in_chunks, read_stored
from storage.ray.events import (
    TaskPatch,
    parse,
)
from storage.ray.statements import (
    TASK_FIRST,
    TASK_LOW,
    encode_json,
    skip_locked_rows,
    statements_for,
)
from storage.ray.sweep import SweepCounts, flush_pause, quarantine, write_tasks

logger = logging.getLogger(__name__)


def _fold(into: TaskPatch, p: TaskPatch) -> None:
    """Merge patch ``p`` into ``into`` as the merge statement merges a patch into a row:
    a value set once stays, times keep the earliest, ``defined`` is OR-ed."""
    for f in TASK_FIRST:
        if getattr(into, f) is None:
            v = getattr(p, f)
            if v is not None:
                setattr(into, f, v)
    for f in TASK_LOW:
        v = getattr(p, f)
        if v is not None:
            old = getattr(into, f)
            if old is None or v < old:
                setattr(into, f, v)
    if p.defined:
        into.defined = True


def _complete(p: TaskPatch) -> bool:
    return (
        p.defined
        and p.running_at is not None
        and (p.finished_at is not None or p.failed_at is not None)
    )


class _Held(msgspec.Struct, gc=False):
    """A held patch, when it came, and the bodies it folds. Untracked by the cyclic garbage
    collector (it holds a patch, a float and ints, so it cannot be part of a cycle): tens
    of thousands live for a moment under load, and as tracked objects they made each full
    collection of a collector process cost ~50 ms (~13% of its CPU under the bench)."""

    patch: TaskPatch
    since: float
    bodies: tuple[int, ...]


class TaskHold:
    """Task patches of acknowledged bodies, held in this process for a moment before they
    are merged into ``ray_tasks`` (a Postgres collector with a sweeper; the sweeper's
    thread flushes, and requests too when it falls behind). Ray sends a task's definition
    and RUNNING in one body of a node's aggregator and its end in a later one: held
    together they become one row write instead of an insert and an update, and one patch
    to read and encode instead of two (a sixth more events a second through the same two
    cores, bench/ray_ingest.py).

    A patch is merged once its task is complete in the hold (defined, RUNNING and ended)
    or ``age`` seconds after it came, whichever is first. Nothing acknowledged depends on
    this process living: the body is stored before the ack, and its manifest row
    (``ray_bodies.tasks_merged`` false) stays so until the flush that merges its last held
    patch, in the same transaction. A body left so by a process that died is merged again
    from its blob by any sweeper (:func:`recover_held`; merges are idempotent), and so
    is a body whose patches a flush could not merge. Past ``behind`` patches the request
    that adds more flushes what is due itself, and past ``limit`` everything
    (back-pressure)."""

    def __init__(self, age: float = 0.5, limit: int = 200_000, behind: int = 10_000) -> None:
        self.age = age
        self.limit = limit
        self.behind_at = behind
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time: patches merge in key order
        # session id -> held patches in the order they came (so the aged ones lead)
        self._tasks: dict[int, dict[tuple[str, int], _Held]] = {}
        self._complete: dict[int, set[tuple[str, int]]] = {}  # complete in the hold
        self._left: dict[int, int] = {}  # body id -> its patches still held
        # bodies a failed flush dropped patches of: never marked by the hold (recovery
        # merges them from their blobs, body by body)
        self._poisoned: set[int] = set()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, session_id: int, body_id: int, patches: list[TaskPatch]) -> None:
        """Hold a committed body's task patches (one per task attempt)."""
        now = time.monotonic()
        with self._lock:
            held = self._tasks.setdefault(session_id, {})
            complete = self._complete.setdefault(session_id, set())
            for p in patches:
                k = (p.task_id, p.attempt)
                h = held.get(k)
                if h is None:
                    held[k] = h = _Held(p, now, (body_id,))
                    self._count += 1
                else:
                    _fold(h.patch, p)
                    h.bodies += (body_id,)
                if _complete(h.patch):
                    complete.add(k)
            self._left[body_id] = self._left.get(body_id, 0) + len(patches)

    @property
    def full(self) -> bool:
        """Over ``limit`` patches: the caller flushes everything before acknowledging more."""
        return self._count > self.limit

    @property
    def behind(self) -> bool:
        """Over ``behind`` patches (the flushes trail the requests by a second or more):
        the caller flushes what is due before acknowledging more."""
        return self._count > self.behind_at

    def _take(self, force: bool) -> tuple[dict[int, list[_Held]], dict[int, list[int]]]:
        """The patches due (all with ``force``) per session, and per session the bodies
        none of whose patches stay held (poisoned ones too: they stay poisoned until the
        flush is over, so that a put-back leaves them so)."""
        cutoff = time.monotonic() - self.age
        due: dict[int, list[_Held]] = {}
        released: dict[int, list[int]] = {}
        with self._lock:
            for sid, held in self._tasks.items():
                if force:
                    go = list(held)
                else:
                    complete = self._complete.get(sid, set())
                    go = list(complete)
                    for k, h in held.items():  # oldest first
                        if h.since > cutoff:
                            break
                        if k not in complete:
                            go.append(k)
                self._complete.pop(sid, None)
                if go:
                    due[sid] = [held.pop(k) for k in go]
                    released[sid] = []
                    self._count -= len(go)
                    for h in due[sid]:
                        for b in h.bodies:
                            n = self._left[b] - 1
                            if n:
                                self._left[b] = n
                            else:
                                del self._left[b]
                                released[sid].append(b)
            self._tasks = {sid: held for sid, held in self._tasks.items() if held}
        return due, released

    def _put_back(self, due: dict[int, list[_Held]]) -> None:
        """After a failed flush: the patches lead their sessions again (still the oldest),
        folded with any that came meanwhile."""
        with self._lock:
            for sid, hs in due.items():
                held: dict[tuple[str, int], _Held] = {}
                for h in hs:
                    held[(h.patch.task_id, h.patch.attempt)] = h
                    for b in h.bodies:
                        self._left[b] = self._left.get(b, 0) + 1
                self._count += len(held)
                for k, h in self._tasks.get(sid, {}).items():
                    old = held.get(k)
                    if old is None:
                        held[k] = h
                    else:
                        _fold(old.patch, h.patch)
                        old.bodies += h.bodies
                        self._count -= 1
                self._tasks[sid] = held
                complete = self._complete.setdefault(sid, set())
                complete.update(k for k, h in held.items() if _complete(h.patch))

    def flush(
        self,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        *,
        force: bool = False,
        cache: IdCache | None = None,
    ) -> int:
        """Merge the patches due (every one with ``force``), a transaction per session, which
        marks the bodies whose last held patch it merges and writes the tasks the merge
        completes (one derived batch). A session whose flush fails (or that failed a
        moment ago and is left alone for a while, doubling up to a minute) has its patches
        dropped from the hold and its bodies left to recovery (:func:`recover_held`,
        from their blobs, through the queue): nothing acknowledged is lost, the hold does
        not grow with a session that cannot be written, and the other sessions go on. A
        flush interrupted (a ``BaseException``) puts back what it had not merged. Returns
        how many patches were merged."""
        with self._flushing:
            due, released = self._take(force)
            waiting = set(flush_pause.waiting(sessions, time.monotonic()))
            sids = sorted(due)
            merged = 0
            for i, sid in enumerate(sids):
                try:
                    if sid in waiting and not force:
                        self._drop(due[sid], released[sid])
                        continue

                    def one(sid: int = sid) -> SweepCounts:
                        return self._flush_session(
                            sessions, blobs, sid, due[sid], released[sid], cache
                        )

                    merged += flush_pause.run(
                        sessions,
                        sid,
                        "merging held task patches (their bodies are left to recovery)",
                        one,
                    ).tasks
                except BaseException:
                    self._put_back({s: due[s] for s in sids[i:]})  # this one and the rest
                    raise
            return merged

    def _flush_session(
        self,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        sid: int,
        due: list[_Held],
        released: list[int],
        cache: IdCache | None,
    ) -> SweepCounts:
        patches = sorted((h.patch for h in due), key=lambda p: (p.task_id, p.attempt))
        with self._lock:
            done = [b for b in released if b not in self._poisoned]
        try:
            with sessions.begin() as db:
                # The session row first (KEY SHARE), as retention's delete locks it and
                # then, by cascade, the manifest rows.
                if _session_kept(db, sid):
                    _mark_merged(db, done)
                    _merge_and_write(db, blobs, sid, patches, cache)
        except Exception as exc:
            self._drop(due, released)
            if not isinstance(exc, DataError):
                raise  # logged, and the session's flushes paused (flush_pause)
            # A value the index cannot hold. Folded patches mix bodies, so which body
            # brought it is unknown here: recovery merges them one by one from their
            # blobs, as each body's own request would have (a good body's fields of the
            # same task are kept).
            logger.error(
                "Ray: the index refused held task patches (%s); their bodies are "
                "merged again from their blobs, one by one",
                exc.orig,
            )
            return SweepCounts()
        with self._lock:
            self._poisoned.difference_update(released)
        return SweepCounts(tasks=len(patches))

    def _drop(self, due: list[_Held], released: list[int]) -> None:
        """Drop patches a flush could not merge: their bodies are not marked (those still
        partly held never will be by this hold), so recovery merges them from their blobs."""
        with self._lock:
            self._poisoned |= {b for h in due for b in h.bodies if b in self._left}
            self._poisoned.difference_update(released)


def _session_kept(db: Session, session_id: int) -> bool:
    """Whether the session still exists, its row held (KEY SHARE, as a foreign key would)
    until the transaction ends: retention, which deletes the session row before its
    ray_tasks (no foreign key there), then waits for this merge or is seen to have run."""
    S = m.Session
    q = select(S.id).where(S.id == session_id)
    if db.get_bind().dialect.name == "postgresql":
        q = q.with_for_update(read=True, key_share=True)  # FOR KEY SHARE (alone: NO KEY UPDATE)
    return db.execute(q).first() is not None


def _mark_merged(db: Session, bodies: list[int]) -> None:
    if bodies:
        B = m.RayBody.__table__
        db.execute(update(B).where(B.c.id.in_(sorted(bodies))).values(tasks_merged=True))


def _merge_and_write(
    db: Session,
    blobs: BlobStore,
    session_id: int,
    patches: list[TaskPatch],
    cache: IdCache | None,
    batch: int = 20_000,
) -> int:
    """Merge task patches (in key order) into ``ray_tasks`` (Postgres) and write the tasks
    they complete in the same transaction (a derived batch per ``batch`` tasks), where
    :func:`merge_patches` alone queues them. Returns how many tasks were written."""
    now = time.time()
    rows = merge_patches(db, session_id, patches, now, take=True)
    if rows:
        write_tasks(db, blobs, session_id, rows, now, cache, batch)
    return len(rows)


def merge_patches(
    db: Session,
    session_id: int,
    patches: list[TaskPatch],
    now: float | None = None,
    *,
    take: bool = False,
) -> list[Any]:
    """Merge task patches (in key order) into ``ray_tasks`` (Postgres), queueing in
    ``ray_ready`` what they complete, or with ``take`` returning its rows, taken, for the
    caller to write in this transaction."""
    st, now = statements_for(db), time.time() if now is None else now
    rows: list[Any] = []
    for chunk in in_chunks(patches, 5_000):
        got = db.execute(
            st.task_taken if take else st.task_bulk,
            {"p_rows": encode_json(chunk).decode(), "p_session": session_id, "p_now": now},
        )
        if take:
            rows += got.all()
    return rows


def _merge_each(sessions: sessionmaker[Session], session_id: int, patches: list[TaskPatch]) -> None:
    """Merge patches one a transaction; one the index cannot hold is logged and left out
    (its body is stored, as a body refused whole in its request is)."""
    for p in patches:
        try:
            with sessions.begin() as db:
                merge_patches(db, session_id, [p])
        except DataError as exc:
            logger.error(
                "Ray task %s attempt %s: the index cannot hold it; stored, not indexed: %s",
                p.task_id,
                p.attempt,
                exc.orig,
            )


#: A body whose task patches are still not merged this long after it came was held by a
#: process that died (a live one merges within TaskHold.age, or retries while the index is
#: down); any sweeper merges it again from its blob.
RECOVER_AFTER = 10.0


def recover_held(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    *,
    now: float | None = None,
    after: float = RECOVER_AFTER,
    limit: int = 50,
) -> SweepCounts:
    """Merge the task patches of bodies a dead process held (``ray_bodies.tasks_merged``
    false ``after`` seconds after they came) from their stored blobs, one body a
    transaction, each taken with SKIP LOCKED. Returns how many bodies (``batches``)."""
    now = time.time() if now is None else now
    B = m.RayBody
    out = SweepCounts()
    q = select(B.id, B.session_id).where(B.tasks_merged.is_(False), B.received_at <= now - after)
    waiting = quarantine.waiting(sessions, time.monotonic())
    if waiting:  # a session whose bodies fail must not hold up the others'
        q = q.where(B.session_id.not_in(waiting))
    with sessions() as db:
        rows = db.execute(q.order_by(B.received_at).limit(limit)).all()
    for body_id, sid in rows:
        if not quarantine.ready(sessions, [sid], time.monotonic()):
            continue
        out.add(
            quarantine.run(
                sessions,
                sid,
                f"merging held body {body_id} again",
                lambda b=body_id: _remerge(sessions, blobs, b),
            )
        )
    return out


def _remerge(sessions: sessionmaker[Session], blobs: BlobStore, body_id: int) -> SweepCounts:
    try:
        return _remerge_body(sessions, blobs, body_id, each=False)
    except DataError:  # a value the index cannot hold: the body's other tasks are merged
        return _remerge_body(sessions, blobs, body_id, each=True)


def _remerge_body(
    sessions: sessionmaker[Session], blobs: BlobStore, body_id: int, *, each: bool
) -> SweepCounts:
    B = m.RayBody
    with sessions.begin() as db:
        # The session's row before the body's, the order retention takes them in (its
        # delete of the session cascades to the bodies): body first could deadlock with it.
        sid = db.scalar(select(B.session_id).where(B.id == body_id))
        if sid is None or not _session_kept(db, sid):  # retention took it
            return SweepCounts()
        q = select(B.blob_key).where(B.id == body_id, B.tasks_merged.is_(False))
        key = db.scalar(skip_locked_rows(q, db))
        if key is None:  # merged meanwhile, or another sweeper has it
            return SweepCounts()
        name = db.scalar(select(m.Session.name).where(m.Session.id == sid))
        patches: list[TaskPatch] = []
        try:
            data = blobs.get(key)
        except FileNotFoundError:  # retention took it
            logger.error(
                "Ray body %s: its blob %s is gone; its tasks cannot be merged", body_id, key
            )
        else:
            part = parse(read_stored(data)).get(name or "")
            if part is not None:
                patches = [t for _, t in sorted(part.tasks.items())]
        if each:
            _merge_each(sessions, sid, patches)
        else:
            merge_patches(db, sid, patches)
        _mark_merged(db, [body_id])
    logger.warning(
        "Ray body %s: merged %d task patches a collector had held and not merged (it stopped)",
        body_id,
        len(patches),
    )
    return SweepCounts(tasks=0, batches=1)
