"""Wire protocol v1: the one definition of a batch, shared by agents and the collector.

A batch is a JSON object POSTed to ``/v1/batches``. Its identity is
``(cluster, session, agent, seq)``; the collector stores a given identity once.
``docs/protocol.md`` describes the format for agents in other languages, and
``docs/schema/batch-v1.json`` is generated from these classes (a test keeps it in step).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

SCHEMA_VERSION = 1

# Names that end up in S3 keys and SQL: a short, safe character set, never "." or "..".
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$"
_NAME_RE = re.compile(NAME_PATTERN)

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, max_length=128)]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Label = Annotated[str, msgspec.Meta(max_length=1024)]
Text = Annotated[str, msgspec.Meta(max_length=65536)]
# Bounds the index can hold, checked while decoding, before anything is stored: a value
# that passed here but not an index column would be stored, then fail the index on every
# retry. 2**53 is the largest integer every JSON implementation carries exactly; 1e11
# seconds is the year 5138.
MAX_INT = 2**53
MAX_TIME = 1e11
Time = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIME)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
Int = Annotated[int, msgspec.Meta(ge=-MAX_INT, le=MAX_INT)]
Threads = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
AttrKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
# A scheduler's own facts about a task that have no field here (Ray: attempt, state, parent
# task, node...): flat values only, so every reader can show them without knowing the scheduler.
AttrValue = Label | Int | Annotated[float, msgspec.Meta(ge=-MAX_TIME, le=MAX_TIME)] | bool | None


def valid_name(value: str) -> bool:
    """Whether ``value`` may be used as a tenant, cluster, session or agent name."""
    # fullmatch: ``$`` alone also matches before a trailing newline ("abc\n")
    return bool(_NAME_RE.fullmatch(value)) and value not in (".", "..") and ".." not in value


# gc=False: decoded events hold only JSON values, so they cannot form reference cycles, and
# untracked structs decode ~1.5x faster (the collector's hot path is decoding).
class StartStop(msgspec.Struct, omit_defaults=True, gc=False):
    """One timed phase of a task, as in Dask's ``startstops``."""

    action: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    start: Time
    stop: Time
    source: Label | None = None


class _Event(msgspec.Struct, tag_field="kind", omit_defaults=True, gc=False):
    pass


class TaskEvent(_Event, tag="task"):
    """A task that finished (status ``memory``) or failed (``erred``) on a worker."""

    key: Key
    prefix: Label
    status: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    group: Label | None = None
    run: Label | None = None
    worker: Label | None = None
    thread: Int | None = None
    nbytes: Int | None = None
    typename: Label | None = None
    # A tuple, not a list: the first young collection untracks a tuple of untracked structs,
    # so a decoded task batch in flight holds nothing the cyclic GC walks. As lists, each
    # batch's 5,000 stayed tracked, were promoted, and brought on full collections that
    # walked every in-flight batch (37 -> 7 full collections over 96 batches decoded and
    # aggregated in 4 threads).
    startstops: tuple[StartStop, ...] = ()
    exception: Text | None = None
    traceback: Text | None = None
    attrs: Annotated[dict[AttrKey, AttrValue], msgspec.Meta(max_length=64)] = {}


class GraphEvent(_Event, tag="graph"):
    """A task of a submitted graph and the keys it depends on; ``time``, when the
    scheduler received the graph (the critical path tells a task not yet submitted from
    one waiting for a thread)."""

    key: Key
    prefix: Label
    dependencies: list[Key] = []
    group: Label | None = None
    run: Label | None = None
    time: Time | None = None


class RunEvent(_Event, tag="run"):
    """A run started, finished or erred. ``span`` is the span path, outermost first."""

    event: Literal["started", "finished", "erred"]
    id: Label
    time: Time
    name: Label | None = None
    span: list[Label] = []
    client: Label | None = None


