"""``hindsight.emit(stream, value)``: custom values recorded from inside tasks.

The worker-side agent (:class:`hindsight.dask.worker.WorkerAgentPlugin`) registers itself here
when it is set up on a worker; ``emit`` then attaches the worker address, the current
task key and its run, and queues a :class:`~hindsight.schema.CustomEvent`.  Outside a
worker with the plugin, ``emit`` does nothing and returns False, so library code can
call it unconditionally.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from hindsight.schema import CustomEvent

logger = logging.getLogger(__name__)

STREAM_MAX = 256


class _Context:
    def __init__(self, agent: Any, worker: Any) -> None:
        self.agent = agent
        self.worker = worker
        self.address = str(worker.address)


# Per worker: several workers share a process in a LocalCluster(processes=False) (the
# usual notebook cluster), and one process-wide context sent every worker's values to the
# last one set up (the others' were lost) and recorded each log record once per worker.
_contexts: dict[int, _Context] = {}


def set_worker_context(agent: Any, worker: Any) -> None:
    """Route :func:`emit` from ``worker``'s tasks to ``agent`` (called by the worker plugin)."""
    _contexts[id(worker)] = _Context(agent, worker)


def clear_worker_context(agent: Any) -> None:
    """Stop routing :func:`emit` to ``agent``."""
    for wid, ctx in list(_contexts.items()):
        if ctx.agent is agent:
            _contexts.pop(wid, None)


_worker_cvar: Any = None  # distributed's, looked up on first use (the SDK needs no Dask)


def running_worker() -> Any | None:
    """The worker whose task is running here (Dask's ``get_worker``), or None."""
    global _worker_cvar
    if _worker_cvar is None:
        try:
            from distributed.worker import _worker_cvar as cvar
        except Exception:  # not in a worker, or a distributed without it
            return None
        _worker_cvar = cvar
    return _worker_cvar.get(None)


def _current() -> _Context | None:
    contexts = list(_contexts.values())
    if len(contexts) <= 1:
        return contexts[0] if contexts else None
    worker = running_worker()
    return _contexts.get(id(worker)) if worker is not None else None


def task_owner(key: Any) -> Any | None:
    """The worker in this process (of those with the plugin) that holds a task of ``key``."""
    for ctx in list(_contexts.values()):
        try:
            if ctx.worker.state.tasks.get(key) is not None:
                return ctx.worker
        except Exception:
            continue
    return None


def owns_record(worker: Any) -> bool:
    """Whether a log record made now is ``worker``'s to keep: one made by a task belongs to
    that task's worker; one made outside any task to the process's first worker only, so
    workers sharing a process do not each keep it."""
    running = running_worker()
    if running is not None:
        return running is worker
    first = next(iter(list(_contexts.values())), None)
    return first is None or first.worker is worker


def scheduler_time(worker: Any, at: float | None = None) -> float:
    """``at`` (default: now) on the scheduler's clock, like Dask's compute startstops.

    Dask shifts compute and transfer times by the worker's estimated offset to the
    scheduler (``Worker.scheduler_delay``, from heartbeats); worker-side events get the
    same shift so they line up with task records on one timeline.
    """
    t = time.time() if at is None else at
    try:
        return t + float(worker.scheduler_delay or 0.0)
    except (AttributeError, TypeError, ValueError):
        return t


def current_task(worker: Any) -> tuple[str | None, str | None]:
    try:
        from distributed.worker import thread_state
    except ImportError:
        return None, None
    key = getattr(thread_state, "key", None)
    if key is None:
        return None, None
    return task_and_run(worker, key)


def task_and_run(worker: Any, key: Any) -> tuple[str, str | None]:
    """``key`` as text and the run (span) of the worker's task of that key, if it has it."""
    run = None
    ts = worker.state.tasks.get(key)
    if ts is not None:
        # A spanned task carries every span id from the outermost (the run) inward; an
        # unspanned one belongs to the scheduler's default span, which is its own run.
        ann = (ts.annotations or {}).get("span")
        if ann and ann.get("ids"):
            run = str(ann["ids"][0])
        elif ts.span_id:
            run = str(ts.span_id)
    return str(key), run


MAX_LIST = 10_000  # a bigger array is recorded as its repr: a value is not a dataset


def _plain(value: Any) -> Any:
    """NumPy and pandas values as the numbers, lists and times they hold: a task's
    ``df["x"].sum()`` is an ``np.int64``, which was recorded as the text 'np.int64(5050)'
    and so counted as no number at all."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # NumPy scalars
        if getattr(getattr(value, "dtype", None), "kind", "") in "mM":
            return str(value)  # a datetime64's item() is an int of its unit
        return value.item()
    if hasattr(value, "tolist") and getattr(value, "size", 0) <= MAX_LIST:  # arrays, Series
        return value.tolist()
    if hasattr(value, "isoformat"):  # pandas' Timestamp
        return value.isoformat()
    raise NotImplementedError(type(value).__name__)


def emit(stream: str, value: Any = None) -> bool:
    """Record ``value`` on the custom stream ``stream``; True if it was queued.

    ``value`` should be JSON-like (numbers, strings, lists, dicts; NumPy and pandas
    scalars and arrays as the numbers and lists they hold); anything else is recorded as
    its ``repr``.  Never raises, never blocks.
    """
    ctx = _current()
    if ctx is None:
        return False
    try:
        stream = str(stream)[:STREAM_MAX] or "default"
        try:
            value = msgspec.to_builtins(value, str_keys=True, enc_hook=_plain)
            msgspec.json.encode(value)
        except Exception:
            value = repr(value)[:65536]
        key, run = current_task(ctx.worker)
        ctx.agent.add(
            CustomEvent(
                stream=stream,
                time=scheduler_time(ctx.worker),
                value=value,
                worker=ctx.address,
                run=run,
                key=key,
            )
        )
        return True
    except Exception:
        logger.debug("hindsight: emit failed", exc_info=True)
        return False
