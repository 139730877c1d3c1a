"""What each event of a Ray exporter body says about a session's jobs, tasks, nodes,
workers and actors, merged per body before anything touches the index.

Ray retries a refused body forever, so nothing here rejects an event: an event of a type we
do not index, or one we cannot read (``storage.ray.wire``), is counted (``skipped``) and
left in the stored body. Every patch merges the way the index merges it
(``storage.ray.statements``): values are set while unset, times take the earliest, so the
order of events within and across bodies does not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hindsight.schema import valid_name
from storage.ray.wire import (
    DRIVER_TASK_PREFIX,
    MAX_ID_BYTES,
    MAX_TEXT,
    clean,
    decoders,
    func_name,
    is_driver_task,
    positive_int,
    ray_id,
    seconds,
    split_array,
    uncoloured,
)

TASK_TYPES = ("TASK_DEFINITION_EVENT", "TASK_LIFECYCLE_EVENT", "ACTOR_TASK_DEFINITION_EVENT")
INDEXED_TYPES = (
    *TASK_TYPES,
    "DRIVER_JOB_DEFINITION_EVENT",
    "DRIVER_JOB_LIFECYCLE_EVENT",
    "NODE_DEFINITION_EVENT",
    "NODE_LIFECYCLE_EVENT",
    "WORKER_DEFINITION_EVENT",
    "WORKER_LIFECYCLE_EVENT",
    "ACTOR_DEFINITION_EVENT",
    "ACTOR_LIFECYCLE_EVENT",
)
_KNOWN = frozenset(INDEXED_TYPES)


class TaskPatch(msgspec.Struct, omit_defaults=True, gc=False):
    """What a body says about one task attempt. Field names are ``ray_tasks`` columns: the
    patches are encoded as they are (msgspec; unset fields left out, which Postgres reads
    as NULL) for Postgres to read as a record set."""

    task_id: str
    attempt: int
    job_id: str | None = None
    defined: bool = False
    name: str | None = None
    func: str | None = None
    module: str | None = None
    task_type: str | None = None
    parent_id: str | None = None
    actor_id: str | None = None
    node_id: str | None = None
    worker_id: str | None = None
    pid: int | None = None
    pending_at: float | None = None
    submitted_at: float | None = None
    running_at: float | None = None
    finished_at: float | None = None
    failed_at: float | None = None
    error_type: str | None = None
    error_message: str | None = None


@dataclass(slots=True)
class JobPatch:
    entrypoint: str | None = None
    driver_pid: int | None = None
    driver_node: str | None = None
    created_at: float | None = None
    finished_at: float | None = None
    driver_exit_at: float | None = None


@dataclass(slots=True)
class NodePatch:
    ip: str | None = None
    hostname: str | None = None
    name: str | None = None
    started_at: float | None = None
    alive_at: float | None = None
    dead_at: float | None = None
    death_reason: str | None = None
    resources: dict[str, float] | None = None


@dataclass(slots=True)
class WorkerPatch:
    node: str | None = None
    pid: int | None = None
    worker_type: str | None = None
    job: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exit_type: str | None = None
    exit_detail: str | None = None


@dataclass(slots=True)
class ActorPatch:
    job: str | None = None
    class_name: str | None = None
    name: str | None = None
    node: str | None = None
    worker: str | None = None
    pid: int | None = None
    alive_at: float | None = None
    dead_at: float | None = None


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a <= b else b


@dataclass
class SessionPart:
    """What one body says about one Ray session, merged, plus its events' exact bytes."""

    session: str
    # each event's bytes, or (one session, from ``parse`` without elements) its position
    raw: list[Any] = field(default_factory=list)
    tasks: dict[tuple[str, int], TaskPatch] = field(default_factory=dict)
    jobs: dict[str, JobPatch] = field(default_factory=dict)
    nodes: dict[str, NodePatch] = field(default_factory=dict)
    workers: dict[str, WorkerPatch] = field(default_factory=dict)
    actors: dict[str, ActorPatch] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def indexed(self) -> int:
        return sum(self.received.values()) - sum(self.skipped.values())

    def job(self, job_id: str) -> JobPatch:
        j = self.jobs.get(job_id)
        if j is None:
            j = self.jobs[job_id] = JobPatch()
        return j

    def task(self, task_id: str, attempt: int) -> TaskPatch:
        key = (task_id, attempt)
        t = self.tasks.get(key)
        if t is None:
            t = self.tasks[key] = TaskPatch(task_id, attempt)
        return t


NO_SESSION = "_unknown"  # events without a usable sessionName: stored, counted, not indexed
MAX_SESSIONS = 16  # per body; events of further sessions are stored and counted, not indexed


