"""The background work of a collector process (and of the embedded server), all started
from :func:`start`: the finished-run worker (due finish jobs, silent runs, cluster rollups,
the manifest's collapse, the per-run tables' partitions), the alert sender and the Ray
sweeper."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from storage.alerts.deliver import deliver_due
from storage.core import partitions
from storage.core.blobs import BlobStore
from storage.core.manifest import collapse_due
from storage.jobs.finish import FOLD_CLUSTERS_SECONDS, POLL_SECONDS, fold_clusters, run_due
from storage.jobs.silent import SILENT_CHECK_SECONDS, close_silent
from storage.ray.worker import StoreParts, Sweeper, merge_held_at_exit

logger = logging.getLogger(__name__)


class _PerProcess:
    """One daemon thread per process serving every open store registered with it; the
    subclass's ``__init__`` makes ``_targets``, ``_lock`` and starts ``_thread``."""

    _instance: Any = None  # set per subclass
    _instance_lock = threading.Lock()
    _targets: weakref.WeakKeyDictionary[Any, Any]
    _lock: threading.Lock
    _thread: threading.Thread

    @classmethod
    def _attach(cls, owner: Any, target: Any) -> None:
        """Serve ``target`` while ``owner`` lives, starting the thread if none runs."""
        with cls._instance_lock:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = cls()
            instance = cls._instance
        with instance._lock:
            instance._targets[owner] = target


class FinishWorker(_PerProcess):
    """One daemon thread per process running due jobs for every open store in it."""

    _instance: FinishWorker | None = None

    def __init__(self) -> None:
        self._targets: weakref.WeakKeyDictionary[
            Any, tuple[sessionmaker[Session], BlobStore, float, float]
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
        cls,
        owner: Any,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        silence: float = 0.0,
        collapse: float = 0.0,
    ) -> None:
        """Run ``owner``'s due jobs in this process's worker thread while ``owner`` lives,
        close its silent runs (:func:`close_silent`) when ``silence`` is positive, and
        collapse its manifest rows older than ``collapse`` seconds when that is positive
        (:func:`storage.core.manifest.collapse_due`, every quarter of it)."""
        cls._attach(owner, (sessions, blobs, silence, collapse))

    def _loop(self) -> None:
        last_fold = last_silent = time.monotonic()
        # by store, weakly: keyed by id(), a new store could take a gone one's id and wait
        # out its clock
        last_partitions: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        last_collapse: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        while not self._stop.wait(POLL_SECONDS):
            with self._lock:
                targets = list(self._targets.values())
            fold = time.monotonic() - last_fold > FOLD_CLUSTERS_SECONDS
            silent = time.monotonic() - last_silent > SILENT_CHECK_SECONDS
            for sessions, blobs, silence, collapse in targets:
                try:
                    if silent and 0 < silence < time.time() - self._started:
                        close_silent(sessions, silence=silence)
                    since = time.monotonic() - last_collapse.get(sessions, 0.0)
                    if collapse > 0 and since > collapse / 4:
                        # a second of it a poll, finish jobs between: an upgraded index's
                        # backlog goes in passes, not in one that holds the jobs back
                        if not _collapse_for(sessions, collapse, COLLAPSE_PASS_SECONDS):
                            last_collapse[sessions] = time.monotonic()
                    since = time.monotonic() - last_partitions.get(sessions, -1e9)
                    if since > PARTITIONS_SECONDS:
                        # on its own clock either way: a failure here (a role that does not
                        # own the tables, say) must not hold back the finished-run work
                        last_partitions[sessions] = time.monotonic()
                        try:
                            partitions.ensure(sessions.kw["bind"])
                        except Exception:
                            logger.warning("partitions: ranges not made", exc_info=True)
                    # One job a claim: a process stopped mid-job (a restart) leaves that one
                    # leased for up to LEASE_SECONDS, not the seven it had claimed with it.
                    # For a while a pass: a backlog (after a reindex: hours of jobs) must not
                    # hold back the other stores' work nor this one's partitions.
                    end = time.monotonic() + JOBS_PASS_SECONDS
                    while run_due(sessions, blobs, limit=1) > 0 and time.monotonic() < end:
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


COLLAPSE_PASS_SECONDS = 1.0
JOBS_PASS_SECONDS = 30.0
#: How often the per-run tables' ranges are kept ahead of the newest run
#: (``storage.core.partitions``: a million runs of room at the least).
PARTITIONS_SECONDS = 60.0


def _collapse_for(sessions: sessionmaker[Session], age: float, seconds: float) -> bool:
    """Collapse due manifest rows for up to ``seconds``; whether some may be left. A
    failure is logged, not raised: the finished-run work after it still runs."""
    end = time.monotonic() + seconds
    try:
        while collapse_due(sessions, age=age, limit=50):
            if time.monotonic() > end:
                return True
    except Exception:  # the index is down, say: the next pass tries again
        logger.warning("collapsing the batch manifest failed; will retry", exc_info=True)
    return False


class AlertSender(_PerProcess):
    """One daemon thread per process posting due alerts (``storage.alerts.deliver``) for
    every open store in it: apart from the finished-run worker, so a slow webhook never
    holds a run's finished-run work back."""

    _instance: AlertSender | None = None

    def __init__(self) -> None:
        self._targets: weakref.WeakKeyDictionary[Any, tuple[sessionmaker[Session], bool, float]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="hindsight-alerts", daemon=True)
        self._thread.start()

    @classmethod
    def register(
        cls, owner: Any, sessions: sessionmaker[Session], allow_private: bool, backoff: float
    ) -> None:
        cls._attach(owner, (sessions, allow_private, backoff))

    def _loop(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            with self._lock:
                targets = list(self._targets.values())
            for sessions, allow_private, backoff in targets:
                try:
                    while deliver_due(sessions, allow_private=allow_private, backoff=backoff):
                        pass
                except Exception:  # the index is down, say: log, and try again later
                    logger.warning("posting alerts failed; will retry", exc_info=True)


def start(owner: Any, store: StoreParts) -> Sweeper | None:
    """Start ``owner``'s background work in this process, as its settings say: the
    finished-run worker (``finish_worker``) and the Ray sweeper (``ray_sweeper``, returned:
    a Ray body wakes it). Both hold ``owner`` and ``store`` weakly."""
    s = store.settings
    if s.finish_worker:
        FinishWorker.register(
            owner,
            store.sessions,
            store.blobs,
            silence=s.silent_close_seconds,
            collapse=s.manifest_collapse_seconds,
        )
        AlertSender.register(owner, store.sessions, s.alerts_allow_private, s.alerts_retry_seconds)
    if not s.ray_sweeper:
        return None
    sweeper = Sweeper(store)
    sweeper.start()
    atexit.register(merge_held_at_exit, weakref.ref(sweeper))
    return sweeper