#: Keys a ``left`` worker event lists per kind (``counts`` holds the totals).
MAX_LEFT_KEYS = 200
LeftKeys = Annotated[list[Key], msgspec.Meta(max_length=MAX_LEFT_KEYS)]


class WorkerEvent(_Event, tag="worker"):
    """A worker joined or left the cluster.

    On ``left``: ``reason`` is the scheduler's stimulus (``handle-worker-cleanup``: its
    connection closed; ``check-worker-ttl``: heartbeats stopped; ``retire-workers``...),
    ``expected`` whether the scheduler meant to remove it, ``status`` the worker's last
    status the scheduler knew (``running``, ``paused``, ``closing``...), and what its
    leaving took down: ``processing`` (tasks running or queued on it, sent back to be
    rescheduled), ``erred`` (of those, tasks marked failed because too many workers died
    running them: Dask's ``KilledWorker``) and ``lost`` (results only it held, to be
    recomputed); each lists at most ``MAX_LEFT_KEYS`` keys and ``counts`` has the totals.
    """

    event: Literal["joined", "left"]
    address: Label
    time: Time
    name: Label | None = None
    nthreads: Threads | None = None
    memory_limit: Count | None = None
    reason: Label | None = None
    expected: bool | None = None
    status: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    processing: LeftKeys = []
    erred: LeftKeys = []
    lost: LeftKeys = []
    counts: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=64)], Count], msgspec.Meta(max_length=16)
    ] = {}


class MetricEvent(_Event, tag="metric"):
    """One sample of named numeric values for a worker (or the scheduler)."""

    worker: Label
    time: Time
    values: dict[str, float]


class SessionEvent(_Event, tag="session"):
    """Facts about the session, sent once: versions, addresses, a config excerpt."""

    time: Time
    versions: dict[str, str] = {}
    config: dict[str, Any] = {}
    address: Label | None = None


class LogEvent(_Event, tag="log"):
    """A log record from the scheduler (``worker``: ``scheduler``) or a worker; ``key`` and
    ``run`` name the task that logged it, if a task did."""

    time: Time
    level: Annotated[str, msgspec.Meta(max_length=32)]
    message: Text
    logger: Label | None = None
    worker: Label | None = None
    key: Key | None = None
    run: Label | None = None


class CustomEvent(_Event, tag="custom"):
    """A value on a user-defined stream (``hindsight.emit(stream, value)``)."""

    stream: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    time: Time
    value: Any = None
    worker: Label | None = None
    run: Label | None = None
    key: Key | None = None


class ProfileFrame(msgspec.Struct, omit_defaults=True, gc=False):
    """A code location in a profile: a function (``name``, ``filename``, ``first_line``:
    together its identity, as in Dask's ``name;filename;firstlineno``) and one sampled
    line of it (``line_number``, source text ``line``)."""

    name: Label
    filename: Label
    first_line: Int = 0
    line_number: Int = 0
    line: Label = ""


ProfileNode = Annotated[
    tuple[Int, Count, Count],
    msgspec.Meta(description="[parent node index or -1, frame index, samples]"),
]


class ProfileEvent(_Event, tag="profile"):
    """Statistical profile samples of one task prefix on one worker over ``[start, stop]``
    (one or more of the worker's profile cycles), as a call tree.

    ``nodes`` lists the tree in pre-order, each ``[parent, frame, samples]``: ``parent``
    is an earlier node's index or -1 for a top-level frame, ``frame`` indexes ``frames``,
    ``samples`` counts the samples in which the frame was on the stack (its children's
    samples included; the rest are the frame's own). A sample is ``interval`` seconds.
    """

    worker: Label
    prefix: Label
    start: Time
    stop: Time
    frames: Annotated[list[ProfileFrame], msgspec.Meta(max_length=10_000)]
    nodes: Annotated[list[ProfileNode], msgspec.Meta(max_length=10_000)]
    interval: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 0.01


Short = Annotated[str, msgspec.Meta(max_length=64)]