def _count(d: dict[str, int], key: str) -> None:
    d[key] = d.get(key, 0) + 1


def parse(body: bytes, elements: list[msgspec.Raw] | None = None) -> dict[str, SessionPart]:
    """Every event of a body, merged per session. Never raises for an event: what cannot be
    read is counted as skipped (``malformed``), what we do not index by its type; raises
    ``storage.ray.wire.NotAnArray`` for a body that is not a JSON array.

    Without ``elements`` the body is split into its events' bytes only when they are needed
    (a body that failed to decode whole, or one of several sessions): a part's ``raw``
    holds the events' positions until then. Ray's bodies are one session, and splitting
    one cost ~a tenth of decoding it."""
    many, one = decoders(body)
    events: list[Any] | None = None
    try:
        events = many.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        if elements is None:
            elements = split_array(body)
    if events is None:
        assert elements is not None
        events = []
        for raw in elements:
            try:
                events.append(one.decode(raw))
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                events.append(None)
    parts: dict[str, SessionPart] = {}
    last_session, part = None, None  # consecutive events nearly always share a session
    positions = elements if elements is not None else range(len(events))
    for raw, ev in zip(positions, events, strict=True):
        session = ev.session_name if ev is not None else ""
        if session != last_session:
            last_session = session
            if not session or not valid_name(session):
                session = NO_SESSION
            part = parts.get(session)
            if part is None:
                part = parts[session] = SessionPart(session)
        assert part is not None
        session = part.session
        part.raw.append(raw)
        if ev is None:
            _count(part.received, "malformed")
            _count(part.skipped, "malformed")
            continue
        etype = ev.event_type
        if etype not in _KNOWN:
            etype = clean(etype, 128) or "EVENT_TYPE_UNSPECIFIED"
        received = part.received
        received[etype] = received.get(etype, 0) + 1
        if session == NO_SESSION:
            _count(part.skipped, etype)
            continue
        if etype == "TASK_LIFECYCLE_EVENT":  # two thirds of all events: no dispatch
            d = ev.task_lifecycle_event
            if d is not None:
                _task_lifecycle(part, ev, d)
                continue
        if not _apply(part, ev, etype):
            _count(part.skipped, etype)
    orphans = parts.pop(NO_SESSION, None)
    if len(parts) > MAX_SESSIONS:
        # Ray sends one session a body; a body naming hundreds would cost a blob each.
        keep = sorted(parts.values(), key=lambda p: -len(p.raw))[:MAX_SESSIONS]
        extra = [p for p in parts.values() if p not in keep]
        parts = {p.session: p for p in keep}
        orphans = orphans or SessionPart(NO_SESSION)
        for p in extra:
            orphans.raw += p.raw
            for k, n in p.received.items():
                orphans.received[k] = orphans.received.get(k, 0) + n
            orphans.skipped["too_many_sessions"] = orphans.skipped.get(
                "too_many_sessions", 0
            ) + len(p.raw)
    if orphans is not None:
        if not parts:
            return {NO_SESSION: orphans}
        # Events without a session (unreadable ones, mostly) stay with the body's main
        # session: a one-session body is then still stored byte for byte.
        main = max(parts.values(), key=lambda p: len(p.raw))
        main.raw += orphans.raw
        for kind in ("received", "skipped"):
            mine, theirs = getattr(main, kind), getattr(orphans, kind)
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
    if elements is None and len(parts) > 1:  # each part is stored as its events' bytes
        elements = split_array(body)
        for p in parts.values():
            p.raw = [elements[i] for i in p.raw]
    return parts


def _task_definition(part: SessionPart, ev: Any, d: Any) -> bool:
    tid = ray_id(d.task_id)
    if tid is None:
        return False
    job = ray_id(d.job_id)
    if d.task_type == "DRIVER_TASK" or is_driver_task(d.task_id):
        if job is not None:
            part.job(job)
        return True
    t = part.task(tid, d.task_attempt)
    func, module = func_name(d.task_func)
    t.defined = True
    t.job_id = t.job_id or job
    t.name = t.name or clean(d.task_name) or func
    t.func = t.func or func
    t.module = t.module or module
    t.task_type = t.task_type or clean(d.task_type, 32)
    t.parent_id = t.parent_id or ray_id(d.parent_task_id)
    if d.task_type == "ACTOR_CREATION_TASK" and len(d.task_id) == 24:
        # Ray's creation task id is 8 nil bytes and the actor's id (TaskID::
        # ForActorCreationTask); the definition names no actor.
        t.actor_id = t.actor_id or ray_id(d.task_id[8:])
    return True


