"""The columnar critical path equals the row-wise walk it replaced, on synthetic runs with
everything that walk distinguishes: keys computed more than once, failed attempts,
dependencies without a record, late submissions, tied stops and transfers."""

from __future__ import annotations

import json
import random
from typing import Any

import pyarrow as pa
import pytest

from storage.analysis.critical_path import critical_path
from storage.analysis.rundata import RunData
from tests.storage.analysis.critical_path_rows import critical_path_rows


def synthetic_run(n: int, seed: int) -> RunData:
    rng = random.Random(seed)
    rows = []
    graph = []
    t = 1000.0
    for i in range(n):
        key = f"t-{i}"
        deps = [f"t-{rng.randrange(i)}" for _ in range(rng.randrange(3))] if i else []
        if i and rng.random() < 0.8:
            deps.append(f"t-{i - 1}")  # long chains
        if rng.random() < 0.1:
            deps.append(f"ghost-{i}")  # a dependency that never ran
        submitted = [t + rng.choice([0.0, 0.5])]
        graph.append({"key": key, "prefix": "t", "dependencies": deps, "submitted": submitted})
        for attempt in range(1 + (rng.random() < 0.2)):
            s = round(t + rng.random() * 2, 1)  # coarse times: tied stops
            phases = []
            if rng.random() < 0.3:
                phases.append({"action": "transfer", "start": s - 0.2, "stop": s, "source": "w1"})
            stop = round(s + rng.random(), 1)
            phases.append({"action": "compute", "start": s, "stop": stop})
            if rng.random() < 0.1:
                phases.append({"action": "disk-write", "start": stop, "stop": stop + 0.1})
            no_stop = rng.random() < 0.02
            rows.append(
                {
                    "key": key,
                    "prefix": "t",
                    "worker": f"w{rng.randrange(3)}",
                    "status": "erred" if attempt == 0 and rng.random() < 0.5 else "memory",
                    "start": None if no_stop else phases[0]["start"],
                    "stop": None if no_stop else phases[-1]["stop"],
                    "compute_start": s,
                    "compute_stop": stop,
                    "startstops": json.dumps(phases),
                }
            )
            t += 0.3
    rng.shuffle(rows)
    tasks = pa.Table.from_pylist(rows)
    g = pa.Table.from_pylist(
        graph,
        schema=pa.schema(
            [
                ("key", pa.string()),
                ("prefix", pa.string()),
                ("dependencies", pa.list_(pa.string())),
                ("submitted", pa.list_(pa.float64())),
            ]
        ),
    )
    return RunData(tasks, g, pa.table({"worker": []}), tag="t", source="raw")


class InParts(RunData):
    """A run whose tasks are read a few rows at a time, as a big compacted run's are."""

    def parts(self, name: str, columns: list[str], rows: int = 65_536) -> Any:
        yield from super().parts(name, columns, 7)


@pytest.mark.parametrize("seed", range(12))
def test_columnar_walk_equals_the_row_wise_one(seed: int) -> None:
    data = synthetic_run(50 + 40 * seed, seed)
    got = critical_path(data)
    assert got == critical_path_rows(data)
    parted = InParts(data.tasks, data.graph, data.metrics, tag="t", source="raw")
    assert critical_path(parted) == got


def test_the_synthetic_runs_walk_every_case() -> None:
    """The runs compared above take the walk through long chains and every kind of
    segment, failed attempts and unsubmitted time included."""
    paths = [critical_path(synthetic_run(50 + 40 * seed, seed)) for seed in range(12)]
    assert max(p["tasks"] for p in paths) >= 20
    kinds = {s["kind"] for p in paths for s in p["segments"]}
    assert kinds >= {"compute", "transfer", "disk-write", "failed", "unsubmitted", "wait"}


def test_run_without_finished_tasks() -> None:
    data = synthetic_run(3, 0)
    data.tasks = data.tasks.set_column(
        data.tasks.schema.get_field_index("stop"),
        "stop",
        pa.nulls(data.tasks.num_rows, pa.float64()),
    )
    assert critical_path(data) == critical_path_rows(data)


def progress_rows(data: RunData, buckets: int) -> dict:
    """The run page's progress as it was counted before: a Python pair per task."""
    from collections import defaultdict

    stops = [
        (s, p)
        for s, p in zip(
            data.tasks["stop"].to_pylist(), data.tasks["prefix"].to_pylist(), strict=True
        )
        if s is not None
    ]
    if not stops:
        return {"start": None, "bucket_seconds": None, "times": [], "prefixes": {}}
    t0 = min(s for s, _ in stops)
    t1 = max(s for s, _ in stops)
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    counts: dict = defaultdict(lambda: [0] * buckets)
    for s, p in stops:
        counts[p][min(buckets - 1, int((s - t0) / width))] += 1
    return {
        "start": t0,
        "bucket_seconds": width,
        "times": [t0 + (i + 1) * width for i in range(buckets)],
        "prefixes": dict(sorted(counts.items())),
    }


@pytest.mark.parametrize("seed", range(4))
def test_progress_on_arrays_equals_the_row_wise_count(seed: int) -> None:
    from storage.analysis.tasks import progress

    data = synthetic_run(200, seed)
    rng = random.Random(seed)
    prefixes = [rng.choice(["a", "b", "c-d"]) for _ in range(data.tasks.num_rows)]
    data.tasks = data.tasks.set_column(
        data.tasks.schema.get_field_index("prefix"), "prefix", pa.array(prefixes)
    )
    got = progress(data, 120)
    assert got == progress_rows(data, 120)
    assert sum(map(sum, got["prefixes"].values())) == sum(
        s is not None for s in data.tasks["stop"].to_pylist()
    )
