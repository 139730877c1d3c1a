"""Replay samples: each open run's task states by prefix and the cluster's workers, taken
on the scheduler's sampling callback (see ``StateEvent``).

Dask keeps per-state counts on every ``TaskGroup`` (``group.states``, updated by the
scheduler on every transition), and a run's span holds its groups, so a sample costs one
walk over the run's groups: nothing is added to the per-transition path. If that walk
ever takes more than ``BUDGET`` of the time between samples (a run with a great many
groups), samples are spaced out so that it does not.

Nothing here raises into Dask: callers wrap every call.
"""

from __future__ import annotations

import time
from typing import Any

from hindsight.schema import PrefixState, StateEvent, WorkerState

#: Largest share of the scheduler's time the state walk may take.
BUDGET = 0.01
#: Dask's task states in each of the five the status page shows.
STATE_COLUMNS = {
    "waiting": 0,
    "queued": 0,
    "no-worker": 0,
    "processing": 1,
    "memory": 2,
    "released": 3,
    "forgotten": 3,
    "erred": 4,
}
_INT_MAX = 2**53


def _count(value: Any) -> int:
    if isinstance(value, (int, float)) and value == value and value > 0:
        return int(min(value, _INT_MAX))
    return 0


def prefix_states(span: Any) -> dict[str, list[int]]:
    """{prefix: [waiting, processing, memory, released, erred]} over a span tree's groups."""
    out: dict[str, list[int]] = {}
    columns = STATE_COLUMNS
    for group in span.traverse_groups():
        name = group.prefix.name
        row = out.get(name)
        if row is None:
            row = out[name] = [0, 0, 0, 0, 0]
        for state, n in group.states.items():
            if n:
                row[columns.get(state, 0)] += n
    return out


def worker_state(address: str, values: dict[str, float]) -> tuple[Any, ...]:
    """A worker's replay figures from its metric sample
    (``hindsight.dask.values.worker_values``)."""
    get = values.get
    return (
        address,
        _count(get("memory.managed")),
        _count(get("memory.unmanaged")),
        _count(get("memory.spilled")),
        _count(get("memory.limit")),
        _count(get("tasks.processing")),
    )


def state_event(
    run: str, at: float, prefixes: dict[str, list[int]], workers: list[tuple[Any, ...]]
) -> StateEvent:
    """Deferred builder (runs on the agent thread)."""
    return StateEvent(
        run=run,
        time=at,
        prefixes=[
            PrefixState(
                prefix=p[:1024],
                waiting=c[0],
                processing=c[1],
                memory=c[2],
                released=c[3],
                erred=c[4],
            )
            for p, c in prefixes.items()
        ],
        workers=[
            WorkerState(
                worker=w[0][:1024],
                managed=w[1],
                unmanaged=w[2],
                spilled=w[3],
                limit=w[4],
                processing=w[5],
            )
            for w in workers
        ],
    )


class RunStates:
    """Sends a ``state`` sample of every open run each sample interval, and a last one
    when the run ends (stamped with its end, so replay after the end shows it done)."""

    def __init__(self, agent: Any, scheduler: Any, interval: float) -> None:
        self.agent = agent
        self.scheduler = scheduler
        self.spans = scheduler.extensions.get("spans")
        self.interval = interval
        self._last: dict[str, float] = {}
        self._not_before = 0.0
        # each worker's latest figures, and when workers left (see :meth:`final`)
        self._seen: dict[str, tuple[Any, ...]] = {}
        self._left: dict[str, float] = {}

    def sample(self, runs: Any, workers: list[tuple[Any, ...]], now: float) -> None:
        """A sample of each open run that has not finished (a finished one gets
        :meth:`final`)."""
        for w in workers:
            self._seen[w[0]] = w
        if self.spans is None or now < self._not_before:
            return
        t0 = time.perf_counter()
        for run in list(runs):
            span = self.spans.spans.get(run)
            if span is None or span.done:
                continue
            self.agent.add((state_event, run, now, prefix_states(span), workers))
            self._last[run] = now
        spent = time.perf_counter() - t0
        if spent > BUDGET * self.interval:
            self._not_before = now + spent / BUDGET

    def final(self, run: str, at: float, workers: list[tuple[Any, ...]]) -> None:
        """The run's last sample, at ``at`` (its end) or just after its latest sample.

        The scheduler sees a run done up to one interval after its end; a cluster closed
        right after its run may have lost workers by then. Workers that left after ``at``
        are in the sample as last seen, with nothing processing."""
        last = self._last.pop(run, None)
        span = self.spans.spans.get(run) if self.spans is not None else None
        if span is None:
            return
        if last is not None and at <= last:
            at = last + 1e-3
        present = {w[0] for w in workers}
        gone = [
            a for a, t in self._left.items() if t >= at and a not in present and a in self._seen
        ]
        workers = [(*w[:5], self._processing_at(w[0], at, w[5])) for w in workers]
        workers = [*workers, *((*self._seen[a][:5], 0) for a in gone)]
        self.agent.add((state_event, run, at, prefix_states(span), workers))

    def _processing_at(self, address: str, at: float, now: int) -> int:
        """Of the tasks processing on a worker now, those submitted by ``at``: the figures
        come up to one interval after a run's end, and a run started meanwhile showed its
        tasks at the end of the run before it."""
        ws = self.scheduler.workers.get(address)
        if ws is None or self.spans is None or not now:
            return now
        spans = self.spans.spans  # in creation order: none newer than ``at``, nothing to drop
        newest = spans[next(reversed(spans))] if spans else None
        if newest is None or newest.enqueued <= at:
            return now
        count = 0
        try:
            for ts in list(ws.processing):
                span = spans.get(ts.group.span_id)
                if span is None or span.enqueued <= at:
                    count += 1
        except Exception:  # never into the scheduler: the figure as it came, then
            return now
        return count

    def left(self, address: str, at: float) -> None:
        """A worker left the cluster at ``at`` (remembered a minute, for :meth:`final`)."""
        self._left[address] = at
        for a, t in list(self._left.items()):
            if t < at - 60:
                del self._left[a]
                self._seen.pop(a, None)
