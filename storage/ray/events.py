"""Ray's exporter bodies, read leniently: what each event says about a session's jobs,
tasks, nodes, workers and actors, merged per body before anything touches the index.

Ray's aggregator agent POSTs a JSON array of ``RayEvent`` messages (protobuf JSON: camelCase
field names, or snake_case with ``..._PRESERVE_PROTO_FIELD_NAME=1``; ids as base64 of the
raw bytes; 64-bit integers as strings; RFC 3339 timestamps with nanoseconds). It retries a
refused body forever, so nothing here rejects an event: an event of a type we do not index,
or one we cannot read, is counted (``skipped``) and left in the stored body.

Every patch merges the way the index merges it (``storage/ray/bridge.py``): values are set while
unset, times take the earliest, so the order of events within and across bodies does not
matter.
"""

# No ``from __future__ import annotations`` here: the message classes are built inside a
# function (one family per field-name spelling), and msgspec resolves string annotations
# in the module's namespace, where those local classes are not.
import functools
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any

import msgspec

from hindsight.schema import valid_name

# A refused body blocks a node's exporter for good: this decoder only asks for an array.
_array = msgspec.json.Decoder(list[msgspec.Raw])
# ``ray_tasks.attempt`` is a 32-bit integer: an event with an attempt it cannot hold is read
# as unreadable (counted, skipped), not left to fail the index on every retry of its body.
Attempt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
#: Ray's ids are 4-28 bytes; the index holds up to 32 (64 hex characters).
MAX_ID_BYTES = 32

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
MAX_TEXT = 65536
MAX_LABEL = 1024
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NotAnArray(ValueError):
    """The body is not a JSON array (the one thing a Ray body must be)."""


#: :class:`NotAnArray`'s reason for a body nested past what the reader takes.
TOO_DEEP = "nested too deeply"


def split_array(body: bytes) -> list[msgspec.Raw]:
    """The elements of a JSON array, each as its exact bytes; :class:`NotAnArray` otherwise."""
    try:
        return _array.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise NotAnArray(str(exc)) from None
    except RecursionError:  # msgspec's limit on nesting: the array cannot be split
        raise NotAnArray(TOO_DEEP) from None


# ------------------------------------------------------------------ the wire, leniently


