"""The sweeper: writes tasks that are complete or settled, and closes jobs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import (
    and_,
    delete,
    func,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.orm import Session, sessionmaker

from hindsight.schema import (
    RunEvent,
)
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.idcache import IdCache
from storage.ray.bodies import in_chunks
from storage.ray.derived import Derived, row_type, tasks_as_events, write_derived
from storage.ray.statements import skip_locked_rows, statements_for
from storage.ray.translate import job_started, time_ok

logger = logging.getLogger(__name__)


@dataclass
class SweepCounts:
    tasks: int = 0
    jobs_closed: int = 0
    batches: int = 0
    failed: int = 0  # sessions whose work failed (left for a later pass)

    def add(self, other: SweepCounts) -> None:
        self.tasks += other.tasks
        self.jobs_closed += other.jobs_closed
        self.batches += other.batches
        self.failed += other.failed


def _session_names(db: Session, session_id: int) -> tuple[int, str, str, str]:
    """(tenant id, tenant, cluster, session) of a session id."""
    row = db.execute(
        select(m.Tenant.id, m.Tenant.name, m.Cluster.name, m.Session.name)
        .join(m.Cluster, m.Cluster.tenant_id == m.Tenant.id)
        .join(m.Session, m.Session.cluster_id == m.Cluster.id)
        .where(m.Session.id == session_id)
    ).one()
    return row[0], row[1], row[2], row[3]


def emit_locked(
    db: Session, session_id: int, where: list[Any], limit: int | None = None
) -> list[Any]:
    """Emit the unemitted tasks of a session matching ``where`` (at most ``limit``) that no
    other transaction holds: lock them with SKIP LOCKED (never wait, so never deadlock with
    a merge), then flip exactly those."""
    T = m.RayTask
    q = select(T.task_id, T.attempt).where(T.session_id == session_id, T.emitted.is_(False), *where)
    if limit is not None:
        q = q.limit(limit)
    st = statements_for(db)
    if st.dialect == "postgresql":
        # One statement: the keys never travel to this process and back.
        taken = tuple_(T.task_id, T.attempt).in_(q.with_for_update(skip_locked=True))
        flip = update(T.__table__).where(T.session_id == session_id, taken).values(emitted=True)
        return db.execute(flip.returning(*T.__table__.c)).all()
    keys = [(t, a) for t, a in db.execute(q)]
    rows: list[Any] = []
    for chunk in in_chunks(keys):
        rows += db.execute(st.emit_keys, {"p_session": session_id, "p_keys": chunk}).all()
    return rows


def enqueue(db: Session, session_id: int, rows: list[Any]) -> None:
    """Queue tasks just taken for writing (``emitted`` flipped) in ``ray_ready``."""
    if rows:
        db.execute(
            statements_for(db).ready,
            [
                {
                    "session_id": session_id,
                    "task_id": r.task_id,
                    "attempt": r.attempt,
                    "job_id": r.job_id,
                }
                for r in rows
            ],
        )


def take_ready(
    db: Session, session_id: int, *, job: str | None = None, limit: int | None = None
) -> list[Any]:
    """Take queued tasks of a session (of one job; at most ``limit``) out of ``ray_ready``
    for writing in this transaction: their ``ray_tasks`` rows as they are now. Queue rows
    another transaction holds are left to it (SKIP LOCKED)."""
    R, T = m.RayReady.__table__, m.RayTask.__table__  # Core: the ORM's bulk DELETE costs
    q = select(R.c.task_id, R.c.attempt).where(R.c.session_id == session_id)
    if job is not None:
        q = q.where(R.c.job_id == job)
    if limit is not None:
        q = q.limit(limit)
    taken = (
        delete(R)
        .where(
            R.c.session_id == session_id,
            tuple_(R.c.task_id, R.c.attempt).in_(skip_locked_rows(q, db)),
        )
        .returning(R.c.task_id, R.c.attempt)
    )
    st = statements_for(db)
    if st.dialect == "postgresql":
        # One statement: the keys never travel to this process and back. One primary-key
        # lookup per key whatever the statistics say: joined plainly, a planner that had
        # not yet seen the table grow hashed all of the session's rows for 2,000 keys
        # (277 ms, spilling to disk, against 12 ms); LIMIT 1 keeps the lateral lookup from
        # being flattened into that join.
        d = taken.cte("d")
        one = (
            select(*T.c)
            .where(
                T.c.session_id == session_id, T.c.task_id == d.c.task_id, T.c.attempt == d.c.attempt
            )
            .limit(1)
            .lateral("t")
        )
        return db.execute(select(*one.c).select_from(d).join(one, true())).all()
    keys = db.execute(taken).all()
    rows: list[Any] = []
    for chunk in in_chunks(sorted((k.task_id, k.attempt) for k in keys)):
        rows += db.execute(st.rows, {"p_session": session_id, "p_keys": chunk}).all()
    return rows


def _sweep_session(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    session_id: int,
    where: list[Any] | None,
    now: float,
    cache: IdCache | None,
    limit: int | None = None,
) -> SweepCounts:
    """Write a session's tasks: those matching ``where`` not yet taken, or (``where`` None)
    those the merges queued."""
    out = SweepCounts()
    with sessions.begin() as db:
        if where is None:
            rows = take_ready(db, session_id, limit=limit)
        else:
            rows = emit_locked(db, session_id, where, limit)
        if rows:
            out.batches += write_tasks(db, blobs, session_id, rows, now, cache)
            out.tasks += len(rows)
    return out


def write_tasks(
    db: Session,
    blobs: BlobStore,
    session_id: int,
    rows: list[Any],
    now: float,
    cache: IdCache | None,
    batch: int | None = None,
) -> int:
    """Write taken ``ray_tasks`` rows as derived batches of at most ``batch`` tasks (one
    batch if None); returns how many batches."""
    tenant_id, tenant, cluster, session = _session_names(db, session_id)
    parts = list(in_chunks(rows, batch)) if batch else [rows]
    for part in parts:
        write_derived(
            db,
            blobs,
            tenant_id=tenant_id,
            tenant=tenant,
            cluster=cluster,
            session=session,
            derived=Derived(tasks=tasks_as_events(db, session_id, part)),
            now=now,
            cache=cache,
        )
    return len(parts)


def _close_job(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    session_id: int,
    job_id: str,
    now: float,
    settle: float,
    idle: float,
    cache: IdCache | None,
) -> SweepCounts:
    out = SweepCounts()
    J, T = m.RayJob, m.RayTask
    with sessions.begin() as db:
        job = db.execute(
            skip_locked_rows(select(J).where(J.session_id == session_id, J.job_id == job_id), db)
        ).scalar_one_or_none()
        if job is None:
            return out
        ended = job.end_seen is not None and job.end_seen <= now - settle
        if job.closed_at is not None:
            # Closed when idle or at the driver's exit, then Ray's FINISHED came: the run
            # ends at it (it kept the earlier end, before tasks that ran after it).
            if job.closed_by == "finished" or job.finished_at is None or not ended:
                return out
        elif not ended and job.last_event_at > now - idle:
            return out
        again = job.closed_at is not None
        job_end = next((t for t in (job.finished_at, job.driver_exit_at) if time_ok(t)), None)
        if (
            not again
            and ended
            and job_end is not None
            and job.end_seen > now - settle - WORKER_DEATH_WINDOW_S
            and _awaits_worker_death(db, session_id, job_id)
        ):
            return out
        rows: list[Any] = []
        if not again:
            # Closing again writes the end alone: tasks that came since the first close
            # settle as stragglers (written here at once, a task still waiting for its
            # node's address was named after its worker id: seen in CI).
            rows = take_ready(db, session_id, job=job_id)
            rows += emit_locked(db, session_id, [T.job_id == job_id])
        end = db.execute(
            select(func.max(func.coalesce(T.failed_at, T.finished_at))).where(
                T.session_id == session_id, T.job_id == job_id
            )
        ).scalar()
        finished = next(
            (t for t in (job.finished_at, job.driver_exit_at, end, job.created_at) if time_ok(t)),
            None,
        )
        if job_end is not None and not again:
            rows = failed_with_job(rows, job_id, job_end, _workers_died(db, session_id, rows))
            job.unended_failed_at = now
        tenant_id, tenant, cluster, session = _session_names(db, session_id)
        derived = Derived(tasks=tasks_as_events(db, session_id, rows))
        started = job_started(job)
        if started is not None:
            derived.runs.append(started)
        if finished is not None:
            derived.runs.append(RunEvent(event="finished", id=job_id, time=finished))
        if write_derived(
            db,
            blobs,
            tenant_id=tenant_id,
            tenant=tenant,
            cluster=cluster,
            session=session,
            derived=derived,
            now=now,
            cache=cache,
        ):
            out.batches += 1
        job.closed_at = now
        job.closed_by = (
            "finished"
            if job.finished_at is not None
            else "driver_exit"
            if job.driver_exit_at is not None
            else "idle"
        )
        out.tasks += len(rows)
        out.jobs_closed += 0 if again else 1
    return out


#: How long after its job's end a worker's death still ends the task it was running, as
#: Ray's GCS decides it: it fails a finished job's unended tasks at the job's end
#: ``gcs_mark_task_failed_on_job_done_delay_ms`` (15 s) after it, and a dead worker's at
#: the worker's death ``gcs_mark_task_failed_on_worker_dead_delay_ms`` (1 s) after that;
#: whichever comes first wins. (A call running on a detached actor, which outlives its
#: job, ends when the actor dies within 14 s, else at the job's end.)
WORKER_DEATH_WINDOW_S = 15.0 - 1.0


#: Ray's ``WorkerExitType`` numbers, as its State API prints them in a task's error.
_EXIT_CODES = {
    "SYSTEM_ERROR": 0,
    "INTENDED_SYSTEM_EXIT": 1,
    "USER_ERROR": 2,
    "INTENDED_USER_EXIT": 3,
    "NODE_OUT_OF_MEMORY": 4,
}


def _unended_running(r: Any) -> bool:
    return r.finished_at is None and r.failed_at is None and r.running_at is not None


class _Died(NamedTuple):
    worker_id: str
    pid: int | None
    started_at: float | None
    ended_at: float
    exit_type: str | None
    exit_detail: str | None


def _workers_died(db: Session, session_id: int, rows: list[Any]) -> list[_Died]:
    """The workers that may have run the rows' unended RUNNING tasks (by the worker id the
    owner sent, or the pid the executing worker did), those whose end has arrived."""
    running = [r for r in rows if _unended_running(r)]
    ids = sorted({r.worker_id for r in running if r.worker_id})
    pids = sorted({r.pid for r in running if r.pid})
    if not ids and not pids:
        return []
    W = m.RayWorker
    got = db.execute(
        select(W.worker_id, W.pid, W.started_at, W.ended_at, W.exit_type, W.exit_detail).where(
            W.session_id == session_id,
            W.ended_at.is_not(None),
            or_(W.worker_id.in_(ids), W.pid.in_(pids)),
        )
    )
    return [_Died(*row) for row in got]


def _awaits_worker_death(db: Session, session_id: int, job_id: str) -> bool:
    """A task of the job was RUNNING, has not ended and its worker's death has not come:
    its end is that death if it comes within ``WORKER_DEATH_WINDOW_S`` of the job's end
    (a detached actor's worker outlives the job; the job's own workers die in ms). The
    close waits for it, so that the live index and a rebuild from the bodies, which knows
    every death, end the task alike."""
    T = m.RayTask
    running = db.execute(
        select(T.worker_id, T.pid, T.running_at, T.finished_at, T.failed_at).where(
            T.session_id == session_id,
            T.job_id == job_id,
            T.emitted.is_(False),
            T.defined.is_(True),
            T.running_at.is_not(None),
            T.finished_at.is_(None),
            T.failed_at.is_(None),
        )
    ).all()
    if not running:
        return False
    died = _workers_died(db, session_id, running)
    return any(_died_running(r, died) is None for r in running)


def _died_running(r: Any, died: list[_Died]) -> _Died | None:
    """The worker that ran ``r`` and died after it started: the one the owner named, else
    the one of its pid alive when it started."""
    for w in died:
        if r.worker_id and w.worker_id == r.worker_id:
            return w if w.ended_at >= r.running_at else None
    for w in died:
        if (
            r.pid
            and w.pid == r.pid
            and w.ended_at >= r.running_at
            and (w.started_at is None or w.started_at <= r.running_at)
        ):
            return w
    return None


def failed_with_job(
    rows: list[Any], job_id: str, end: float, died: list[_Died] | None = None
) -> list[Any]:
    """Ray's rule for a job's end, applied to the tasks written with it: a task that had
    not ended when its job did (its driver exited: pending, or running in a worker Ray then
    kills) is FAILED, ``WORKER_DIED``. Ray's GCS marks them so in its State API and sends
    no event for it; without this rule they would read ``lost`` with no error (a driver
    exiting with 20 tasks unfinished would give a run without errors, where Ray lists 20
    failures). A task that was RUNNING ends when its worker died (``died``: the workers'
    ends, as Ray sends them; Ray force-exits them a few ms after the job), with Ray's
    message for it, if that was within ``WORKER_DEATH_WINDOW_S`` of the job's end; any
    other, or one whose worker's end has not come, at the job's end.
    Attempts whose definition never came (a restarted actor's creation task: Ray's State
    API does not list them) stay ``lost``."""
    out = []
    for r in rows:
        if r.finished_at is None and r.failed_at is None and r.defined:
            if not hasattr(r, "_replace"):
                r = row_type(tuple(r._fields))._make(r)
            w = _died_running(r, died) if died and _unended_running(r) else None
            if w is not None and time_ok(w.ended_at) and w.ended_at <= end + WORKER_DEATH_WINDOW_S:
                at, kind = w.ended_at, w.exit_type
                message = (
                    f"Worker running the task ({w.worker_id}) died with exit_type: "
                    f"{_EXIT_CODES.get(kind or '', kind)} with error_message: "
                    f"{w.exit_detail or ''}"
                )
            else:
                at = end
                message = (
                    f"Job finishes ({job_id}) as driver exits. Marking all non-terminal "
                    "tasks as failed."
                )
            r = r._replace(
                failed_at=at,
                error_type=r.error_type or "WORKER_DIED",
                error_message=r.error_message or message,
            )
        out.append(r)
    return out


class _Quarantine:
    """Sessions whose sweep failed, each left alone for a while (doubling up to
    ``MAX_DELAY``), so that one session that cannot be written (its blob prefix refused, a
    row the writer chokes on) never holds up the others' tasks and jobs. Per process, per
    index (session ids are the index's)."""

    FIRST_DELAY = 1.0
    MAX_DELAY = 60.0

    def __init__(self) -> None:
        # (index, session id) -> (monotonic time it may be tried again, its last delay)
        self._until: dict[tuple[str, int], tuple[float, float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _index(sessions: sessionmaker[Session]) -> str:
        bind = sessions.kw.get("bind")
        return str(getattr(bind, "url", bind))

    def ready(self, sessions: sessionmaker[Session], sids: Iterable[int], now: float) -> list[int]:
        index = self._index(sessions)
        with self._lock:
            return [s for s in sids if self._until.get((index, s), (0.0, 0.0))[0] <= now]

    def waiting(self, sessions: sessionmaker[Session], now: float) -> list[int]:
        """The sessions of this index left alone at ``now``."""
        index = self._index(sessions)
        with self._lock:
            return sorted(
                s for (i, s), (until, _) in self._until.items() if i == index and until > now
            )

    def run(
        self, sessions: sessionmaker[Session], sid: int, what: str, fn: Callable[[], SweepCounts]
    ) -> SweepCounts:
        key = (self._index(sessions), sid)
        try:
            got = fn()
        except Exception:
            with self._lock:
                last = self._until.get(key, (0.0, self.FIRST_DELAY / 2))[1]
                delay = min(self.MAX_DELAY, last * 2)
                self._until[key] = (time.monotonic() + delay, delay)
            logger.warning(
                "Ray sweeper: %s failed for session %s; the other sessions go on, "
                "this one is tried again in %.0f s",
                what,
                sid,
                delay,
                exc_info=True,
            )
            return SweepCounts(failed=1)
        if key in self._until:
            with self._lock:
                self._until.pop(key, None)
        return got


quarantine = _Quarantine()
# A session whose held patches could not be merged and written: its next flushes leave
# their patches to recovery for a while (kept apart from the sweeps' pauses: a flush that
# succeeds must not cut short the pause of a sweep that keeps failing).
flush_pause = _Quarantine()


def run_due(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    *,
    settle: float,
    idle: float,
    now: float | None = None,
    cache: IdCache | None = None,
    limit: int = 100,
) -> SweepCounts:
    """One pass of the sweeper: emit tasks whose end was seen ``settle`` seconds ago (RUNNING
    or the definition never came), close jobs ``settle`` seconds after their end or ``idle``
    seconds after their last event, and emit stragglers of closed jobs. Safe to run in
    several processes at once (rows are taken with SKIP LOCKED; a task flips once)."""
    now = time.time() if now is None else now
    cutoff = now - settle
    out = SweepCounts()
    J, T, B = m.RayJob, m.RayTask, m.RayBody
    with sessions() as db:
        # Bodies whose task patches a collector holds, or held and died (merged within
        # ~0.5 s, or by recover_held): what a job's or a task's settle time waited for
        # includes every body acknowledged in it, so nothing is written or closed while
        # one of those is not merged (a task whose end is held would be written without
        # it, lost or failed with its job, for good). Per session, the oldest.
        held = dict(
            db.execute(
                select(B.session_id, func.min(B.received_at))
                .where(B.tasks_merged.is_(False))
                .group_by(B.session_id)
            ).all()
        )
        stale = db.scalars(
            select(T.session_id)
            .where(T.emitted.is_(False), T.end_seen <= cutoff)
            .distinct()
            .limit(limit)
        ).all()
        closing = db.execute(
            select(J.session_id, J.job_id, J.end_seen, J.last_event_at)
            .where(J.closed_at.is_(None), or_(J.end_seen <= cutoff, J.last_event_at <= now - idle))
            .limit(limit)
        ).all()
        closing += db.execute(  # closed before Ray's FINISHED came
            select(J.session_id, J.job_id, J.end_seen, J.last_event_at)
            .where(
                J.closed_at.is_not(None),
                J.closed_by != "finished",
                J.finished_at.is_not(None),
                J.end_seen <= cutoff,
            )
            .limit(limit)
        ).all()
        stragglers = db.scalars(
            select(T.session_id)
            .join(J, (J.session_id == T.session_id) & (J.job_id == T.job_id))
            .where(T.emitted.is_(False), J.closed_at.is_not(None), T.first_seen <= cutoff)
            .distinct()
            .limit(limit)
        ).all()

    def settled(sid: int) -> float:
        """Tasks first or last seen by then have had their settle time without a held
        body arriving in it."""
        return cutoff if sid not in held else min(cutoff, held[sid] - settle)

    def waits(sid: int, end_seen: float | None, last_event_at: float | None) -> bool:
        """A held body came within the time the job's close waited for."""
        if sid not in held:
            return False
        ends = end_seen + settle if end_seen is not None and end_seen <= cutoff else None
        deadline = ends if ends is not None else (last_event_at or 0.0) + idle
        return held[sid] <= deadline

    closing = [(sid, job) for sid, job, end, last in closing if not waits(sid, end, last)]
    q, mono = quarantine, time.monotonic()
    for sid in q.ready(sessions, stale, mono):
        out.add(
            q.run(
                sessions,
                sid,
                "writing settled tasks",
                lambda sid=sid: _sweep_session(
                    sessions, blobs, sid, [T.end_seen <= settled(sid)], now, cache
                ),
            )
        )
    for sid, job in closing:
        if q.ready(sessions, [sid], mono):
            out.add(
                q.run(
                    sessions,
                    sid,
                    f"closing job {job}",
                    lambda sid=sid, job=job: _close_job(
                        sessions, blobs, sid, job, now, settle, idle, cache
                    ),
                )
            )
    for sid in q.ready(sessions, stragglers, mono):
        closed = select(J.job_id).where(J.session_id == sid, J.closed_at.is_not(None))
        out.add(
            q.run(
                sessions,
                sid,
                "writing late tasks",
                lambda sid=sid, closed=closed: _sweep_session(
                    sessions,
                    blobs,
                    sid,
                    [T.job_id.in_(closed), T.first_seen <= settled(sid)],
                    now,
                    cache,
                ),
            )
        )
    return out


def emit_ready(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    *,
    now: float | None = None,
    cache: IdCache | None = None,
    limit: int = 100,
    batch: int = 20_000,
) -> SweepCounts:
    """Write the complete tasks the merges queued (``ray_ready``: defined, RUNNING, ended,
    their node's IP known), one derived batch per session and pass (of at most ``batch``
    tasks): what the merges of ``index_part(defer_tasks=True)`` left. Many bodies' tasks
    then share one blob and one pass of the writer. Safe in several processes at once
    (SKIP LOCKED)."""
    now = time.time() if now is None else now
    out = SweepCounts()
    R = m.RayReady
    with sessions() as db:
        sids = db.scalars(select(R.session_id).distinct().limit(limit)).all()
    for sid in quarantine.ready(sessions, sids, time.monotonic()):
        while True:
            got = quarantine.run(
                sessions,
                sid,
                "writing complete tasks",
                lambda sid=sid: _sweep_session(sessions, blobs, sid, None, now, cache, batch),
            )
            out.add(got)
            if got.failed or got.tasks < batch:
                break
    return out


def has_open_work(db: Session) -> bool:
    """Whether anything is left for the sweeper (an open job, a job closed before its
    FINISHED came, a body whose tasks are not merged yet, an unemitted task)."""
    J, T, R, B = m.RayJob, m.RayTask, m.RayReady, m.RayBody
    reclose = and_(J.closed_by != "finished", J.finished_at.is_not(None))
    return (
        db.scalar(select(J.job_id).where(or_(J.closed_at.is_(None), reclose)).limit(1)) is not None
        or db.scalar(select(B.id).where(B.tasks_merged.is_(False)).limit(1)) is not None
        or db.scalar(select(R.task_id).limit(1)) is not None
        or db.scalar(select(T.task_id).where(T.emitted.is_(False)).limit(1)) is not None
    )
