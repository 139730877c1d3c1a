"""Ray's exporter bodies as they come over the wire, and the conversions of their values.

Ray's aggregator agent POSTs a JSON array of ``RayEvent`` messages (protobuf JSON: camelCase
field names, or snake_case with ``..._PRESERVE_PROTO_FIELD_NAME=1``; ids as base64 of the
raw bytes; 64-bit integers as strings; RFC 3339 timestamps with nanoseconds). The message
classes here read them leniently: only what the index uses, loose types where protobuf JSON
varies (``storage.ray.events`` merges what they say).
"""

# No ``from __future__ import annotations`` here: the message classes are built inside a
# function (one family per field-name spelling), and msgspec resolves string annotations
# in the module's namespace, where those local classes are not.

import functools
import re
from datetime import datetime
from typing import Annotated, Any

import msgspec

# A refused body blocks a node's exporter for good: this decoder only asks for an array.
_array = msgspec.json.Decoder(list[msgspec.Raw])
# ``ray_tasks.attempt`` is a 32-bit integer: an event with an attempt it cannot hold is read
# as unreadable (counted, skipped), not left to fail the index on every retry of its body.
Attempt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
#: Ray's ids are 4-28 bytes; the index holds up to 32 (64 hex characters).
MAX_ID_BYTES = 32
MAX_TEXT = 65536
MAX_LABEL = 1024
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: A driver's task id starts with 20 nil bytes (then the job id).
DRIVER_TASK_PREFIX = b"\xff" * 20


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


def decoders(body: bytes) -> tuple[msgspec.json.Decoder, msgspec.json.Decoder]:
    """The decoders of a whole body and of one event, for the body's field-name spelling."""
    return _SNAKE if b'"event_type"' in body[:4096] else _CAMEL


@functools.lru_cache(maxsize=8192)
def ray_id(value: bytes) -> str | None:
    """A Ray id as Ray prints it (hex), or None for an empty, nil (all 0xff) or over-long
    id (longer than any Ray id; the index could not hold it). Cached: job, node and worker
    ids repeat in nearly every event."""
    if not value or len(value) > MAX_ID_BYTES or value.count(0xFF) == len(value):
        return None
    return value.hex()


def seconds(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def positive_int(value: int | str) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if 0 < n < 2**53 else None


def uncoloured(text: str) -> str:
    """``text`` without a terminal's colour codes (Ray colours some messages)."""
    return _ANSI.sub("", text)


def clean(value: str | None, limit: int = MAX_LABEL) -> str | None:
    """A string the index and the protocol can hold: no NUL, at most ``limit`` characters."""
    if not value:
        return None
    if "\x00" in value:
        value = value.replace("\x00", "")
    return value[:limit] or None


def func_name(desc: Any) -> tuple[str | None, str | None]:
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


DRIVER_TASK_PREFIX = b"\xff" * 20


def is_driver_task(task_id: bytes) -> bool:
    """A driver's task id: 20 nil bytes, then the job id."""
    return len(task_id) > 20 and task_id.startswith(DRIVER_TASK_PREFIX)


def error_summary(message: str | None, error_type: str | None) -> tuple[str | None, str | None]:
    """(exception, traceback) as Dask records them: the exception line (``ValueError: boom``)
    and the whole message, colour codes removed."""
    text = uncoloured(message) if message else ""
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
