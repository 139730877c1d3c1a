"""Log records of Dask's loggers (and the application's), as protocol log events."""

from __future__ import annotations

import logging
import math
from typing import Any

from hindsight.agent import Agent
from hindsight.dask.records import log_record_event
from hindsight.streams import (
    current_task,
    owns_record,
    running_worker,
    scheduler_time,
    task_and_run,
    task_owner,
)

logger = logging.getLogger(__name__)


#: The scheduler's own loggers (its process may also hold a client, or workers in-process,
#: whose records are not the scheduler's).
SCHEDULER_LOGGERS = (
    "distributed.scheduler",
    "distributed.active_memory_manager",
    "distributed.stealing",
    "distributed.shuffle._scheduler_plugin",
)


def json_safe(value: Any) -> Any:
    """A config value as JSON can hold it: infinities and NaN as text (``inf``), which JSON
    has no number for. ``worker-saturation: inf`` (root-task queuing off) is not null, as if
    it were not set."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def compute_failed(record: logging.LogRecord) -> bool:
    """Whether ``record`` is Dask's worker's "Compute Failed" of a task (key first)."""
    msg, args = record.msg, record.args
    return (
        isinstance(msg, str)
        and msg.startswith("Compute Failed\nKey:")
        and isinstance(args, tuple)
        and len(args) > 0
    )


class LogHandler(logging.Handler):
    """Copies log records at or above the configured level into an agent: a worker's
    (``worker``; a record logged by a task names the task and its run) or the scheduler's
    (``worker`` None: records of ``only`` loggers, as worker ``scheduler``)."""

    def __init__(
        self, agent: Agent, worker: Any, level: int, only: tuple[str, ...] | None = None
    ) -> None:
        super().__init__(level)
        self.agent = agent
        self.worker = worker
        self.address = str(worker.address) if worker is not None else "scheduler"
        self.only = only
        self._last: logging.LogRecord | None = None

    def emit(self, record: logging.LogRecord) -> None:
        # Our own warnings about delivery problems must not feed back into delivery.
        if record.name.startswith("hindsight"):
            return
        # On both loggers, this handler sees a record of "distributed" twice where it
        # propagates to the root logger (Dask's logging config stops it; a host
        # application's may not)
        if record is self._last:
            return
        self._last = record
        if self.only is not None and not record.name.startswith(self.only):
            return
        if self.only is None and record.name.startswith(SCHEDULER_LOGGERS):
            return  # workers in the scheduler's process: the scheduler's handler has it
        try:
            message = record.getMessage()
            if record.exc_info:
                message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            if self.worker is None:
                at, key, run = record.created, None, None
            elif compute_failed(record) and running_worker() is None:
                # Dask logs a task's failure on the event loop, after its thread let go of
                # it: the key is the record's first argument. Placed by time alone, a
                # failure could land in the next run. Of workers that share a process, the
                # one with the task keeps it.
                owner = task_owner(record.args[0])
                if not (owner is self.worker if owner is not None else owns_record(self.worker)):
                    return
                at = scheduler_time(self.worker, record.created)
                key, run = task_and_run(self.worker, record.args[0])
            elif not owns_record(self.worker):
                return  # another worker's in this process (processes=False): its own handler
            else:
                at = scheduler_time(self.worker, record.created)
                key, run = current_task(self.worker)
            self.agent.add(
                (
                    log_record_event,
                    at,
                    record.levelname,
                    message,
                    record.name,
                    self.address,
                    key,
                    run,
                )
            )
        except Exception:
            pass