def _structs(rename: str | None) -> Any:
    """The message classes for one field-name spelling (``"camel"`` or as in the .proto).

    Only the fields the index uses are declared; msgspec skips the rest, so a new field in
    a later Ray version changes nothing. Types are loose where protobuf JSON varies (int64
    as a string, or as a number from other encoders)."""
    opts: dict[str, Any] = {"rename": rename, "gc": False}

    class Transition(msgspec.Struct, **opts):  # type: ignore[misc]
        state: str = ""
        timestamp: datetime | None = None

    class ErrorInfo(msgspec.Struct, **opts):  # type: ignore[misc]
        error_message: str = ""
        error_type: str = ""

    class PyFunc(msgspec.Struct, **opts):  # type: ignore[misc]
        module_name: str = ""
        class_name: str = ""
        function_name: str = ""

    class FuncDescriptor(msgspec.Struct, **opts):  # type: ignore[misc]
        python_function_descriptor: PyFunc | None = None
        java_function_descriptor: PyFunc | None = None
        cpp_function_descriptor: PyFunc | None = None

    class TaskDefinition(msgspec.Struct, **opts):  # type: ignore[misc]
        task_id: bytes = b""
        task_attempt: Attempt = 0
        task_type: str = ""
        task_func: FuncDescriptor | None = None
        task_name: str = ""
        job_id: bytes = b""
        parent_task_id: bytes = b""

    class ActorTaskDefinition(msgspec.Struct, **opts):  # type: ignore[misc]
        task_id: bytes = b""
        task_attempt: Attempt = 0
        actor_func: FuncDescriptor | None = None
        actor_task_name: str = ""
        job_id: bytes = b""
        actor_id: bytes = b""
        parent_task_id: bytes = b""

    class TaskLifecycle(msgspec.Struct, **opts):  # type: ignore[misc]
        task_id: bytes = b""
        task_attempt: Attempt = 0
        state_transitions: tuple[Transition, ...] = ()
        ray_error_info: ErrorInfo | None = None
        node_id: bytes = b""
        worker_id: bytes = b""
        worker_pid: int | str = 0
        job_id: bytes = b""

    class JobConfig(msgspec.Struct, **opts):  # type: ignore[misc]
        metadata: dict[str, str] = {}

    class JobDefinition(msgspec.Struct, **opts):  # type: ignore[misc]
        job_id: bytes = b""
        driver_pid: int | str = 0
        driver_node_id: bytes = b""
        entrypoint: str = ""
        config: JobConfig | None = None

    class JobLifecycle(msgspec.Struct, **opts):  # type: ignore[misc]
        job_id: bytes = b""
        state_transitions: tuple[Transition, ...] = ()

    class NodeDefinition(msgspec.Struct, **opts):  # type: ignore[misc]
        node_id: bytes = b""
        node_ip_address: str = ""
        hostname: str = ""
        node_name: str = ""
        start_timestamp: datetime | None = None

    class NodeDeath(msgspec.Struct, **opts):  # type: ignore[misc]
        reason: str = ""
        reason_message: str = ""

    class NodeTransition(msgspec.Struct, **opts):  # type: ignore[misc]
        state: str = ""
        timestamp: datetime | None = None
        resources: dict[str, float] = {}
        death_info: NodeDeath | None = None

    class NodeLifecycle(msgspec.Struct, **opts):  # type: ignore[misc]
        node_id: bytes = b""
        state_transitions: tuple[NodeTransition, ...] = ()

    class WorkerDefinition(msgspec.Struct, **opts):  # type: ignore[misc]
        worker_id: bytes = b""
        node_id: bytes = b""
        pid: int | str = 0
        worker_type: str = ""

    class WorkerDeath(msgspec.Struct, **opts):  # type: ignore[misc]
        exit_type: str = ""
        exit_detail: str = ""

    class WorkerTransition(msgspec.Struct, **opts):  # type: ignore[misc]
        state: str = ""
        timestamp: datetime | None = None
        start_time_ms: int | str = 0
        end_time_ms: int | str = 0
        death_info: WorkerDeath | None = None

    class WorkerLifecycle(msgspec.Struct, **opts):  # type: ignore[misc]
        worker_id: bytes = b""
        job_id: bytes = b""
        state_transitions: tuple[WorkerTransition, ...] = ()

    class ActorDefinition(msgspec.Struct, **opts):  # type: ignore[misc]
        actor_id: bytes = b""
        job_id: bytes = b""
        class_name: str = ""
        name: str = ""

    class ActorTransition(msgspec.Struct, **opts):  # type: ignore[misc]
        state: str = ""
        timestamp: datetime | None = None
        node_id: bytes = b""
        worker_id: bytes = b""
        pid: int | str = 0

    class ActorLifecycle(msgspec.Struct, **opts):  # type: ignore[misc]
        actor_id: bytes = b""
        state_transitions: tuple[ActorTransition, ...] = ()

    # An event's own id, source and time are not declared: nothing reads them (a body is
    # deduplicated by its content, a task by its id and attempt), and skipping them is
    # cheaper than reading them (a datetime an event).
    class Event(msgspec.Struct, **opts):  # type: ignore[misc]
        event_type: str = ""
        session_name: str = ""
        node_id: bytes = b""
        task_definition_event: TaskDefinition | None = None
        actor_task_definition_event: ActorTaskDefinition | None = None
        task_lifecycle_event: TaskLifecycle | None = None
        driver_job_definition_event: JobDefinition | None = None
        driver_job_lifecycle_event: JobLifecycle | None = None
        node_definition_event: NodeDefinition | None = None
        node_lifecycle_event: NodeLifecycle | None = None
        worker_definition_event: WorkerDefinition | None = None
        worker_lifecycle_event: WorkerLifecycle | None = None
        actor_definition_event: ActorDefinition | None = None
        actor_lifecycle_event: ActorLifecycle | None = None

    return msgspec.json.Decoder(list[Event]), msgspec.json.Decoder(Event)


