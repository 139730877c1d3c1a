"""Ray's merged rows as protocol records: tasks, jobs and worker processes.

Ray's vocabulary is translated here: a worker's exit type becomes the protocol's departure
(``expected``, the worker's last ``status``, and the exit type with its detail as the
reason), which the run page reads as one of its causes (``storage.runs.runlogs.CAUSES``)."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import Any

from hindsight.schema import (
    MAX_TIME,
    RunEvent,
    StartStop,
    TaskEvent,
    WorkerEvent,
)
from storage.ray.wire import clean, error_summary

logger = logging.getLogger(__name__)

#: What each of Ray's worker exit types means, as the protocol's cause of a departure.
EXIT_CAUSES = {
    "INTENDED_SYSTEM_EXIT": "retired",  # Ray let it go (idle, or its job ended)
    "INTENDED_USER_EXIT": "closed",  # it exited on purpose (exit_actor, sys.exit)
    "SYSTEM_ERROR": "lost",  # crashed or killed
    "USER_ERROR": "lost",  # an actor's constructor raised, or the process exited with an error
    "NODE_OUT_OF_MEMORY": "lost",  # killed by Ray's memory monitor
}
#: Each cause as the departure's ``expected`` and last ``status`` that read as it (a lost
#: worker was running; its reason, the exit type, says it ended on its own: crashed).
DEPARTURES: dict[str, tuple[bool | None, str | None]] = {
    "retired": (True, None),
    "closed": (False, "closed"),
    "lost": (False, "running"),
}


def session_started(session: str) -> float | None:
    """The start a Ray session name carries (``session_2026-11-22_21-42-54_270620_23949``)."""
    match = re.match(r"^session_(\d{4})-(\d\d)-(\d\d)_(\d\d)-(\d\d)-(\d\d)_(\d{6})_", session)
    if not match:
        return None
    y, mo, d, h, mi, s, us = (int(x) for x in match.groups())
    try:
        return datetime(y, mo, d, h, mi, s, us, tzinfo=UTC).timestamp()
    except ValueError:
        return None


def worker_label(
    ip: str | None, pid: int | None, node: str | None, worker: str | None
) -> str | None:
    """A Ray worker process as the pages show it: ``ip:pid`` (or the ids when unknown)."""
    if pid and ip:
        return f"{ip}:{pid}"
    if pid and node:
        return f"node-{node[:12]}:{pid}"
    if worker:
        return f"worker-{worker[:12]}"
    return None


def time_ok(*values: float | None) -> bool:
    for v in values:
        if v is None or not 0.0 <= v <= MAX_TIME:
            return False
    return True


def task_state(row: Any) -> str:
    """The task's last state Ray reported."""
    if row.failed_at is not None:
        return "FAILED"
    if row.finished_at is not None:
        return "FINISHED"
    if row.running_at is not None:
        return "RUNNING"
    if row.submitted_at is not None:
        return "SUBMITTED_TO_WORKER"
    if row.pending_at is not None:
        return "PENDING"
    return "UNKNOWN"


