"""The read side of Ray runs: what the run detail adds for a run recorded from Ray's event
exporter (``storage.ray.merge`` and ``storage.ray.sweep`` write it). Ray sends no sequence
numbers, so completeness is told from what is known about each task instead of from counted
batches."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, false, func, select
from sqlalchemy.orm import Session

from storage.core import models as m


def ray_job(db: Session, run: m.Run) -> m.RayJob | None:
    """The Ray job a run was recorded from, or None for a run of another scheduler."""
    return db.get(m.RayJob, (run.session_id, run.run_key))


def completeness(db: Session, job: m.RayJob) -> dict[str, Any]:
    """How much of a Ray job Hindsight knows, in the shape of the batch completeness
    (``ratio``, ``batches_received``, ``closed``...) plus what Ray-specific is missing:
    tasks whose definition, RUNNING or end never arrived, the job's FINISHED event, and
    events stored but not understood (``events_skipped``)."""
    T = m.RayTask
    # A task not ended when its job did (its driver exited) was written FAILED with the
    # job, as Ray's State API lists it (``storage.ray.sweep.failed_with_job``): Ray sends no
    # end for it, so none is missing. Not one that came after that close (written as it was).
    ended_by_job = (
        (
            T.defined.is_(True)
            & T.finished_at.is_(None)
            & T.failed_at.is_(None)
            & (T.first_seen <= job.unended_failed_at)
        )
        if job.unended_failed_at is not None
        else false()
    )
    ended = T.finished_at.is_not(None) | T.failed_at.is_not(None) | ended_by_job
    # A task that failed before it reached a worker (cancelled while pending, a call on a
    # dead actor, a task still pending when its job ended: no SUBMITTED_TO_WORKER, no
    # worker) never ran: no RUNNING is missing.
    never_ran = ended & T.submitted_at.is_(None) & T.running_at.is_(None) & T.worker_id.is_(None)
    ran = T.running_at.is_not(None) | never_ran
    total, complete, no_def, no_running, no_end, waiting = db.execute(
        select(
            func.count(),
            func.sum(case((T.defined.is_(True) & ran & ended, 1), else_=0)),
            func.sum(case((T.defined.is_(False), 1), else_=0)),
            func.sum(case((~ran, 1), else_=0)),
            func.sum(case((~ended, 1), else_=0)),
            func.sum(case((T.emitted.is_(False), 1), else_=0)),
        ).where(T.session_id == job.session_id, T.job_id == job.job_id)
    ).one()
    R = m.RayReady
    queued = db.scalar(
        select(func.count()).where(R.session_id == job.session_id, R.job_id == job.job_id)
    )
    bodies = db.scalar(
        select(func.count()).select_from(m.RayBody).where(m.RayBody.session_id == job.session_id)
    )
    counts: dict[str, dict[str, int]] = {"received": {}, "skipped": {}}
    for kind, etype, n in db.execute(
        select(m.RayEventCount.kind, m.RayEventCount.event_type, m.RayEventCount.count).where(
            m.RayEventCount.session_id == job.session_id
        )
    ):
        counts.setdefault(kind, {})[etype] = int(n)
    total = int(total or 0)
    return {
        "source": "ray",
        "batches_received": int(bodies or 0),
        "batches_expected": int(bodies or 0),
        "ratio": (int(complete or 0) / total) if total else 1.0,
        "closed": job.closed_at is not None,
        "closed_by": job.closed_by,
        "job_finished_event": job.finished_at is not None,
        "events_dropped_at_agents": 0,
        "tasks": {
            "total": total,
            "complete": int(complete or 0),
            "without_definition": int(no_def or 0),
            "without_running": int(no_running or 0),
            "without_end": int(no_end or 0),
            "not_yet_written": int(waiting or 0) + int(queued or 0),
        },
        "events_received": sum(counts["received"].values()),
        "events_skipped": counts["skipped"],
        "agents": [],
    }


def detail(db: Session, job: m.RayJob) -> dict[str, Any]:
    """The Ray facts of a run: its job, the session's nodes, and the job's actors."""
    nodes = [
        {
            "node_id": n.node_id,
            "ip": n.ip,
            "hostname": n.hostname,
            "started_at": n.started_at,
            "alive_at": n.alive_at,
            "dead_at": n.dead_at,
            "death_reason": n.death_reason,
            "resources": n.resources or {},
        }
        for n in db.execute(
            select(m.RayNode)
            .where(m.RayNode.session_id == job.session_id)
            .order_by(m.RayNode.node_id)
        ).scalars()
    ]
    actors = [
        {
            "actor_id": a.actor_id,
            "class_name": a.class_name,
            "name": a.name,
            "pid": a.pid,
            "node_id": a.node_id,
            "alive_at": a.alive_at,
            "dead_at": a.dead_at,
        }
        for a in db.execute(
            select(m.RayActor)
            .where(m.RayActor.session_id == job.session_id, m.RayActor.job_id == job.job_id)
            .order_by(m.RayActor.actor_id)
        ).scalars()
    ]
    return {
        "job_id": job.job_id,
        "entrypoint": job.entrypoint,
        "driver_pid": job.driver_pid,
        "driver_node": job.driver_node,
        "created_at": job.created_at,
        "finished_at": job.finished_at,
        "driver_exit_at": job.driver_exit_at,
        "closed_at": job.closed_at,
        "closed_by": job.closed_by,
        "nodes": nodes,
        "actors": actors,
        # What Ray's exporter does not send, so these pages have nothing to show for Ray.
        "not_recorded": ["graph", "transfers", "metrics", "nbytes"],
    }


def extend_detail(db: Session, run: m.Run, detail_out: dict[str, Any]) -> None:
    """Replace the batch completeness of a Ray run by Ray's, and add its ``ray`` section."""
    job = ray_job(db, run)
    if job is None:
        return
    detail_out["scheduler"] = "ray"
    detail_out["completeness"] = completeness(db, job)
    detail_out["ray"] = detail(db, job)
