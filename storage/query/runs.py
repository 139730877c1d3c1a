"""Read-side repository functions. They take a session, scope everything by tenant,
and never commit."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.orm import Session

from hindsight.schema import TaskEvent, agent_name_prefix
from storage.analysis.runfacts import (
    display_name,
    fingerprint,
    makespan,
    seconds_by_action,
)
from storage.core import manifest
from storage.core import models as m
from storage.core.batches import DEFAULT_RUN, decode_stored
from storage.core.blobs import BlobStore
from storage.ray import read as ray_read
from storage.runs import packed


def makespan_column() -> Any:
    """A run's makespan as a SQL expression on ``runs`` (NULL before any task)."""
    return m.Run.task_stop - m.Run.task_start


#: A run still open whose session sent nothing for this long has agents that cannot reach
#: the collector (or are gone): while a run is open its scheduler's agent sends a state
#: sample every sampling interval (seconds), so its later batches are elsewhere, in a spool.
#: The default of ``HINDSIGHT_SILENT_AGENTS_SECONDS``.
SILENT_AGENTS_S = 60.0
# "lost": the scheduler went silent before ending the run (storage.jobs.silent.close_silent)
RUN_STATUSES = ("running", "finished", "erred", "lost")
TASK_FIELDS = (
    "key",
    "prefix",
    "group",
    "run",
    "worker",
    "thread",
    "status",
    "nbytes",
    "typename",
    "startstops",
    "exception",
    "traceback",
    "attrs",
)


class BadCursor(ValueError):
    """A pagination cursor that this server did not hand out."""


def encode_cursor(*parts: Any) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(list(parts))).decode().rstrip("=")