def task_event(row: Any, ip: str | None, pid: int | None) -> TaskEvent:
    """A merged ``ray_tasks`` row as a protocol task record.

    Start is RUNNING (as Ray's State API reports ``start_time_ms``), else SUBMITTED_TO_WORKER
    when RUNNING never arrived, but for an actor's method call: SUBMITTED_TO_WORKER puts it
    in the actor's queue, where it may wait, or end without running (the actor died, the
    driver exited), so without RUNNING it has no start, nor a worker, as in Ray's State
    API; stop is FINISHED or FAILED. Ray's own facts go in ``attrs`` (what the record's
    fields already say - name, job, start, stop - is not repeated). Written out field by
    field: it runs once per Ray task, in the sweeper's hot loop."""
    failed, finished, running = row.failed_at, row.finished_at, row.running_at
    end = failed if failed is not None else finished
    status = "erred" if failed is not None else "memory" if finished is not None else "lost"
    start, unrun = running, False
    if running is None:
        if row.task_type == "ACTOR_TASK":
            unrun = True  # queued at the actor's process, not run there
        else:
            start = row.submitted_at
    startstops = []
    if (
        start is not None
        and end is not None
        and 0.0 <= start <= MAX_TIME
        and 0.0 <= end <= MAX_TIME
    ):
        startstops = [StartStop("compute", start if start < end else end, end)]
    pid = row.pid or (None if unrun else pid)
    attrs: dict[str, Any] = {"attempt": row.attempt, "state": task_state(row)}
    v = row.task_type
    if v is not None:
        attrs["type"] = v
    v = row.module
    if v is not None:
        attrs["module"] = v
    v = row.parent_id
    if v is not None:
        attrs["parent"] = v
    v = row.actor_id
    if v is not None:
        attrs["actor"] = v
    if row.node_id is not None:
        attrs["node"] = row.node_id
    if row.worker_id is not None:
        attrs["worker_id"] = row.worker_id
    if pid is not None:
        attrs["pid"] = pid
    v = row.error_type
    if v is not None:
        attrs["error_type"] = v
    v = row.pending_at
    if v is not None and 0.0 <= v <= MAX_TIME:
        attrs["pending_at"] = v
    v = row.submitted_at
    if v is not None and 0.0 <= v <= MAX_TIME:
        attrs["submitted_at"] = v
    if not startstops and end is not None and 0.0 <= end <= MAX_TIME:
        # Ended without being sent to a worker (cancelled while pending, a call on a dead
        # actor) or without running (an actor's call): no phase to draw, but the end Ray's
        # State API reports as ``end_time_ms``.
        attrs["ended_at"] = end
    if start is not None:
        attrs["start_from"] = "RUNNING" if running is not None else "SUBMITTED_TO_WORKER"
    if not row.defined:
        attrs["defined"] = False  # the definition never came: no name or function
    exception = traceback = None
    if status != "memory":
        exception, traceback = error_summary(row.error_message, row.error_type)
    return TaskEvent(
        key=row.task_id,
        prefix=row.func or "unknown",
        status=status,
        group=row.name,
        run=row.job_id,
        worker=None if unrun and not pid else worker_label(ip, pid, row.node_id, row.worker_id),
        startstops=startstops,
        exception=exception,
        traceback=traceback,
        attrs=attrs,
    )


def run_name(entrypoint: str | None) -> str | None:
    return clean(" ".join(entrypoint.split()) if entrypoint else None, 1024)


def job_started(job: Any) -> RunEvent | None:
    if not time_ok(job.created_at):
        return None
    return RunEvent(
        event="started",
        id=job.job_id,
        time=job.created_at,
        name=run_name(job.entrypoint),
        client=f"ray driver pid {job.driver_pid}" if job.driver_pid else None,
    )


def worker_events(w: Any, ip: str | None) -> list[WorkerEvent]:
    """A Ray worker process's joined/left events (task workers only: drivers and IO
    workers run no tasks)."""
    if w.worker_type not in (None, "WORKER") or not ip or not w.pid:
        return []
    address = worker_label(ip, w.pid, w.node_id, w.worker_id)
    assert address is not None
    out = []
    if time_ok(w.started_at):
        out.append(
            WorkerEvent(event="joined", address=address, time=w.started_at, name=w.worker_id)
        )
    if time_ok(w.ended_at):
        reason = ": ".join(x for x in (w.exit_type, w.exit_detail) if x) or None
        cause = EXIT_CAUSES.get(w.exit_type or "")
        expected, status = DEPARTURES[cause] if cause else (None, None)
        out.append(
            WorkerEvent(
                event="left",
                address=address,
                time=w.ended_at,
                name=w.worker_id,
                reason=clean(reason, 1024),
                expected=expected,
                status=status,
            )
        )
    return out
