"""How a run's tasks ended, and the run page's facts computed from its tables."""

from __future__ import annotations

from typing import Any

from storage.analysis.critical_path import critical_path
from storage.analysis.errors import errors
from storage.analysis.rundata import RunData
from storage.analysis.tasks import progress

#: Buckets of the run page's progress chart.
PAGE_PROGRESS_BUCKETS = 120


def outcome(data: RunData) -> dict[str, int]:
    """How the run's tasks ended: ``keys``, the distinct tasks with a record (``task_count``
    counts every execution: a retry or a recomputation again); ``erred_keys``, those whose
    last record (by stop) erred; ``errored_keys``, those with an erred record, and of them
    ``recovered_keys``, whose last record succeeded (``client.retry``); ``graph``, the
    distinct tasks of the recorded graph, and ``unrecorded``, those of them without a
    record (never ran: cancelled, the client left; or their records were lost)."""
    import numpy as np
    import pyarrow.compute as pc

    t = data.tasks
    out = {
        "keys": 0,
        "erred_keys": 0,
        "errored_keys": 0,
        "recovered_keys": 0,
        "graph": data.graph.num_rows,
        "unrecorded": 0,
    }
    if data.graph.num_rows:
        recorded = pc.is_in(data.graph["key"], value_set=t["key"].combine_chunks())
        out["unrecorded"] = int(pc.sum(pc.invert(recorded)).as_py() or 0)
    n = t.num_rows
    if not n:
        return out
    # a key's records by stop (a record without one first), the last one its end
    order = pc.sort_indices(
        t.select(["key", "stop"]),
        sort_keys=[("key", "ascending"), ("stop", "ascending", "at_start")],
    )
    keys = pc.take(t["key"], order).combine_chunks()
    codes = np.asarray(pc.dictionary_encode(keys).indices)
    first = np.ones(n, dtype=bool)
    first[1:] = codes[1:] != codes[:-1]
    last = np.ones(n, dtype=bool)
    last[:-1] = first[1:]
    status = pc.take(t["status"], order)
    erred = np.asarray(pc.fill_null(pc.equal(status, "erred"), False))
    memory = np.asarray(pc.fill_null(pc.equal(status, "memory"), False))
    any_erred = np.maximum.reduceat(erred, np.flatnonzero(first))
    out["keys"] = int(first.sum())
    out["erred_keys"] = int(erred[last].sum())
    out["errored_keys"] = int(any_erred.sum())
    out["recovered_keys"] = int((any_erred & memory[last]).sum())
    return out


def facts_of(data: RunData) -> dict[str, Any]:
    """The run page's critical path, progress, errors and outcome, computed from the run's
    tables."""
    return {
        "critical": critical_path(data),
        "progress": progress(data, PAGE_PROGRESS_BUCKETS),
        "errors": errors(data),
        "outcome": outcome(data),
    }