class ActivityMetric(msgspec.Struct, omit_defaults=True, gc=False):
    """One of Dask's fine performance metrics: seconds, bytes or a count spent in an
    ``activity`` (``thread-cpu``, ``thread-noncpu``, ``disk-read``, ``serialize``, ...)
    by tasks of ``prefix`` in ``context`` (``execute``, ``p2p``: what Dask keeps per span)."""

    context: Short
    prefix: Label
    activity: Short
    unit: Short
    value: Annotated[float, msgspec.Meta(ge=-1e15, le=1e15)]


class ActivityEvent(_Event, tag="activity"):
    """A run's cumulative fine performance metrics as of ``time`` (Dask's
    ``Span.cumulative_worker_metrics``). Values only grow while a run lasts, so the
    latest ``time`` wins; an agent may send only the metrics that changed."""

    run: Label
    time: Time
    metrics: Annotated[list[ActivityMetric], msgspec.Meta(max_length=100_000)]


class CodeFrame(msgspec.Struct, omit_defaults=True, gc=False):
    """Source of one client frame that submitted a computation (Dask's ``SourceCode``):
    ``code`` is the frame's source, ``lineno_frame`` the line in ``filename`` that
    submitted, ``lineno_relative`` that line within ``code`` (0-based)."""

    code: Text
    filename: Label = ""
    lineno_frame: Int = 0
    lineno_relative: Int = 0


class CodeEvent(_Event, tag="code"):
    """The code that submitted a computation of ``run``: the client's frames, innermost
    first, as Dask records them when ``distributed.diagnostics.computations.nframes`` > 0."""

    run: Label
    time: Time
    frames: Annotated[list[CodeFrame], msgspec.Meta(max_length=64)]


class PrefixState(msgspec.Struct, omit_defaults=True, gc=False):
    """How many of a run's tasks of one prefix are in each state (Dask's status page
    progress bars): ``waiting`` counts Dask's waiting, queued and no-worker tasks,
    ``released`` its released and forgotten ones."""

    prefix: Label
    waiting: Count = 0
    processing: Count = 0
    memory: Count = 0
    released: Count = 0
    erred: Count = 0


class WorkerState(msgspec.Struct, omit_defaults=True, gc=False):
    """One worker as the scheduler saw it at a state sample: bytes (managed, unmanaged,
    spilled to disk, the memory limit; 0 when none) and the tasks processing on it."""

    worker: Label
    managed: Count = 0
    unmanaged: Count = 0
    spilled: Count = 0
    limit: Count = 0
    processing: Count = 0


class StateEvent(_Event, tag="state"):
    """A run's task states by prefix and the cluster's workers at ``time``: what Dask's
    status page showed then. Sent every sample interval while the run lasts and once when
    it ends; replay at a time reads the latest sample at or before it."""

    run: Label
    time: Time
    prefixes: Annotated[list[PrefixState], msgspec.Meta(max_length=100_000)] = []
    workers: Annotated[list[WorkerState], msgspec.Meta(max_length=100_000)] = []


Event = (
    TaskEvent
    | GraphEvent
    | RunEvent
    | WorkerEvent
    | MetricEvent
    | SessionEvent
    | LogEvent
    | CustomEvent
    | ProfileEvent
    | ActivityEvent
    | CodeEvent
    | StateEvent
)

#: Kinds added after protocol v1's first release. A collector that predates them answers
#: 400 naming ``$.events[i].kind``; the reference agent then sends the batch again without
#: them (see docs/protocol.md, "Newer event kinds").
LATER_KINDS = frozenset({"profile", "activity", "code", "state"})


class Batch(msgspec.Struct, omit_defaults=True):
    """A batch of sub-events from one agent instance of one cluster session."""

    schema: Literal[1]
    cluster: Name
    session: Name
    agent: Name
    seq: Count
    events: list[Event]
    sent_at: Time | None = None
    final: bool = False
    dropped: dict[str, Count] = {}

    @property
    def batch_id(self) -> str:
        return f"{self.cluster}/{self.session}/{self.agent}/{self.seq}"


