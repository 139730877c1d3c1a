"""Runs whose scheduler died before ending them: closed as ``lost`` once their session has
been silent long enough, and their finished-run work queued."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from storage.core import models as m
from storage.core.statements import dialect_functions

logger = logging.getLogger(__name__)

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