_CAMEL = _structs("camel")
_SNAKE = _structs(None)


# ------------------------------------------------------------------ small conversions


@functools.lru_cache(maxsize=8192)
def _hex(value: bytes) -> str | None:
    """A Ray id as Ray prints it (hex), or None for an empty, nil (all 0xff) or over-long
    id (longer than any Ray id; the index could not hold it). Cached: job, node and worker
    ids repeat in nearly every event."""
    if not value or len(value) > MAX_ID_BYTES or value.count(0xFF) == len(value):
        return None
    return value.hex()


def _time(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _int(value: int | str) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if 0 < n < 2**53 else None


def clean(value: str | None, limit: int = MAX_LABEL) -> str | None:
    """A string the index and the protocol can hold: no NUL, at most ``limit`` characters."""
    if not value:
        return None
    if "\x00" in value:
        value = value.replace("\x00", "")
    return value[:limit] or None


def _func_name(desc: Any) -> tuple[str | None, str | None]:
    """(function, module): ``work`` or ``Counter.incr`` (the task prefix), and its module."""
    if desc is None:
        return None, None
    f = (
        desc.python_function_descriptor
        or desc.java_function_descriptor
        or desc.cpp_function_descriptor
    )
    if f is None or not f.function_name:
        return None, None
    fn, cls = f.function_name, f.class_name
    if f is desc.python_function_descriptor:  # as Ray's State API names it: the part after
        fn, cls = _short_name(fn), _short_name(cls)  # the last "." of each
    short = f"{cls}.{fn}" if cls else fn
    return clean(short), clean(f.module_name)


def _short_name(name: str) -> str:
    """``make.<locals>.inner`` -> ``inner``, ``Outer.Inner`` -> ``Inner``."""
    return name[name.rfind(".") + 1 :]


_NIL20 = b"\xff" * 20


def is_driver_task(task_id: bytes) -> bool:
    """A driver's task id: 20 nil bytes, then the job id."""
    return len(task_id) > 20 and task_id.startswith(_NIL20)


def error_summary(message: str | None, error_type: str | None) -> tuple[str | None, str | None]:
    """(exception, traceback) as Dask records them: the exception line (``ValueError: boom``)
    and the whole message, colour codes removed."""
    text = _ANSI.sub("", message) if message else ""
    lines = text.splitlines()
    # A Python traceback's last frame ('  File "...", line N, in f', then its indented
    # source lines), then the exception: its first line (a message may run over several).
    last = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=None)
    exception = None
    if last is not None:
        exception = next((x for x in lines[last + 1 :] if x.strip() and not x[:1].isspace()), None)
    if exception is None:  # no traceback: the message's last line
        exception = next((x for x in reversed(lines) if x.strip()), error_type)
    return clean(exception.strip() if exception else exception), clean(text, MAX_TEXT)