def decode_cursor(cursor: str, types: tuple[type, ...]) -> list[Any]:
    try:
        parts = msgspec.json.decode(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise BadCursor(cursor) from None
    if not isinstance(parts, list) or len(parts) != len(types):
        raise BadCursor(cursor)
    out = []
    for value, kind in zip(parts, types, strict=True):
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadCursor(cursor)
        if kind is int and not -(2**63) <= value < 2**63:  # SQLite raised OverflowError: a 500
            raise BadCursor(cursor)
        out.append(value)
    return out


def list_clusters(db: Session, tenant_id: int) -> list[dict[str, Any]]:
    runs = (
        select(
            m.Run.cluster_id,
            func.count().label("runs"),
            func.max(m.Run.started_at).label("last_run"),
        )
        .where(m.Run.tenant_id == tenant_id)
        .group_by(m.Run.cluster_id)
        .subquery()
    )
    sessions = (
        select(m.Session.cluster_id, func.count().label("sessions"))
        .join(m.Cluster, m.Cluster.id == m.Session.cluster_id)
        .where(m.Cluster.tenant_id == tenant_id)
        .group_by(m.Session.cluster_id)
        .subquery()
    )
    rows = db.execute(
        select(m.Cluster, runs.c.runs, runs.c.last_run, sessions.c.sessions)
        .outerjoin(runs, runs.c.cluster_id == m.Cluster.id)
        .outerjoin(sessions, sessions.c.cluster_id == m.Cluster.id)
        .where(m.Cluster.tenant_id == tenant_id)
        # A cluster whose every session retention removed is gone (its row stays, for a
        # collector that may still hold its id).
        .where(or_(sessions.c.sessions.is_not(None), runs.c.runs.is_not(None)))
        .order_by(m.Cluster.name)
    ).all()
    return [
        {
            "name": c.name,
            "first_seen": c.first_seen,
            "last_seen": c.last_seen,
            "sessions": n_sessions or 0,
            "runs": n_runs or 0,
            "last_run_started_at": last_run,
        }
        for c, n_runs, last_run, n_sessions in rows
    ]


def _run_select(tenant_id: int) -> Select[Any]:
    return (
        select(m.Run, m.Cluster.name.label("cluster"), m.Session.name.label("session"))
        .join(m.Cluster, m.Cluster.id == m.Run.cluster_id)
        .join(m.Session, m.Session.id == m.Run.session_id)
        .where(m.Run.tenant_id == tenant_id)
    )


def run_summary(run: m.Run, cluster: str, session: str) -> dict[str, Any]:
    return {
        "id": run.public_id,
        "name": display_name(run.name, run.run_key),
        "cluster": cluster,
        "session": session,
        "run_key": run.run_key,
        "status": run.status,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "makespan": makespan(run.task_start, run.task_stop),
        "task_count": run.task_count,
        "error_count": run.error_count,
        "nbytes": run.nbytes,
        "span": run.span or [],
        "client": run.client,
    }


RUN_SORTS = (
    "-started_at",
    "started_at",
    "-makespan",
    "makespan",
    "-task_count",
    "task_count",
    "-error_count",
    "error_count",
)


@dataclass
class RunFilters:
    cluster: str | None = None
    status: str | None = None
    since: float | None = None
    until: float | None = None
    # exact name; a trailing "*" matches names starting with the rest
    name: str | None = None
    min_duration: float | None = None  # makespan in seconds
    has_errors: bool | None = None


def _sort_column(sort: str) -> Any:
    col = sort.lstrip("-")
    if col == "makespan":
        # Runs without task times sort as makespan -1 (last when descending).
        return func.coalesce(makespan_column(), -1.0)
    return {
        "started_at": m.Run.started_at,
        "task_count": m.Run.task_count,
        "error_count": m.Run.error_count,
    }[col]


def list_runs(
    db: Session,
    tenant_id: int,
    filters: RunFilters,
    limit: int,
    cursor: str | None,
    sort: str = "-started_at",
) -> tuple[list[dict[str, Any]], str | None]:
    """Runs filtered and sorted (newest first by default); keyset pagination on
    (sort value, id), the cursor naming its sort so it cannot be replayed on another."""
    q = _run_select(tenant_id)
    if filters.cluster is not None:
        q = q.where(m.Cluster.name == filters.cluster)
    if filters.status is not None:
        q = q.where(m.Run.status == filters.status)
    if filters.since is not None:
        q = q.where(m.Run.started_at >= filters.since)
    if filters.until is not None:
        q = q.where(m.Run.started_at < filters.until)
    if filters.name is not None:
        if filters.name.endswith("*"):
            stem = filters.name[:-1].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            q = q.where(m.Run.name.like(stem + "%", escape="\\"))
        else:
            q = q.where(m.Run.name == filters.name)
    if filters.min_duration is not None:
        q = q.where(makespan_column() >= filters.min_duration)
    if filters.has_errors is not None:
        q = q.where(m.Run.error_count > 0 if filters.has_errors else m.Run.error_count == 0)
    col = _sort_column(sort)
    desc = sort.startswith("-")
    if cursor:
        got_sort, at, rid = decode_cursor(cursor, (str, float, int))
        if got_sort != sort:
            raise BadCursor(cursor)
        if desc:
            q = q.where(or_(col < at, and_(col == at, m.Run.id < rid)))
        else:
            q = q.where(or_(col > at, and_(col == at, m.Run.id > rid)))
    order = (col.desc(), m.Run.id.desc()) if desc else (col.asc(), m.Run.id.asc())
    rows = db.execute(
        q.add_columns(col.label("sort_value")).order_by(*order).limit(limit + 1)
    ).all()
    page = rows[:limit]
    next_cursor = None
    if len(rows) > limit:
        last = page[-1]
        next_cursor = encode_cursor(sort, float(last[3]), last[0].id)
    return [run_summary(r, c, s) for r, c, s, _ in page], next_cursor


def find_run(db: Session, tenant_id: int, public_id: str) -> tuple[m.Run, str, str] | None:
    row = db.execute(_run_select(tenant_id).where(m.Run.public_id == public_id)).first()
    return None if row is None else (row[0], row[1], row[2])


def completeness(db: Session, session_id: int) -> dict[str, Any]:
    """Batches received vs. expected per agent of the run's session, from sequence numbers.

    An agent's expected count is its highest sequence number + 1; a gap means a lost
    batch. ``final`` says the agent closed cleanly, so no batches are missing at its end.
    """
    agents = db.execute(
        select(m.Agent).where(m.Agent.session_id == session_id).order_by(m.Agent.name)
    ).scalars()
    out = []
    received = expected = dropped_total = 0
    for a in agents:
        exp = max(a.max_seq, a.final_seq if a.final_seq is not None else -1) + 1
        dropped = {k: int(v) for k, v in (a.dropped or {}).items()}
        received += a.batches
        expected += exp
        dropped_total += sum(dropped.values())
        out.append(
            {
                "agent": a.name,
                "batches_received": a.batches,
                "batches_expected": exp,
                "missing": exp - a.batches,
                "final": a.final_seq is not None,
                "events_dropped": dropped,
            }
        )
    silent = _silent_workers(db, session_id, [a["agent"] for a in out])
    return {
        "batches_received": received,
        "batches_expected": expected,
        "ratio": (received / expected) if expected else 1.0,
        "closed": bool(out) and all(a["final"] for a in out) and not silent,
        "events_dropped_at_agents": dropped_total,
        "agents": out,
        "workers_without_batches": silent,
    }


def _worker_agent_prefix(name: str) -> str:
    """How the agent of the Dask worker named ``name`` is named (hindsight.dask gives it
    ``worker-{name}``), up to its random part."""
    return agent_name_prefix(f"worker-{name}")


def _silent_workers(db: Session, session_id: int, agents: list[str]) -> list[str]:
    """Addresses of the session's workers that have left without a batch of their own
    arriving (killed before their agent's first batch got through, or closed while the
    collector was away: their batches wait in a spool). An agent that delivered nothing
    would otherwise not be listed at all, and completeness would read whole. A worker still
    in the cluster may not have sent yet; it is not listed."""
    if not any(a.startswith("scheduler-") for a in agents):
        return []  # not Dask's agents (Ray's, another scheduler's): no worker agents
    W = m.Worker
    rows = db.execute(
        select(W.address, W.name, W.left_at).where(
            W.session_id == session_id, W.left_at.is_not(None), W.name.is_not(None)
        )
    ).all()
    if not rows:
        return []
    # A nanny restarts a killed worker under its name: the new worker's agent is not the
    # dead one's and must not hide it. An agent whose first batch begins after
    # the worker left is another process's.
    A = m.Agent
    first = {
        a: lo
        for a, (lo, _) in manifest.agent_times(
            db, A.session_id == session_id, A.name.like("worker-%")
        ).items()
    }
    return sorted(
        address
        for address, name, left in rows
        if not any(
            a.startswith(_worker_agent_prefix(name)) and (first.get(a) is None or first[a] <= left)
            for a in agents
        )
    )


def unclosed_worker_agents(db: Session, run: m.Run, completeness: dict[str, Any]) -> list[str]:
    """The agents of ``run``'s workers that never sent their last batch though the
    scheduler's agent did (the cluster closed): a killed worker, or batches waiting in a
    spool: such a run must not read "100% of batches". Only this
    run's workers, and of them the agents whose events reach into
    the run: a nanny restarts a killed worker under its name, and the killed one's agent
    is not a later run's loss, nor the loss of a run its
    batches reach past the end of. While the cluster lives, none."""
    agents = completeness.get("agents") or []
    if not any(a["final"] and a["agent"].startswith("scheduler-") for a in agents):
        return []
    unclosed = [a["agent"] for a in agents if not a["final"] and a["agent"].startswith("worker-")]
    if not unclosed:
        return []
    W = m.Worker
    used = [w.worker for w in packed.run_workers(db, [run.id]).get(run.id, [])]
    names = db.scalars(
        select(W.name).where(
            W.session_id == run.session_id, W.address.in_(used), W.name.is_not(None)
        )
    ).all()
    prefixes = tuple(_worker_agent_prefix(n) for n in names)
    mine = [a for a in unclosed if prefixes and a.startswith(prefixes)]
    if not mine or run.started_at is None:
        return mine
    A = m.Agent
    last = {
        a: hi
        for a, (_, hi) in manifest.agent_times(
            db, A.session_id == run.session_id, A.name.in_(mine)
        ).items()
    }
    # Its events reach into the run and stop before the run's end: what it held at the
    # end may be the run's. One whose batches run past the run's end (an adaptive
    # cluster's worker, retired after the run and killed by its nanny 4 s into closing)
    # lost nothing of it.
    end = run.finished_at if run.finished_at is not None else float("inf")
    return [a for a in mine if last.get(a) is None or run.started_at <= last[a] < end]


def run_completeness(db: Session, run: m.Run, silence: float = SILENT_AGENTS_S) -> dict[str, Any]:
    """The session's completeness, with ``closed`` and ``workers_without_batches`` for
    ``run`` (Dask's agents): a worker agent that never closed counts only if it is the
    run's (``unclosed_worker_agents``, also listed), a worker that left with no batch only
    if it was there during the run: a worker killed early in a session is not the loss of
    every later run of it."""
    out = completeness(db, run.session_id)
    agents = out["agents"]
    if not any(a["agent"].startswith("scheduler-") for a in agents):
        out["unclosed_worker_agents"] = []
        return out  # not Dask's agents: no run's own workers to tell apart
    silent = out["workers_without_batches"]
    if silent and run.started_at is not None:
        # there during the run: left after it started, joined before it ended
        W = m.Worker
        end = run.finished_at if run.finished_at is not None else float("inf")
        there = set(
            db.scalars(
                select(W.address).where(
                    W.session_id == run.session_id,
                    W.address.in_(silent),
                    or_(W.left_at.is_(None), W.left_at >= run.started_at),
                    or_(W.joined_at.is_(None), W.joined_at <= end),
                )
            ).all()
        )
        silent = [a for a in silent if a in there]
    unclosed = unclosed_worker_agents(db, run, out)
    out.update(
        workers_without_batches=silent,
        unclosed_worker_agents=unclosed,
        closed=bool(agents)
        and all(a["final"] for a in agents if not a["agent"].startswith("worker-"))
        and not unclosed
        and not silent,
    )
    out["silent_since"] = agents_silent_since(db, run, silence=silence)
    return out


def agents_silent_since(
    db: Session, run: m.Run, now: float | None = None, silence: float = SILENT_AGENTS_S
) -> float | None:
    """When the agents of a run left open (``running``, or ``lost``: closed for silence)
    were last heard from, once nothing came for ``silence`` seconds: whatever they sent
    after that (the run's end among it) waits in a spool or is lost, so the run's batches
    are not whole however many of the ones sent arrived. None for a run its scheduler
    ended, or one still heard from."""
    if run.status not in ("running", "lost"):
        return None
    heard = db.scalar(select(m.Session.last_seen).where(m.Session.id == run.session_id))
    now = time.time() if now is None else now
    return heard if heard is not None and heard < now - silence else None


def finished_work(db: Session, run: m.Run) -> dict[str, Any]:
    """Whether the run's finished-run work (``storage.jobs.finish``: compacted copy, ...) is
    done for its current data (``done_at``) or still queued (``pending``)."""
    pending = db.execute(select(m.FinishJob.run_id).where(m.FinishJob.run_id == run.id)).first()
    return {"pending": pending is not None, "done_at": run.finished_work_at}


def run_detail(
    db: Session, run: m.Run, cluster: str, session: str, silence: float = SILENT_AGENTS_S
) -> dict[str, Any]:
    """What ``GET /v1/runs/{id}`` answers; ``silence``: see :func:`agents_silent_since`."""
    detail = run_summary(run, cluster, session)
    statuses = db.execute(
        select(m.RunStatusCount.status, m.RunStatusCount.count).where(
            m.RunStatusCount.run_id == run.id
        )
    ).all()
    prefixes: dict[str, dict[str, Any]] = {}
    for p in db.execute(
        select(m.RunPrefix).where(m.RunPrefix.run_id == run.id).order_by(m.RunPrefix.prefix)
    ).scalars():
        prefixes[p.prefix] = {
            "prefix": p.prefix,
            "count": p.count,
            "errors": p.errors,
            "nbytes": p.nbytes,
            "actions": {},
        }
    for a in db.execute(
        select(m.RunPrefixAction).where(m.RunPrefixAction.run_id == run.id)
    ).scalars():
        entry = prefixes.setdefault(
            a.prefix, {"prefix": a.prefix, "count": 0, "errors": 0, "nbytes": 0, "actions": {}}
        )
        entry["actions"][a.action] = {
            "count": a.count,
            "total": a.total,
            "min": a.min,
            "max": a.max,
        }
    totals: dict[str, float] = {}
    for entry in prefixes.values():
        for action, a in entry["actions"].items():
            totals[action] = totals.get(action, 0.0) + a["total"]
    workers = [
        {
            "worker": w.worker,
            "tasks": w.tasks,
            "errors": w.errors,
            "compute": w.compute,
            "transfer": w.transfer,
            "disk_read": w.disk_read,
            "disk_write": w.disk_write,
            "first_start": w.first_start,
            "last_stop": w.last_stop,
        }
        for w in packed.run_workers(db, [run.id]).get(run.id, [])
    ]
    detail.update(
        tasks_by_status={s: c for s, c in sorted(statuses)},
        graph_count=run.graph_count,
        seconds_by_action=seconds_by_action(totals),
        workers_used=len(workers),
        workers=workers,
        fingerprint=fingerprint(run.name, run.run_key, prefixes),
        prefixes=list(prefixes.values()),
        completeness=run_completeness(db, run, silence),
        finished_work=finished_work(db, run),
        first_seen=run.first_seen,
        last_seen=run.last_seen,
    )
    ray_read.extend_detail(db, run, detail)
    return detail


def task_record(ev: TaskEvent) -> dict[str, Any]:
    rec = {f: getattr(ev, f) for f in TASK_FIELDS}
    rec["startstops"] = msgspec.to_builtins(ev.startstops)  # "source" only where present
    return rec


def iter_run_tasks(
    db: Session, blobs: BlobStore, run: m.Run, cursor: str | None
) -> Iterator[tuple[dict[str, Any], str]]:
    """The run's task records from the blob store, each with the cursor that follows it."""
    after_batch, skip = decode_cursor(cursor, (int, int)) if cursor else (0, 0)
    rows = packed.batch_keys(
        db,
        run.session_id,
        [b for b, tasks in packed.run_batches(db, run.id) if b >= after_batch and tasks > 0],
    )
    run_key = run.run_key
    for batch_id, key in rows:
        batch = decode_stored(blobs.get(key))
        n = 0
        for ev in batch.events:
            if type(ev) is TaskEvent and (ev.run or DEFAULT_RUN) == run_key:
                n += 1
                if batch_id == after_batch and n <= skip:
                    continue
                yield task_record(ev), encode_cursor(batch_id, n)