class SchemaError(ValueError):
    """The batch is not valid protocol v1; the message names the offending field."""


_decoder = msgspec.json.Decoder(Batch)
_encoder = msgspec.json.Encoder()


def decode_batch(data: bytes) -> Batch:
    """Decode and validate one batch; raises :class:`SchemaError` naming the bad field."""
    try:
        batch = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise SchemaError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise SchemaError(f"malformed JSON: {exc}") from None
    except RecursionError:  # msgspec's limit on nesting, even inside an ignored field
        raise SchemaError("malformed JSON: nested too deeply") from None
    for field in ("cluster", "session", "agent"):
        if not valid_name(getattr(batch, field)):
            raise SchemaError(f"invalid name - at `$.{field}`")
    return batch


def encode_batch(batch: Batch) -> bytes:
    """Encode a batch as JSON bytes."""
    return _encoder.encode(batch)


_NUL_ESCAPE = re.compile(rb"\\u0000")  # a regex finds it ~2x faster than bytes.find


def _strings_with_nul(value: Any, replace: bool) -> bool:
    """Whether any string (or key) in a decoded JSON value holds U+0000; with ``replace``,
    each U+0000 is replaced by U+FFFD in place. A walk with its own stack: a recursive one
    overflowed Python's on nesting msgspec accepts."""
    if isinstance(value, str):
        return "\x00" in value
    found = False
    stack = [value]
    while stack:
        v = stack.pop()
        slots = list(v.items()) if isinstance(v, dict) else enumerate(v)
        for slot, item in slots:
            if isinstance(item, dict | list):
                stack.append(item)
            elif isinstance(item, str) and "\x00" in item:
                if not replace:
                    return True
                found = True
                v[slot] = item.replace("\x00", "\ufffd")
            if isinstance(slot, str) and "\x00" in slot:
                if not replace:
                    return True
                found = True
                v[slot.replace("\x00", "\ufffd")] = v.pop(slot)
    return found


def _may_hold_nul(body: bytes) -> bool:
    """JSON can only carry U+0000 as the escape ``\\u0000``: a body without a backslash
    (most task batches) is ruled out by one memchr, the walk runs only past this."""
    return bool(b"\\" in body and _NUL_ESCAPE.search(body))


def has_nul(body: bytes) -> bool:
    """Whether any string in a JSON body holds U+0000 (Postgres cannot store it in text)."""
    return _may_hold_nul(body) and _strings_with_nul(msgspec.json.decode(body), replace=False)


def replace_nul(body: bytes) -> bytes:
    """A JSON body with every U+0000 in its strings replaced by U+FFFD (what the agent sends:
    Dask accepts a NUL in a key, a log message or a value, the collector refuses a batch
    holding one, and the batch's other events went with it)."""
    if not _may_hold_nul(body):
        return body
    value = msgspec.json.decode(body)
    return msgspec.json.encode(value) if _strings_with_nul(value, replace=True) else body


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a batch, generated from these classes, as plain JSON values (a
    tuple field's default ``()`` is the JSON array ``[]``), descriptions dedented (msgspec
    0.23 dedents docstrings, earlier versions kept their indentation: the same either way)."""
    import inspect

    out = msgspec.json.decode(msgspec.json.encode(msgspec.json.schema(Batch)))
    for d in (out, *out.get("$defs", {}).values()):
        if isinstance(d.get("description"), str):
            d["description"] = inspect.cleandoc(d["description"])
    return out


def agent_name_prefix(prefix: str) -> str:
    """What every agent name made of ``prefix`` starts with (an agent instance's name adds
    a random part: ``hindsight.agent.core.new_agent_name``). A naming rule of the wire: the
    index tells a Dask worker's agent by it (``storage.query.runs.completeness``)."""
    safe = "".join(c if c.isalnum() or c in "_.-" else "-" for c in prefix).strip(".-")
    return f"{safe[:90] or 'agent'}-"
