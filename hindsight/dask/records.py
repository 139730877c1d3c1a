"""How the Dask agent turns what Dask hands its hooks into protocol records: names, limits, and
the builders the agent thread runs."""

from __future__ import annotations

import hashlib
import logging
import re
import time
from typing import Any

from hindsight.schema import (
    MAX_INT,
    GraphEvent,
    LogEvent,
    StartStop,
    TaskEvent,
    valid_name,
)

logger = logging.getLogger(__name__)


PLUGIN_NAME = "hindsight"
WORKER_PLUGIN_NAME = "hindsight-worker"
#: Tasks of a submitted graph turned into graph events per event-loop tick; a larger
#: graph is walked over several ticks so the scheduler never stalls on us.
GRAPH_CHUNK = 5000

LABEL_MAX = 1024
KEY_MAX = 4096
TEXT_MAX = 65536

# Configuration recorded with the session: what changes how a run behaves.
SESSION_CONFIG_KEYS = (
    "distributed.scheduler.worker-saturation",
    "distributed.scheduler.work-stealing",
    "distributed.scheduler.allowed-failures",
    "distributed.worker.memory.target",
    "distributed.worker.memory.spill",
    "distributed.worker.memory.pause",
    "distributed.worker.memory.terminate",
    "distributed.admin.tick.interval",
    "distributed.comm.compression",
)


def label(value: Any) -> str | None:
    if value is None:
        return None
    s = value if type(value) is str else str(value)
    return s if len(s) <= LABEL_MAX else s[:LABEL_MAX]


def key_text(key: Any) -> str:
    s = key if type(key) is str else str(key)
    return s if len(s) <= KEY_MAX else long_key(s)


def long_key(s: str) -> str:
    """A key past the protocol's 4,096 characters: its start, ``#`` and 32 hex digits of its
    hash, so distinct keys stay distinct (cut alone, keys sharing their first 4,096
    characters became one task) and the same key always gives the same text (edges)."""
    digest = hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{s[: KEY_MAX - 33]}#{digest}"


def text_of(value: Any) -> str | None:
    if not value:
        return None
    s = str(value)
    return s if len(s) <= TEXT_MAX else s[-TEXT_MAX:]


# -- deferred event builders (run on the agent thread) ------------------------------
def task_event(
    key: Any,
    prefix: str,
    group: str,
    run: str | None,
    status: str,
    worker: Any,
    thread: Any,
    nbytes: Any,
    typename: Any,
    startstops: Any,
    exception_text: Any,
    traceback_text: Any,
    attrs: dict[str, Any] | None = None,
) -> TaskEvent:
    ev = TaskEvent(
        key=key_text(key),
        prefix=label(prefix) or "",
        status=status,
        group=label(group),
        run=run,
        worker=label(worker),
        thread=thread if type(thread) is int and abs(thread) <= MAX_INT else None,
        # the protocol's integers end at 2**53: a lazy table's sizeof (10 PB) had the
        # collector refuse the whole batch, and the agent drop it
        nbytes=nbytes if type(nbytes) is int and 0 <= nbytes <= MAX_INT else None,
        typename=label(typename),
        startstops=[
            StartStop(
                action=s["action"], start=s["start"], stop=s["stop"], source=label(s.get("source"))
            )
            for s in startstops or ()
        ],
        exception=text_of(exception_text),
        traceback=text_of(traceback_text),
    )
    if attrs:
        ev.attrs = attrs
    return ev


def unstamp(stamped: dict[Any, Any], key: Any, ref: Any) -> None:
    """A stamped task state was collected: forget it (unless the key was stamped anew)."""
    if stamped.get(key) is ref:
        stamped.pop(key, None)


def received_at(stimulus_id: Any) -> float:
    """When the scheduler received a graph: Dask stamps ``update-graph-{time}`` on arrival,
    before it deserialises, materialises and orders the graph (which can take seconds, and
    runs before this plugin's hook); else now."""
    if type(stimulus_id) is str and stimulus_id.startswith("update-graph-"):
        try:
            t = float(stimulus_id[13:])
        except ValueError:
            pass
        else:
            if 0 < t <= time.time() + 1:
                return t
    return time.time()


def graph_event(
    key: Any, prefix: str, group: str, run: str | None, deps: list[Any], submitted: float | None
) -> GraphEvent:
    return GraphEvent(
        key=key_text(key),
        prefix=label(prefix) or "",
        dependencies=[key_text(d) for d in deps],
        group=label(group),
        run=run,
        time=submitted,
    )


def log_record_event(
    created: float,
    level: str,
    message: str,
    name: str,
    worker: str | None,
    key: str | None = None,
    run: str | None = None,
) -> LogEvent:
    return LogEvent(
        time=created,
        level=level,
        message=text_of(message) or "",
        logger=label(name),
        worker=worker,
        key=key_text(key) if key is not None else None,
        run=label(run),
    )


def killed_worker_text(key: Any, ts: Any, exception: Any, worker: Any) -> str | None:
    """The text of the ``KilledWorker`` the scheduler raises itself when a task's worker
    dies once too often (it passes the pickled exception and no text): Dask's own message,
    from the scheduler's task state, without unpickling anything."""
    if not isinstance(exception, bytes) or b"KilledWorker" not in exception:
        return None
    return (
        f"KilledWorker: Attempted to run task {key!r} on {getattr(ts, 'suspicious', '?')} "
        "different workers, but all those workers died while running it. The last worker "
        f"that attempt to run the task was {worker}."
    )


def session_name(value: str) -> str:
    if valid_name(value):
        return value
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "-", value).strip(".-")[:128]
    return safe if valid_name(safe) else "session"


def departure_reason(stimulus_id: str | None) -> str | None:
    if not stimulus_id:
        return None
    # "handle-worker-cleanup-1795295401.78" -> "handle-worker-cleanup"
    return re.sub(r"-\d+(\.\d+)?$", "", str(stimulus_id))[:LABEL_MAX]
