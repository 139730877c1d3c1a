"""How a run's tasks ended, and the run page's facts computed from its tables."""

from __future__ import annotations

from typing import Any

from storage.analysis.critical_path import critical_path
from storage.analysis.errors import errors
from storage.analysis.keyhash import hashes
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

    # per record: its key's hash, its stop (a record without one first) and how it ended,
    # read a row group at a time (a big run's keys are not held as strings)
    got: dict[str, list[Any]] = {"key": [], "stop": [], "erred": [], "memory": []}
    for t in data.parts("tasks", ["key", "stop", "status"]):
        got["key"].append(hashes(t["key"]))
        got["stop"].append(np.asarray(pc.fill_null(t["stop"], -np.inf), dtype=np.float64))
        for status in ("erred", "memory"):
            got[status].append(
                np.asarray(pc.fill_null(pc.equal(t["status"], status), False), dtype=bool)
            )
    key, stop, erred, memory = (np.concatenate(got.pop(c)) for c in list(got))
    graph_keys = data.columns("graph", ["key"])["key"]
    out = {
        "keys": 0,
        "erred_keys": 0,
        "errored_keys": 0,
        "recovered_keys": 0,
        "graph": len(graph_keys),
        "unrecorded": 0,
    }
    if len(graph_keys):
        recorded = np.isin(hashes(graph_keys.combine_chunks()), key)
        out["unrecorded"] = int((~recorded).sum())
    n = len(key)
    if not n:
        return out
    # a key's records by stop (ties in table order), the last one its end
    order = np.lexsort((stop, key))
    codes = key[order]
    del key, stop
    first = np.ones(n, dtype=bool)
    first[1:] = codes[1:] != codes[:-1]
    last = np.ones(n, dtype=bool)
    last[:-1] = first[1:]
    erred, memory = erred[order], memory[order]
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


#: Groups the task graph's prefix view draws at most (the largest; the rest are counted).
GRAPH_GROUPS = 200


def graph_groups(data: RunData, most: int = GRAPH_GROUPS) -> dict[str, Any]:
    """The task graph grouped by prefix, the view of a graph past the page's node budget:
    ``groups`` (prefix, tasks, depth: the longest chain of groups from a group with no
    dependency, an edge closing a cycle of groups left out of it), ``edges`` (from the
    prefix depended on to the dependent one, and how many task dependencies it stands
    for; within a group none), the ``most`` largest groups and ``other_groups`` /
    ``other_tasks`` left out. Vectorised over the graph's Arrow columns (a key's first
    record when a submission sent it again)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    g = data.columns("graph", ["key", "prefix", "dependencies"])
    if not g.num_rows:
        return {"groups": [], "edges": [], "other_groups": 0, "other_tasks": 0}
    codes = np.asarray(pc.dictionary_encode(g["key"].combine_chunks()).indices)
    _, first = np.unique(codes, return_index=True)
    g = g.take(pa.array(np.sort(first)))
    keys = g["key"].combine_chunks()
    prefix = pc.fill_null(g["prefix"].combine_chunks(), "")
    deps = g["dependencies"].combine_chunks()
    at = pc.index_in(pc.list_flatten(deps), value_set=keys)
    src = pc.take(prefix, at)
    dst = pc.take(prefix, pc.list_parent_indices(deps))
    pairs = pa.table({"src": src, "dst": dst})
    pairs = pairs.filter(pc.and_(pc.is_valid(src), pc.not_equal(src, dst)))
    counted = pa.table({"prefix": prefix}).group_by("prefix").aggregate([("prefix", "count")])
    sizes = dict(
        zip(counted["prefix"].to_pylist(), counted["prefix_count"].to_pylist(), strict=True)
    )
    kept = sorted(sizes, key=lambda p: (-sizes[p], p))[:most]
    shown = set(kept)
    edges = []
    if pairs.num_rows:
        agg = pairs.group_by(["src", "dst"]).aggregate([("src", "count")])
        for s, d, n in zip(
            agg["src"].to_pylist(),
            agg["dst"].to_pylist(),
            agg["src_count"].to_pylist(),
            strict=True,
        ):
            if s in shown and d in shown:
                edges.append({"src": s, "dst": d, "count": n})
    edges.sort(key=lambda e: (e["src"], e["dst"]))
    depth = _group_depths(kept, edges)
    return {
        "groups": [{"prefix": p, "tasks": sizes[p], "depth": depth[p]} for p in kept],
        "edges": edges,
        "other_groups": len(sizes) - len(kept),
        "other_tasks": sum(sizes.values()) - sum(sizes[p] for p in kept),
    }


def _group_depths(groups: list[str], edges: list[dict[str, Any]]) -> dict[str, int]:
    """Each group's longest chain from a group with no dependency; an edge that closes a
    cycle (met again on the depth-first walk) is left out."""
    deps: dict[str, list[str]] = {p: [] for p in groups}
    for e in edges:
        deps[e["dst"]].append(e["src"])
    depth: dict[str, int] = {}
    on_stack: set[str] = set()
    for root in groups:
        if root in depth:
            continue
        stack = [(root, iter(deps[root]))]
        on_stack.add(root)
        while stack:
            node, it = stack[-1]
            nxt = next((d for d in it if d not in on_stack and d not in depth), None)
            if nxt is not None:
                stack.append((nxt, iter(deps[nxt])))
                on_stack.add(nxt)
                continue
            stack.pop()
            on_stack.discard(node)
            if node not in depth:
                depth[node] = 1 + max((depth[d] for d in deps[node] if d in depth), default=-1)
    return depth