def _actor_task_definition(part: SessionPart, ev: Any, d: Any) -> bool:
    tid = ray_id(d.task_id)
    if tid is None:
        return False
    t = part.task(tid, d.task_attempt)
    func, module = func_name(d.actor_func)
    t.defined = True
    t.job_id = t.job_id or ray_id(d.job_id)
    t.name = t.name or clean(d.actor_task_name) or func
    t.func = t.func or func
    t.module = t.module or module
    t.task_type = t.task_type or "ACTOR_TASK"
    t.parent_id = t.parent_id or ray_id(d.parent_task_id)
    t.actor_id = t.actor_id or ray_id(d.actor_id)
    return True


def _job_definition(part: SessionPart, ev: Any, d: Any) -> bool:
    job = ray_id(d.job_id)
    if job is None:
        return False
    j = part.job(job)
    j.entrypoint = j.entrypoint or clean(d.entrypoint, MAX_TEXT)
    j.driver_pid = j.driver_pid or positive_int(d.driver_pid)
    j.driver_node = j.driver_node or ray_id(d.driver_node_id)
    return True


def _job_lifecycle(part: SessionPart, ev: Any, d: Any) -> bool:
    job = ray_id(d.job_id)
    if job is None:
        return False
    j = part.job(job)
    for s in d.state_transitions:
        if s.state == "CREATED":
            j.created_at = _min(j.created_at, seconds(s.timestamp))
        elif s.state == "FINISHED":
            j.finished_at = _min(j.finished_at, seconds(s.timestamp))
    return True


def _node_definition(part: SessionPart, ev: Any, d: Any) -> bool:
    node = ray_id(d.node_id)
    if node is None:
        return False
    n = part.nodes.setdefault(node, NodePatch())
    n.ip = n.ip or clean(d.node_ip_address, 256)
    n.hostname = n.hostname or clean(d.hostname)
    n.name = n.name or clean(d.node_name)
    n.started_at = _min(n.started_at, seconds(d.start_timestamp))
    return True


def _node_lifecycle(part: SessionPart, ev: Any, d: Any) -> bool:
    node = ray_id(d.node_id)
    if node is None:
        return False
    n = part.nodes.setdefault(node, NodePatch())
    for s in d.state_transitions:
        if s.state == "ALIVE":
            n.alive_at = _min(n.alive_at, seconds(s.timestamp))
            if s.resources and n.resources is None:
                n.resources = dict(s.resources)
        elif s.state == "DEAD":
            n.dead_at = _min(n.dead_at, seconds(s.timestamp))
            if s.death_info is not None and n.death_reason is None:
                n.death_reason = clean(
                    " ".join(x for x in (s.death_info.reason, s.death_info.reason_message) if x),
                    MAX_TEXT,
                )
    return True


def _worker_definition(part: SessionPart, ev: Any, d: Any) -> bool:
    wid = ray_id(d.worker_id)
    if wid is None:
        return False
    w = part.workers.setdefault(wid, WorkerPatch())
    w.node = w.node or ray_id(d.node_id)
    w.pid = w.pid or positive_int(d.pid)
    w.worker_type = w.worker_type or clean(d.worker_type, 32)
    return True


def _worker_lifecycle(part: SessionPart, ev: Any, d: Any) -> bool:
    wid = ray_id(d.worker_id)
    if wid is None:
        return False
    w = part.workers.setdefault(wid, WorkerPatch())
    w.job = w.job or ray_id(d.job_id)
    for s in d.state_transitions:
        if s.state == "ALIVE":
            ms = positive_int(s.start_time_ms)
            w.started_at = _min(w.started_at, ms / 1000 if ms else seconds(s.timestamp))
        elif s.state == "DEAD":
            ms = positive_int(s.end_time_ms)
            w.ended_at = _min(w.ended_at, ms / 1000 if ms else seconds(s.timestamp))
            if s.death_info is not None:
                w.exit_type = w.exit_type or clean(s.death_info.exit_type, 64)
                # Ray colours a user error's detail for a terminal: not for a page
                detail = uncoloured(s.death_info.exit_detail or "")
                w.exit_detail = w.exit_detail or clean(detail, MAX_TEXT)
    return True


def _actor_definition(part: SessionPart, ev: Any, d: Any) -> bool:
    aid = ray_id(d.actor_id)
    if aid is None:
        return False
    a = part.actors.setdefault(aid, ActorPatch())
    a.job = a.job or ray_id(d.job_id)
    a.class_name = a.class_name or clean(d.class_name)
    a.name = a.name or clean(d.name)
    return True


