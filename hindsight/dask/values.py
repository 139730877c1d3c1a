"""A worker's and the scheduler's figures as metric samples."""

from __future__ import annotations

import logging
import math
import shutil
from typing import Any

logger = logging.getLogger(__name__)


def put_number(values: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        values[name] = float(value)  # inf was encoded as null: the batch refused


def worker_values(ws: Any) -> dict[str, float]:
    """One sample of a worker as the scheduler sees it (memory, cpu, tasks, transfers)."""
    values: dict[str, float] = {}
    mem = ws.memory
    put_number(values, "memory.managed", mem.managed)
    put_number(values, "memory.unmanaged", mem.unmanaged)
    put_number(values, "memory.unmanaged_old", mem.unmanaged_old)
    put_number(values, "memory.unmanaged_recent", mem.unmanaged_recent)
    put_number(values, "memory.spilled", mem.spilled)
    put_number(values, "memory.process", mem.process)
    put_number(values, "memory.limit", ws.memory_limit or 0)
    put_number(values, "tasks.processing", len(ws.processing))
    put_number(values, "nthreads", ws.nthreads)
    m = ws.metrics or {}
    put_number(values, "cpu", m.get("cpu"))
    put_number(values, "event_loop_interval", m.get("event_loop_interval"))
    put_number(values, "num_fds", m.get("num_fds"))
    for state, count in (m.get("task_counts") or {}).items():
        put_number(values, f"tasks.{state}", count)
    transfer = m.get("transfer") or {}
    for name in (
        "incoming_bytes",
        "outgoing_bytes",
        "incoming_count_total",
        "outgoing_count_total",
    ):
        put_number(values, f"transfer.{name}", transfer.get(name))
    spilled = m.get("spilled_bytes") or {}
    put_number(values, "spilled.memory", spilled.get("memory"))
    put_number(values, "spilled.disk", spilled.get("disk"))
    for io in ("host_net_io", "host_disk_io"):
        for name, v in (m.get(io) or {}).items():
            put_number(values, f"{io}.{name}", v)
    return values


def scheduler_values(scheduler: Any) -> dict[str, float]:
    """One sample of the scheduler process itself."""
    values: dict[str, float] = {}
    try:
        last = scheduler.monitor.recent()
    except Exception:
        last = {}
    put_number(values, "cpu", last.get("cpu"))
    put_number(values, "memory.process", last.get("memory"))
    put_number(values, "tasks", len(scheduler.tasks))
    put_number(values, "workers", len(scheduler.workers))
    put_number(values, "event_loop_interval", getattr(scheduler, "_tick_interval_observed", None))
    return values


def spill_values(worker: Any) -> dict[str, float]:
    """Spill and disk detail only the worker has (the scheduler sees only totals)."""
    values: dict[str, float] = {}
    data = worker.data
    spilled = getattr(data, "spilled_total", None)
    if spilled is not None:
        put_number(values, "spill.disk_bytes", spilled.disk)
        put_number(values, "spill.disk_memory_bytes", spilled.memory)
    slow = getattr(data, "slow", None)
    if slow is not None:
        put_number(values, "spill.disk_keys", len(slow))
    fast = getattr(data, "fast", None)
    if fast is not None:
        put_number(values, "spill.memory_keys", len(fast))
    for (label, unit), v in list(getattr(data, "cumulative_metrics", {}).items()):
        put_number(values, f"spill.{label}.{unit}", v)
    try:
        usage = shutil.disk_usage(worker.local_directory)
        put_number(values, "disk.free_bytes", usage.free)
        put_number(values, "disk.total_bytes", usage.total)
    except (OSError, AttributeError):
        pass
    return values
