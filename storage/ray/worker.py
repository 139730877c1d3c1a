"""The Ray sweeper's thread: one per collector process (``storage.jobs.workers`` starts it)."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from storage.core.blobs import BlobStore
from storage.core.config import Settings
from storage.core.idcache import IdCache
from storage.ray import hold as ray_hold
from storage.ray import sweep as ray_sweep

logger = logging.getLogger(__name__)


class StoreParts(Protocol):
    """What the sweeper uses of a process's store (``services.common.store.Store``)."""

    settings: Settings
    engine: Any
    sessions: sessionmaker[Session]
    blobs: BlobStore
    ids: IdCache


class Sweeper:
    """Merges the task patches its process holds (:class:`storage.ray.hold.TaskHold`, every
    ``FLUSH_GAP`` seconds, writing the tasks the merge completes), writes the tasks other
    merges queued (:func:`storage.ray.sweep.emit_ready`, at most every ``EMIT_GAP`` seconds; in
    both, many bodies' tasks share a derived batch) and runs
    :func:`storage.ray.sweep.run_due` every ``interval`` while the index has open Ray work: closes
    jobs after their end has settled (or after they went idle) and writes late tasks. One
    per process; several processes cooperate (rows are taken with SKIP LOCKED). It parks
    when there is nothing open and wakes when a Ray body arrives.

    The thread holds its store weakly: when the app goes away (tests make many), the
    thread ends instead of keeping the app's engine and its connections alive."""

    PARKED = 30.0  # a parked sweeper looks again this often (and checks its app still exists)
    EMIT_GAP = 0.25  # bodies arriving meanwhile share one derived batch
    FLUSH_GAP = 0.25  # held task patches are looked at this often

    def __init__(self, st: StoreParts) -> None:
        self._store = weakref.ref(st)
        s = st.settings
        self.settle = s.ray_settle_seconds
        self.idle = s.ray_idle_close_seconds
        self.interval = min(2.0, max(0.2, self.settle / 4))
        # Postgres: task patches are held a moment before they are merged (storage.ray.hold.
        # TaskHold), well within the settle time a job's end waits for its tasks.
        self.hold: ray_hold.TaskHold | None = None
        age = min(s.ray_hold_seconds, self.settle / 4)
        if st.engine.dialect.name == "postgresql" and age > 0:
            self.hold = ray_hold.TaskHold(age=age)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._due_at = 0.0  # of the next run_due
        self._emit_at = 0.0  # of the next emit_ready while patches are held

    def start(self) -> None:
        """Start the thread (again after a fork: threads do not survive one)."""
        with self._lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._run, daemon=True, name="hindsight-ray-sweeper"
            )
            self._thread.start()

    def wake(self) -> None:
        self.start()
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and merge the task patches still held (a process that exits
        without this leaves them to another sweeper's recovery, ~10 s later)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        st = self._store()
        if self.hold is not None and len(self.hold) and st is not None:
            try:
                self.hold.flush(st.sessions, st.blobs, force=True, cache=st.ids)
            except Exception:
                logger.warning(
                    "Ray sweeper: held task patches not merged at exit; another "
                    "sweeper merges their bodies again",
                    exc_info=True,
                )

    def _pass(self) -> bool:
        """One pass; whether there is still open work (None-safe if the app is gone)."""
        st = self._store()
        if st is None:
            self._stop.set()
            return False
        if self.hold is not None:
            self.hold.flush(st.sessions, st.blobs, cache=st.ids)
        now = time.monotonic()
        if now >= self._emit_at:
            self._emit_at = now + self.EMIT_GAP
            ray_sweep.emit_ready(st.sessions, st.blobs, cache=st.ids)
        with st.sessions() as session:
            busy = ray_sweep.has_open_work(session)
        if busy and time.monotonic() >= self._due_at:
            self._due_at = time.monotonic() + self.interval
            ray_hold.recover_held(st.sessions, st.blobs)
            ray_sweep.run_due(
                st.sessions, st.blobs, settle=self.settle, idle=self.idle, cache=st.ids
            )
        return busy

    def _run(self) -> None:
        # A fresh process looks once, after a while, for work left by an earlier one.
        self._wake.wait(self.PARKED / 6)
        backoff = self.interval
        while not self._stop.is_set():
            self._wake.clear()
            began = time.monotonic()
            try:
                busy = self._pass()
                backoff = self.interval
            except Exception:  # the index or blob store is down: try again later
                logger.warning("Ray sweeper: pass failed; retrying", exc_info=True)
                backoff = min(60.0, backoff * 2)
                self._stop.wait(backoff)
                continue
            if self._stop.is_set():
                return
            if self.hold is not None and len(self.hold):
                # A pass every FLUSH_GAP, counted from its start: a pass that took longer
                # (the sweeper behind the requests) is followed at once.
                self._stop.wait(max(0.0, began + self.FLUSH_GAP - time.monotonic()))
            elif busy:
                # Let bodies gather, then go again when one arrives (or run_due is due).
                self._stop.wait(self.EMIT_GAP)
                self._wake.wait(max(0.0, self._due_at - time.monotonic()))
            else:
                self._wake.wait(self.PARKED)


def merge_held_at_exit(ref: weakref.ref[Sweeper]) -> None:
    """A process that exits normally (a gunicorn worker stopped or recycled) merges the
    task patches it holds instead of leaving them to another sweeper's recovery."""
    sweeper = ref()
    if sweeper is not None and sweeper.hold is not None:  # even empty: a flush may be under way
        sweeper.stop(timeout=5.0)