def _actor_lifecycle(part: SessionPart, ev: Any, d: Any) -> bool:
    aid = ray_id(d.actor_id)
    if aid is None:
        return False
    a = part.actors.setdefault(aid, ActorPatch())
    for s in d.state_transitions:
        if s.state == "ALIVE":
            a.alive_at = _min(a.alive_at, seconds(s.timestamp))
            a.node = a.node or ray_id(s.node_id)
            a.worker = a.worker or ray_id(s.worker_id)
            a.pid = a.pid or positive_int(s.pid)
        elif s.state == "DEAD":
            a.dead_at = _min(a.dead_at, seconds(s.timestamp))
    return True


def _task_lifecycle(part: SessionPart, ev: Any, d: Any) -> bool:
    # The hottest loop of Ray ingest (two thirds of all events): locals, no helper calls
    # for the common cases.
    task_id = d.task_id
    if len(task_id) > 20 and task_id.startswith(DRIVER_TASK_PREFIX):  # a driver's (is_driver_task)
        job = ray_id(d.job_id)
        if job is not None:
            j = part.job(job)
            for s in d.state_transitions:
                if s.state in ("FINISHED", "FAILED"):
                    j.driver_exit_at = _min(j.driver_exit_at, seconds(s.timestamp))
        return True
    # ray_id, uncached: a task's id comes in a few events at most (the cache only churned)
    if not task_id or len(task_id) > MAX_ID_BYTES or task_id.count(0xFF) == len(task_id):
        return True
    tid = task_id.hex()
    key = (tid, d.task_attempt)
    t = part.tasks.get(key)
    if t is None:
        t = part.tasks[key] = TaskPatch(tid, key[1])
    if t.job_id is None:
        t.job_id = ray_id(d.job_id)
    pid = d.worker_pid
    if type(pid) is not int or not 0 < pid < 2**53:
        pid = positive_int(pid)
    if pid:
        # Sent by the worker that runs the task: its node is the event's own node.
        t.pid = t.pid or pid
        t.node_id = t.node_id or ray_id(d.node_id) or ray_id(ev.node_id)
    else:
        t.node_id = t.node_id or ray_id(d.node_id)
    t.worker_id = t.worker_id or ray_id(d.worker_id)
    for s in d.state_transitions:
        if s.timestamp is None:
            continue
        state = s.state
        ts = s.timestamp.timestamp()
        if state == "RUNNING":
            if t.running_at is None or ts < t.running_at:
                t.running_at = ts
        elif state == "FINISHED":
            if t.finished_at is None or ts < t.finished_at:
                t.finished_at = ts
        elif state == "FAILED":
            if t.failed_at is None or ts < t.failed_at:
                t.failed_at = ts
        elif state == "SUBMITTED_TO_WORKER":
            if t.submitted_at is None or ts < t.submitted_at:
                t.submitted_at = ts
        elif state.startswith("PENDING"):
            if t.pending_at is None or ts < t.pending_at:
                t.pending_at = ts
    info = d.ray_error_info
    if info is not None and (info.error_type or info.error_message):
        t.error_type = t.error_type or clean(info.error_type, 128)
        t.error_message = t.error_message or clean(info.error_message, MAX_TEXT)
    return True


Handler = Callable[[SessionPart, Any, Any], bool]
#: Each indexed event type: the field holding what it says, and the handler that merges
#: that into the session's part (False: it says nothing we index).
HANDLERS: dict[str, tuple[str, Handler]] = {
    "TASK_LIFECYCLE_EVENT": ("task_lifecycle_event", _task_lifecycle),
    "TASK_DEFINITION_EVENT": ("task_definition_event", _task_definition),
    "ACTOR_TASK_DEFINITION_EVENT": ("actor_task_definition_event", _actor_task_definition),
    "DRIVER_JOB_DEFINITION_EVENT": ("driver_job_definition_event", _job_definition),
    "DRIVER_JOB_LIFECYCLE_EVENT": ("driver_job_lifecycle_event", _job_lifecycle),
    "NODE_DEFINITION_EVENT": ("node_definition_event", _node_definition),
    "NODE_LIFECYCLE_EVENT": ("node_lifecycle_event", _node_lifecycle),
    "WORKER_DEFINITION_EVENT": ("worker_definition_event", _worker_definition),
    "WORKER_LIFECYCLE_EVENT": ("worker_lifecycle_event", _worker_lifecycle),
    "ACTOR_DEFINITION_EVENT": ("actor_definition_event", _actor_definition),
    "ACTOR_LIFECYCLE_EVENT": ("actor_lifecycle_event", _actor_lifecycle),
}


def _apply(part: SessionPart, ev: Any, etype: str) -> bool:
    """Merge one event into ``part``; False if it says nothing we index."""
    handler = HANDLERS.get(etype)
    if handler is None:
        return False
    name, merge = handler
    detail = getattr(ev, name)
    return detail is not None and merge(part, ev, detail)
