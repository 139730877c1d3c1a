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
``reindex`` queues
every finished run, so whatever finishers write is rebuilt with the index.

Finishers are idempotent, may run in any process, and must not assume they run once.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, delete, func, literal, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from hindsight.schema import Batch
from storage.core import models as m
from storage.core.batches import decode_stored
from storage.core.blobs import BlobStore
from storage.core.statements import dialect_functions

if TYPE_CHECKING:
    from storage.runs.runfile import RunData

logger = logging.getLogger(__name__)

#: ``module:function`` of each finisher, called in this order with a :class:`FinishedRun`.
FINISHERS = (
    "storage.runs.rollups:finish",  # fold the run's appended histogram rows
    "storage.runs.runfile:finish",  # the compacted per-run copy
    "storage.analysis.whole:finish",  # the run page's critical path, progress and errors
    "storage.runs.profiles:finish",  # the run's statistical profile, per prefix and worker
    "storage.runs.runlogs:finish",  # the run's log records, emitted values, worker events
    "storage.lake.build:finish",  # the run's rows in the history lake (docs/lake.md)
)
#: A claimed job is another process's to take after this long without its worker renewing
#: the lease (a crashed worker: ``kill -9``, OOM, a lost host). Until 2026-11-26 a fixed 10
#: minutes with no renewal: a collector killed mid-job left that run out of the lake (and
#: without its run page facts) for 10 minutes.
LEASE_SECONDS = 60.0
#: How often a working job's lease is renewed.
RENEW_SECONDS = 15.0
#: A failed job is retried after this many seconds times its attempts so far.
RETRY_SECONDS = 30.0
POLL_SECONDS = 1.0
#: Appended day and hour rows of every cluster are folded this often.
FOLD_CLUSTERS_SECONDS = 60.0


