"""``hindsight.emit(stream, value)``: custom values recorded from inside tasks.

The worker-side agent (:class:`hindsight.dask.WorkerAgentPlugin`) registers itself here
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


_context: _Context | None = None


def set_worker_context(agent: Any, worker: Any) -> None:
    """Route :func:`emit` on this process to ``agent`` (called by the worker plugin)."""
    global _context
    _context = _Context(agent, worker)


def clear_worker_context(agent: Any) -> None:
    """Stop routing :func:`emit` to ``agent``."""
    global _context
    if _context is not None and _context.agent is agent:
        _context = None


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


def emit(stream: str, value: Any = None) -> bool:
    """Record ``value`` on the custom stream ``stream``; True if it was queued.

    ``value`` should be JSON-like (numbers, strings, lists, dicts); anything else is
    recorded as its ``repr``.  Never raises, never blocks.
    """
    ctx = _context
    if ctx is None:
        return False
    try:
        stream = str(stream)[:STREAM_MAX] or "default"
        try:
            value = msgspec.to_builtins(value, str_keys=True)
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
