"""Finished-run work: what is done once per run after it has finished and settled.

When a batch leaves a run finished or erred, ingest queues the run in ``finish_jobs``, due
a few seconds later (``HINDSIGHT_FINISH_SETTLE_SECONDS``: workers' batches may still be on
their way); every later batch that touches the run pushes the due time back. A worker
thread in each collector process (and the embedded server) runs due jobs: it claims a
job with a lease (``claimed_until``; Postgres ``SKIP LOCKED`` so processes never take the
same job), calls the :data:`FINISHERS` in order, and deletes the job only if its due time
did not move meanwhile; a batch that arrived during the work makes the run due again.
The worker renews its lease while it works (a finisher may take minutes on a large run),
so a crashed worker's lease runs out within a minute and another process takes the job.
``reindex`` queues every finished run, so whatever finishers write is rebuilt with the
index. The worker thread itself is ``storage.jobs.workers.FinishWorker``.

Finishers are idempotent, may run in any process, and must not assume they run once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import and_, delete, literal, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from storage.alerts import deliver as alerts
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.statements import dialect_functions
from storage.lake import build as lake_build
from storage.query import explain
from storage.runs import detail, facts, profiles, rollups, runfile, runlogs, streamtiles
from storage.runs.context import FinishedRun, ReadOnce

logger = logging.getLogger(__name__)

#: The finishers, called in this order with a :class:`FinishedRun`.
FINISHERS: tuple[Callable[[FinishedRun], None], ...] = (
    rollups.finish,  # fold the run's appended histogram rows
    runfile.finish,  # the compacted per-run copy
    facts.finish,  # the run page's critical path, progress and errors
    streamtiles.finish,  # the task stream at every zoom (the task-stream route's)
    profiles.finish,  # the run's statistical profile, per prefix and worker
    runlogs.finish,  # the run's log records, emitted values, worker events
    lake_build.finish,  # the run's rows in the history lake (docs/lake.md)
    explain.finish,  # why it was slower or faster than its job's usual (docs/explain.md)
    alerts.finish,  # the alerts its tenant's rules raise (docs/alerts.md)
    detail.finish,  # its detail out of the index into one object (last: the others read it)
    detail.prune,  # the versions of that object it superseded (once the new one is committed)
)
#: A claimed job is another process's to take after this long without its worker renewing
#: the lease (a crashed worker: ``kill -9``, OOM, a lost host), so a run whose collector
#: was killed mid-job is finished by another within a minute.
LEASE_SECONDS = 60.0
#: How often a working job's lease is renewed.
RENEW_SECONDS = 15.0
#: A failed job is retried after this many seconds times its attempts so far.
RETRY_SECONDS = 30.0
POLL_SECONDS = 1.0
#: Appended day and hour rows of every cluster are folded this often.
FOLD_CLUSTERS_SECONDS = 60.0


def finished_run(
    db: Session, blobs: BlobStore, run: m.Run, tenant: str, cluster: str, session: str
) -> FinishedRun:
    """``run`` as its finishers see it: its tables read or built by ``runfile``."""
    return FinishedRun(
        db, blobs, run, tenant, cluster, session, runfile.load_run, runfile.batch_keys
    )


def _claim(db: Session, now: float, limit: int) -> list[tuple[int, float]]:
    F = m.FinishJob
    due = (
        select(F.run_id, F.due_at)
        .where(F.due_at <= now, or_(F.claimed_until.is_(None), F.claimed_until < now))
        .order_by(F.due_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    jobs = [(r, d) for r, d in db.execute(due)]
    if jobs:
        db.execute(
            update(F)
            .where(F.run_id.in_([r for r, _ in jobs]))
            .values(claimed_until=now + LEASE_SECONDS, attempts=F.attempts + 1)
        )
    return jobs


def finish_run(db: Session, blobs: BlobStore, run_id: int) -> list[str]:
    """Run every finisher for one run, each in its own transaction; returns the errors."""
    row = db.execute(
        select(m.Run, m.Tenant.name, m.Cluster.name, m.Session.name)
        .join(m.Tenant, m.Tenant.id == m.Run.tenant_id)
        .join(m.Cluster, m.Cluster.id == m.Run.cluster_id)
        .join(m.Session, m.Session.id == m.Run.session_id)
        .where(m.Run.id == run_id)
    ).first()
    db.commit()
    if row is None:
        return []
    fr = FinishedRun(
        db, ReadOnce(blobs), *row, load=runfile.load_run, batch_keys=runfile.batch_keys
    )
    public_id = fr.run.public_id
    errors = []
    for finisher in FINISHERS:
        name = f"{finisher.__module__}.{finisher.__name__}"
        try:
            finisher(fr)
            db.commit()
        except Exception as exc:  # one finisher's failure must not stop the others
            db.rollback()
            if db.execute(select(m.Run.id).where(m.Run.id == run_id)).first() is None:
                # Retention removed the run (and its blobs) meanwhile: nothing left to do.
                db.commit()
                logger.info("run %s was deleted while it was being finished", public_id)
                return []
            logger.exception("finisher %s failed for run %s", name, public_id)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            fr.release()  # what one finisher read is not held through the others
    return errors


class _Renewal:
    """Renews a claimed job's lease every :data:`RENEW_SECONDS` while its finishers run, in
    a thread of its own (a finisher holds its thread for as long as it takes)."""

    def __init__(self, sessions: sessionmaker[Session], run_id: int) -> None:
        self.sessions, self.run_id = sessions, run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="hindsight-finish-lease", daemon=True
        )

    def __enter__(self) -> _Renewal:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        F = m.FinishJob
        while not self._stop.wait(RENEW_SECONDS):
            try:
                with self.sessions.begin() as db:
                    db.execute(
                        update(F)
                        .where(F.run_id == self.run_id, F.claimed_until.is_not(None))
                        .values(claimed_until=time.time() + LEASE_SECONDS)
                    )
            except Exception:  # the index is down: the lease may run out; the work is idempotent
                logger.warning(
                    "could not renew the lease of run %s's finish job", self.run_id, exc_info=True
                )


def release_claims(sessions: sessionmaker[Session]) -> int:
    """Free every claimed job at once (a process that is the index's only worker, starting:
    the claims are a previous run's); returns how many."""
    F = m.FinishJob
    with sessions.begin() as db:
        result = db.execute(
            update(F).where(F.claimed_until.is_not(None)).values(claimed_until=None)
        )
        return int(result.rowcount or 0)


def run_due(
    sessions: sessionmaker[Session], blobs: BlobStore, *, now: float | None = None, limit: int = 8
) -> int:
    """Run the finishers of up to ``limit`` due jobs; returns how many were done."""
    F = m.FinishJob
    now = time.time() if now is None else now
    with sessions.begin() as db:
        jobs = _claim(db, now, limit)
    done = 0
    for run_id, due_at in jobs:
        with sessions() as db, _Renewal(sessions, run_id):
            errors = finish_run(db, blobs, run_id)
            same = and_(F.run_id == run_id, F.due_at == due_at)
            if errors:
                attempts = db.execute(select(F.attempts).where(F.run_id == run_id)).scalar() or 1
                # The error and the end of the claim go to the job whatever its due time: a
                # late batch that moved it meanwhile keeps its own (sooner) due time, and the
                # job no longer waits out the lease with its failure unrecorded.
                db.execute(
                    update(F)
                    .where(F.run_id == run_id)
                    .values(claimed_until=None, error="; ".join(errors)[:4000])
                )
                db.execute(
                    update(F).where(same).values(due_at=time.time() + RETRY_SECONDS * attempts)
                )
            else:
                db.execute(delete(F).where(same))
                db.execute(update(F).where(F.run_id == run_id).values(claimed_until=None))
                db.execute(
                    update(m.Run).where(m.Run.id == run_id).values(finished_work_at=time.time())
                )
                done += 1
            db.commit()
    return done


def fold_clusters(sessions: sessionmaker[Session]) -> int:
    """Fold the appended day and hour rows of every cluster that has some."""
    with sessions() as db:
        clusters = rollups.clusters_to_fold(db)
    folded = 0
    for cluster_id in clusters:
        with sessions.begin() as db:
            folded += rollups.fold_cluster(db, cluster_id)
    return folded


def queue_finished(db: Session) -> None:
    """Queue the finished-run work of every finished run, due now."""
    insert, _, _ = dialect_functions(db.get_bind().dialect.name)
    F = m.FinishJob.__table__
    db.execute(
        insert(F)
        .from_select(
            ["run_id", "due_at", "attempts"],
            select(m.Run.id, literal(0.0), literal(0)).where(m.Run.status != "running"),
        )
        .on_conflict_do_nothing(index_elements=["run_id"])
    )


def drain(sessions: sessionmaker[Session], blobs: BlobStore) -> int:
    """Run every queued job now, whatever its due time (``reindex``, tests, operators)."""
    total = 0
    while True:
        n = run_due(sessions, blobs, now=float("inf"), limit=64)
        if n == 0:
            break
        total += n
    fold_clusters(sessions)
    return total