class ReadOnce:
    """The blob store as one run's finishers see it: each object is fetched once. The
    compacted copy, the profile and the run's logs are each built from the run's batches;
    without this every finisher fetched them all again. Holds at most ``limit`` bytes (as
    stored, compressed: ~120 KB a 5,000-task batch); past that, reads go to the store."""

    def __init__(self, blobs: BlobStore, limit: int = 256 << 20) -> None:
        self.blobs = blobs
        self.url = blobs.url
        self.limit = limit
        self._held: dict[str, bytes] = {}
        self._size = 0

    def get(self, key: str) -> bytes:
        data = self._held.get(key)
        if data is None:
            data = self.blobs.get(key)
            if self._size + len(data) <= self.limit:
                self._held[key] = data
                self._size += len(data)
        return data

    def _forget(self, key: str) -> None:
        data = self._held.pop(key, None)
        if data is not None:
            self._size -= len(data)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        self._forget(key)
        return self.blobs.put(key, data, if_absent=if_absent)

    def delete(self, key: str) -> None:
        self._forget(key)
        self.blobs.delete(key)

    def exists(self, key: str) -> bool:
        return self.blobs.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.blobs.list(prefix)

    def listed(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        return self.blobs.listed(prefix)

    def ping(self) -> None:
        self.blobs.ping()


@dataclass
class FinishedRun:
    """A finished run, handed to each finisher. The caller owns the transaction."""

    db: Session
    blobs: BlobStore
    run: m.Run
    tenant: str
    cluster: str
    session: str
    _data: RunData | None = field(default=None, repr=False)

    def data(self) -> RunData:
        """The run's Arrow tables (tasks, graph, metrics), read or built once, and written
        as the run's compacted copy if it had none."""
        if self._data is None:
            from storage.runs import runfile

            self._data = runfile.load_run(self.db, self.blobs, self.run, cache=False)
        return self._data

    def batches(self) -> Iterator[Batch]:
        """The decoded raw batches around the run: its own, and the session's batches
        received near it (metrics and worker-side events carry no run)."""
        from storage.runs import runfile

        for _, key, _mine in runfile.batch_keys(self.db, self.run):
            yield decode_stored(self.blobs.get(key))


def _finisher(name: str) -> Callable[[FinishedRun], None]:
    module, func = name.split(":")
    return getattr(importlib.import_module(module), func)


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
    fr = FinishedRun(db, ReadOnce(blobs), *row)
    public_id = fr.run.public_id
    errors = []
    for name in FINISHERS:
        try:
            _finisher(name)(fr)
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


SILENT_CHECK_SECONDS = 60.0


def _silent(before: float) -> Any:
    """The run's session was last heard from before ``before`` (and is not a Ray one)."""
    R, S = m.Run, m.Session
    return (
        select(S.id)
        .where(S.id == R.session_id, S.last_seen < before)
        .where(~select(m.RayJob.session_id).where(m.RayJob.session_id == S.id).exists())
        .exists()
    )


def silent_runs(before: float, limit: int) -> Any:
    """Ids of running runs whose session was last heard from before ``before``: read
    through the partial index of running runs (``ix_runs_running``), not the whole table."""
    return select(m.Run.id).where(m.Run.status == "running", _silent(before)).limit(limit)


def close_silent(
    sessions: sessionmaker[Session], *, silence: float, now: float | None = None, limit: int = 1000
) -> int:
    """Close the Dask runs still running in sessions nothing was heard from for ``silence``
    seconds: their scheduler was killed (SIGKILL, the OOM killer, a pod evicted without a
    grace period) before its agent could end them, so they stayed running for ever, never
    got their finished-run work and never reached the lake. Each becomes ``lost``, ended at
    its last task's stop, and its finished-run work is queued. ``lost`` ranks below an end
    the agent sends: a scheduler that was only cut off (a network partition) and then ends
    the run has its own end replace it. Only the index changes (a rebuilt index has the run
    running until the next pass closes it again); the session's ``last_seen`` is left as
    it was. Ray runs are left to the Ray sweeper. Returns how many runs were closed."""
    now = time.time() if now is None else now
    R, F = m.Run, m.FinishJob
    silent = _silent(now - silence)
    with sessions() as db:
        ids = db.scalars(silent_runs(now - silence, limit)).all()
    closed = 0
    for run_id in ids:
        with sessions.begin() as db:
            # Checked again as it is written: a batch may have come meanwhile.
            done = db.execute(
                update(R)
                .where(R.id == run_id, R.status == "running", silent)
                .values(status="lost", finished_at=func.coalesce(R.task_stop, R.started_at))
                .execution_options(synchronize_session=False)
            ).rowcount
            if not done:
                continue
            insert, _, _ = dialect_functions(db.get_bind().dialect.name)
            db.execute(
                insert(F.__table__)
                .values(run_id=run_id, due_at=now, attempts=0)
                .on_conflict_do_nothing(index_elements=["run_id"])
            )
            closed += 1
            logger.warning(
                "run %s closed as lost: nothing heard from its session for %.0f s "
                "(its scheduler died?)",
                run_id,
                silence,
            )
    return closed


def fold_clusters(sessions: sessionmaker[Session]) -> int:
    """Fold the appended day and hour rows of every cluster that has some."""
    from storage.runs import rollups

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


class FinishWorker:
    """One daemon thread per process running due jobs for every open store in it."""

    _instance: FinishWorker | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._targets: weakref.WeakKeyDictionary[
            Any, tuple[sessionmaker[Session], BlobStore, float]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Silence counts from this process's start too: after the collector itself was
        # down, agents resend what they spooled before their sessions read as silent.
        self._started = time.time()
        self._thread = threading.Thread(target=self._loop, name="hindsight-finish", daemon=True)
        self._thread.start()

    @classmethod
    def register(
        cls, owner: Any, sessions: sessionmaker[Session], blobs: BlobStore, silence: float = 0.0
    ) -> None:
        """Run ``owner``'s due jobs in this process's worker thread while ``owner`` lives,
        and close its silent runs (:func:`close_silent`) when ``silence`` is positive."""
        with cls._instance_lock:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = cls()
            worker = cls._instance
        with worker._lock:
            worker._targets[owner] = (sessions, blobs, silence)

    def _loop(self) -> None:
        last_fold = last_silent = time.monotonic()
        while not self._stop.wait(POLL_SECONDS):
            with self._lock:
                targets = list(self._targets.values())
            fold = time.monotonic() - last_fold > FOLD_CLUSTERS_SECONDS
            silent = time.monotonic() - last_silent > SILENT_CHECK_SECONDS
            for sessions, blobs, silence in targets:
                try:
                    if silent and 0 < silence < time.time() - self._started:
                        close_silent(sessions, silence=silence)
                    # One job a claim: a process stopped mid-job (a restart) leaves that one
                    # leased for up to LEASE_SECONDS, not the seven it had claimed with it.
                    while run_due(sessions, blobs, limit=1) > 0:
                        pass
                    if fold:
                        fold_clusters(sessions)
                except Exception:  # the index is down, say: log, and try again later
                    logger.warning("finished-run work failed; will retry", exc_info=True)
                    # Agents resend what they held while the index was down: silence
                    # counts again from now.
                    self._started = time.time()
            if fold:
                last_fold = time.monotonic()
            if silent:
                last_silent = time.monotonic()
