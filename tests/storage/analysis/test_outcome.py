"""How a run's tasks ended (the run page's outcome), counted over records read a part at a
time, equals counting each key's records in Python."""

from __future__ import annotations

import pytest

from storage.analysis.outcome import outcome
from storage.analysis.rundata import RunData
from tests.storage.analysis.test_critical_path_columnar import InParts, synthetic_run


def by_hand(data: RunData) -> dict[str, int]:
    records: dict[str, list[tuple[float, int, str]]] = {}
    for i, r in enumerate(data.tasks.select(["key", "stop", "status"]).to_pylist()):
        stop = float("-inf") if r["stop"] is None else r["stop"]
        records.setdefault(r["key"], []).append((stop, i, r["status"]))
    ends = {k: sorted(v)[-1][2] for k, v in records.items()}
    errored = {k for k, v in records.items() if any(s == "erred" for *_, s in v)}
    graph = data.graph["key"].to_pylist()
    return {
        "keys": len(records),
        "erred_keys": sum(e == "erred" for e in ends.values()),
        "errored_keys": len(errored),
        "recovered_keys": sum(ends[k] == "memory" for k in errored),
        "graph": len(graph),
        "unrecorded": sum(k not in records for k in graph),
    }


@pytest.mark.parametrize("seed", range(6))
def test_outcome_counts_each_keys_records(seed: int) -> None:
    data = synthetic_run(60 + 30 * seed, seed)
    # a graph key that never ran
    graph = data.graph.to_pylist() + [
        {"key": "never", "prefix": "t", "dependencies": [], "submitted": []}
    ]
    data.graph = data.graph.from_pylist(graph, schema=data.graph.schema)
    want = by_hand(data)
    assert want["errored_keys"] > want["erred_keys"] > 0 and want["recovered_keys"] > 0
    assert want["unrecorded"] >= 1
    parted = InParts(data.tasks, data.graph, data.metrics, tag="t", source="raw")
    assert outcome(data) == want == outcome(parted)
