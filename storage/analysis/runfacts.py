"""The facts derived from a run, each defined once: its display name, makespan and
fingerprint, and how a task's phases add up to seconds by action.

The writer's aggregation pass, the compacted copy, the queries, the analyses and the
dashboard all take these from here, so a run shows the same figures everywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from hindsight.schema import TaskEvent
from storage.core.batches import DEFAULT_RUN

#: The actions Dask's startstops carry that get a column of their own; any other action
#: (e.g. a plugin's) is counted as "other".
ACTIONS = ("compute", "transfer", "disk-read", "disk-write")
#: Column names of the per-task seconds, in the order of :data:`ACTIONS`, then "other".
ACTION_COLUMNS = ("compute", "transfer", "disk_read", "disk_write", "other")
OTHER = len(ACTIONS)
_ACTION_INDEX = {a: i for i, a in enumerate(ACTIONS)}


def action_index(action: str) -> int:
    """The position of an action's seconds in :data:`ACTION_COLUMNS`."""
    return _ACTION_INDEX.get(action, OTHER)


#: The span Dask files work outside any ``span(...)`` under.
DEFAULT_SPAN = "default"


def display_name(name: str | None, run_key: str) -> str | None:
    """What a run is called: its span name, else its run key (the default run has none)."""
    return name or (None if run_key == DEFAULT_RUN else run_key)


def makespan(task_start: float | None, task_stop: float | None) -> float | None:
    """First task start to last task stop, in seconds (None before any task)."""
    if task_start is None or task_stop is None:
        return None
    return task_stop - task_start


def fingerprint(name: str | None, run_key: str, prefixes: Iterable[str]) -> str:
    """A stable identity of "the same job": its display name when it has one, else its set
    of task prefixes. 16 hex digits of sha256. Dask's span ``default`` (work outside any
    span) names no job: every such run shared one fingerprint, so regressions, the trend
    and "the previous run of this job" mixed unrelated work."""
    shown = display_name(name, run_key)
    if shown == DEFAULT_SPAN:
        shown = None
    basis = f"name:{shown}" if shown else "prefixes:" + ",".join(sorted(set(prefixes)))
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


def seconds_by_action(totals: Mapping[str, float]) -> dict[str, float]:
    """Seconds per action for a run, the four Dask actions always present."""
    out = dict.fromkeys(ACTIONS, 0.0)
    for action, seconds in totals.items():
        out[action] = out.get(action, 0.0) + seconds
    return out


@dataclass(slots=True)
class TaskPhases:
    """Per-task figures from the tasks' phases (NumPy arrays, one entry per task).

    ``seconds`` has a column per :data:`ACTION_COLUMNS`; ``start``/``stop`` are the first
    start and last stop over all phases (NaN without phases); ``compute_start`` and
    ``compute_stop`` are those of the first compute phase."""

    seconds: Any
    start: Any
    stop: Any
    compute_start: Any
    compute_stop: Any


def flatten_phases(tasks: Sequence[TaskEvent]) -> tuple[Any, list[str], Any, Any]:
    """Every phase of ``tasks`` in order: the task index of each (NumPy), its action, and
    its start and stop (NumPy)."""
    import numpy as np

    phase_lists = [e.startstops for e in tasks]
    flat = list(chain.from_iterable(phase_lists))
    task = np.repeat(np.arange(len(tasks), dtype=np.int64), np.array(list(map(len, phase_lists))))
    start = np.array([s.start for s in flat], dtype=np.float64)
    stop = np.array([s.stop for s in flat], dtype=np.float64)
    return task, [s.action for s in flat], start, stop


def phases_of(tasks: Sequence[TaskEvent]) -> TaskPhases:
    """:func:`task_phases` of task events."""
    import numpy as np

    task, actions, start, stop = flatten_phases(tasks)
    index = np.array([action_index(a) for a in actions], dtype=np.int64)
    return task_phases(task, index, start, stop, len(tasks))


def task_phases(task: Any, action: Any, start: Any, stop: Any, n_tasks: int) -> TaskPhases:
    """Sum the phases of ``n_tasks`` tasks. ``task`` (the task index of each phase, phases of
    one task contiguous and in order), ``action`` (:func:`action_index` of each phase),
    ``start`` and ``stop`` are NumPy arrays with one entry per phase."""
    import numpy as np

    d = stop - start
    seconds = np.bincount(
        task * len(ACTION_COLUMNS) + action, weights=d, minlength=n_tasks * len(ACTION_COLUMNS)
    ).reshape(n_tasks, len(ACTION_COLUMNS))
    first = np.full(n_tasks, np.nan)
    last = np.full(n_tasks, np.nan)
    cstart = np.full(n_tasks, np.nan)
    cstop = np.full(n_tasks, np.nan)
    if len(task):
        # Phases of a task are contiguous: reduce over each task's run of phases.
        bounds = np.flatnonzero(np.concatenate(([True], task[1:] != task[:-1])))
        owners = task[bounds]
        first[owners] = np.minimum.reduceat(start, bounds)
        last[owners] = np.maximum.reduceat(stop, bounds)
        comp = np.flatnonzero(action == 0)
        if len(comp):
            # the first compute phase of each task: assign in reverse so the first wins
            rev = comp[::-1]
            cstart[task[rev]] = start[rev]
            cstop[task[rev]] = stop[rev]
    return TaskPhases(seconds, first, last, cstart, cstop)