# ------------------------------------------------------------------ patches


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
    :class:`NotAnArray` for a body that is not a JSON array.

    Without ``elements`` the body is split into its events' bytes only when they are needed
    (a body that failed to decode whole, or one of several sessions): a part's ``raw``
    holds the events' positions until then. Ray's bodies are one session, and splitting
    one cost ~a tenth of decoding it."""
    many, one = _SNAKE if b'"event_type"' in body[:4096] else _CAMEL
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


def _apply(part: SessionPart, ev: Any, etype: str) -> bool:
    """Merge one event into ``part``; False if it says nothing we index."""
    if etype == "TASK_LIFECYCLE_EVENT" and ev.task_lifecycle_event is not None:
        _task_lifecycle(part, ev, ev.task_lifecycle_event)
    elif etype == "TASK_DEFINITION_EVENT" and ev.task_definition_event is not None:
        d = ev.task_definition_event
        tid = _hex(d.task_id)
        if tid is None:
            return False
        job = _hex(d.job_id)
        if d.task_type == "DRIVER_TASK" or is_driver_task(d.task_id):
            if job is not None:
                part.job(job)
            return True
        t = part.task(tid, d.task_attempt)
        func, module = _func_name(d.task_func)
        t.defined = True
        t.job_id = t.job_id or job
        t.name = t.name or clean(d.task_name) or func
        t.func = t.func or func
        t.module = t.module or module
        t.task_type = t.task_type or clean(d.task_type, 32)
        t.parent_id = t.parent_id or _hex(d.parent_task_id)
        if d.task_type == "ACTOR_CREATION_TASK" and len(d.task_id) == 24:
            # Ray's creation task id is 8 nil bytes and the actor's id (TaskID::
            # ForActorCreationTask); the definition names no actor.
            t.actor_id = t.actor_id or _hex(d.task_id[8:])
    elif etype == "ACTOR_TASK_DEFINITION_EVENT" and ev.actor_task_definition_event is not None:
        d = ev.actor_task_definition_event
        tid = _hex(d.task_id)
        if tid is None:
            return False
        t = part.task(tid, d.task_attempt)
        func, module = _func_name(d.actor_func)
        t.defined = True
        t.job_id = t.job_id or _hex(d.job_id)
        t.name = t.name or clean(d.actor_task_name) or func
        t.func = t.func or func
        t.module = t.module or module
        t.task_type = t.task_type or "ACTOR_TASK"
        t.parent_id = t.parent_id or _hex(d.parent_task_id)
        t.actor_id = t.actor_id or _hex(d.actor_id)
    elif etype == "DRIVER_JOB_DEFINITION_EVENT" and ev.driver_job_definition_event is not None:
        d = ev.driver_job_definition_event
        job = _hex(d.job_id)
        if job is None:
            return False
        j = part.job(job)
        j.entrypoint = j.entrypoint or clean(d.entrypoint, MAX_TEXT)
        j.driver_pid = j.driver_pid or _int(d.driver_pid)
        j.driver_node = j.driver_node or _hex(d.driver_node_id)
    elif etype == "DRIVER_JOB_LIFECYCLE_EVENT" and ev.driver_job_lifecycle_event is not None:
        d = ev.driver_job_lifecycle_event
        job = _hex(d.job_id)
        if job is None:
            return False
        j = part.job(job)
        for s in d.state_transitions:
            if s.state == "CREATED":
                j.created_at = _min(j.created_at, _time(s.timestamp))
            elif s.state == "FINISHED":
                j.finished_at = _min(j.finished_at, _time(s.timestamp))
    elif etype == "NODE_DEFINITION_EVENT" and ev.node_definition_event is not None:
        d = ev.node_definition_event
        node = _hex(d.node_id)
        if node is None:
            return False
        n = part.nodes.setdefault(node, NodePatch())
        n.ip = n.ip or clean(d.node_ip_address, 256)
        n.hostname = n.hostname or clean(d.hostname)
        n.name = n.name or clean(d.node_name)
        n.started_at = _min(n.started_at, _time(d.start_timestamp))
    elif etype == "NODE_LIFECYCLE_EVENT" and ev.node_lifecycle_event is not None:
        d = ev.node_lifecycle_event
        node = _hex(d.node_id)
        if node is None:
            return False
        n = part.nodes.setdefault(node, NodePatch())
        for s in d.state_transitions:
            if s.state == "ALIVE":
                n.alive_at = _min(n.alive_at, _time(s.timestamp))
                if s.resources and n.resources is None:
                    n.resources = dict(s.resources)
            elif s.state == "DEAD":
                n.dead_at = _min(n.dead_at, _time(s.timestamp))
                if s.death_info is not None and n.death_reason is None:
                    n.death_reason = clean(
                        " ".join(
                            x for x in (s.death_info.reason, s.death_info.reason_message) if x
                        ),
                        MAX_TEXT,
                    )
    elif etype == "WORKER_DEFINITION_EVENT" and ev.worker_definition_event is not None:
        d = ev.worker_definition_event
        wid = _hex(d.worker_id)
        if wid is None:
            return False
        w = part.workers.setdefault(wid, WorkerPatch())
        w.node = w.node or _hex(d.node_id)
        w.pid = w.pid or _int(d.pid)
        w.worker_type = w.worker_type or clean(d.worker_type, 32)
    elif etype == "WORKER_LIFECYCLE_EVENT" and ev.worker_lifecycle_event is not None:
        d = ev.worker_lifecycle_event
        wid = _hex(d.worker_id)
        if wid is None:
            return False
        w = part.workers.setdefault(wid, WorkerPatch())
        w.job = w.job or _hex(d.job_id)
        for s in d.state_transitions:
            if s.state == "ALIVE":
                ms = _int(s.start_time_ms)
                w.started_at = _min(w.started_at, ms / 1000 if ms else _time(s.timestamp))
            elif s.state == "DEAD":
                ms = _int(s.end_time_ms)
                w.ended_at = _min(w.ended_at, ms / 1000 if ms else _time(s.timestamp))
                if s.death_info is not None:
                    w.exit_type = w.exit_type or clean(s.death_info.exit_type, 64)
                    # Ray colours a user error's detail for a terminal: not for a page
                    detail = _ANSI.sub("", s.death_info.exit_detail or "")
                    w.exit_detail = w.exit_detail or clean(detail, MAX_TEXT)
    elif etype == "ACTOR_DEFINITION_EVENT" and ev.actor_definition_event is not None:
        d = ev.actor_definition_event
        aid = _hex(d.actor_id)
        if aid is None:
            return False
        a = part.actors.setdefault(aid, ActorPatch())
        a.job = a.job or _hex(d.job_id)
        a.class_name = a.class_name or clean(d.class_name)
        a.name = a.name or clean(d.name)
    elif etype == "ACTOR_LIFECYCLE_EVENT" and ev.actor_lifecycle_event is not None:
        d = ev.actor_lifecycle_event
        aid = _hex(d.actor_id)
        if aid is None:
            return False
        a = part.actors.setdefault(aid, ActorPatch())
        for s in d.state_transitions:
            if s.state == "ALIVE":
                a.alive_at = _min(a.alive_at, _time(s.timestamp))
                a.node = a.node or _hex(s.node_id)
                a.worker = a.worker or _hex(s.worker_id)
                a.pid = a.pid or _int(s.pid)
            elif s.state == "DEAD":
                a.dead_at = _min(a.dead_at, _time(s.timestamp))
    else:
        return False
    return True


def _task_lifecycle(part: SessionPart, ev: Any, d: Any) -> None:
    # The hottest loop of Ray ingest (two thirds of all events): locals, no helper calls
    # for the common cases.
    task_id = d.task_id
    if len(task_id) > 20 and task_id.startswith(_NIL20):  # a driver's (is_driver_task)
        job = _hex(d.job_id)
        if job is not None:
            j = part.job(job)
            for s in d.state_transitions:
                if s.state in ("FINISHED", "FAILED"):
                    j.driver_exit_at = _min(j.driver_exit_at, _time(s.timestamp))
        return
    # _hex, uncached: a task's id comes in a few events at most (the cache only churned)
    if not task_id or len(task_id) > MAX_ID_BYTES or task_id.count(0xFF) == len(task_id):
        return
    tid = task_id.hex()
    key = (tid, d.task_attempt)
    t = part.tasks.get(key)
    if t is None:
        t = part.tasks[key] = TaskPatch(tid, key[1])
    if t.job_id is None:
        t.job_id = _hex(d.job_id)
    pid = d.worker_pid
    if type(pid) is not int or not 0 < pid < 2**53:
        pid = _int(pid)
    if pid:
        # Sent by the worker that runs the task: its node is the event's own node.
        t.pid = t.pid or pid
        t.node_id = t.node_id or _hex(d.node_id) or _hex(ev.node_id)
    else:
        t.node_id = t.node_id or _hex(d.node_id)
    t.worker_id = t.worker_id or _hex(d.worker_id)
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
