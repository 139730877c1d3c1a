"""Replay from exact times: at any moment, the tasks finished, running and erred per prefix
are the task records', whatever the last sample (up to one interval old) said."""

from __future__ import annotations

import random

from storage.query.replay import exact_counts, with_records
from tests.storage.analysis.test_critical_path import c, run_data


def test_done_counts_at_any_moment_are_the_records():
    rng = random.Random(7)
    tasks = []
    for i in range(40):
        start = rng.uniform(0, 10)
        tasks.append(
            {
                "key": f"{'enrich' if i % 2 else 'parse'}-{i}",
                "worker": "a",
                "status": "erred" if i % 13 == 0 else "memory",
                "startstops": [c(start, start + rng.uniform(0.1, 3))],
            }
        )
    data = run_data(tasks, {})
    for at in [-1.0, 0.5, 2.0, 5.5, 9.9, 14.0]:
        exact = exact_counts(data, at)
        for prefix in ("parse", "enrich"):
            mine = [t for t in tasks if t["key"].startswith(prefix)]
            stop = [max(s["stop"] for s in t["startstops"]) for t in mine]
            start = [min(s["start"] for s in t["startstops"]) for t in mine]
            done = sum(
                1 for t, s in zip(mine, stop, strict=True) if s <= at and t["status"] != "erred"
            )
            erred = sum(
                1 for t, s in zip(mine, stop, strict=True) if s <= at and t["status"] == "erred"
            )
            running = sum(1 for a, b in zip(start, stop, strict=True) if a <= at < b)
            got = exact.get(prefix, {"done": 0, "erred": 0, "processing": 0})
            assert (got["done"], got["erred"], got["processing"]) == (done, erred, running), at
        # A stale sample (everything still waiting) takes the records' counts, and its
        # total stays the total.
        stale = {"parse": [20, 0, 0, 0, 0], "enrich": [20, 0, 0, 0, 0]}
        merged = with_records(stale, exact)
        for prefix, (waiting, processing, memory, released, err) in merged.items():
            e = exact.get(prefix)
            if e is None:
                continue
            assert memory + released == e["done"] and err == e["erred"]
            assert waiting + processing + memory + released + err == 20


def test_a_retried_task_counts_once_by_its_latest_state():
    tasks = [
        {"key": "call-1", "worker": "a", "status": "erred", "startstops": [c(0.0, 1.0)]},
        {"key": "call-1", "worker": "b", "startstops": [c(2.0, 3.0)]},
    ]
    data = run_data(tasks, {})
    assert exact_counts(data, 1.5)["call"] == {"total": 1, "done": 0, "erred": 1, "processing": 0}
    assert exact_counts(data, 2.5)["call"]["processing"] == 1
    assert exact_counts(data, 2.5)["call"]["erred"] == 0  # running again: its latest record
    assert exact_counts(data, 3.5)["call"] == {"total": 1, "done": 1, "erred": 0, "processing": 0}


def test_a_task_a_worker_holds_before_a_thread_takes_it_stays_processing():
    """Dask counts a task queued on a worker as processing; it has no record until it runs."""
    data = run_data([{"key": "f-1", "worker": "a", "startstops": [c(0.0, 1.0)]}], {})
    merged = with_records({"f": [0, 3, 0, 0, 0]}, exact_counts(data, 0.5))
    assert merged["f"] == [0, 3, 0, 0, 0]
    merged = with_records({"f": [0, 3, 0, 0, 0]}, exact_counts(data, 1.5))
    assert merged["f"] == [0, 2, 1, 0, 0]
