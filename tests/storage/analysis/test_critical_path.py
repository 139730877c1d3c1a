"""Analysis on hand-made runs where the right answer is known exactly: the critical path
(transfers, waiting, worker clock skew) and the mergeable histogram's quantiles."""

from __future__ import annotations

import json
import random

import pytest

from storage.analysis import sketch
from storage.analysis.critical_path import critical_path
from storage.analysis.rundata import RunData
from storage.runs.runfile import _schemas


def run_data(
    tasks: list[dict], edges: dict[str, list[str]], submitted: dict[str, list[float]] | None = None
) -> RunData:
    import pyarrow as pa

    ts, gs, ms = _schemas()
    rows = []
    for t in tasks:
        ss = t["startstops"]
        comp = [s for s in ss if s["action"] == "compute"][0]
        rows.append({
            "key": t["key"], "prefix": t["key"].split("-")[0], "group": None, "worker": t["worker"],
            "thread": 1, "status": t.get("status", "memory"), "nbytes": 8, "typename": "int", "exception": None,
            "traceback": None, "start": min(s["start"] for s in ss), "stop": max(s["stop"] for s in ss),
            "compute_start": comp["start"], "compute_stop": comp["stop"],
            "compute": comp["stop"] - comp["start"],
            "transfer": sum(s["stop"] - s["start"] for s in ss if s["action"] == "transfer"),
            "disk_read": 0.0, "disk_write": 0.0, "startstops": json.dumps(ss),
        })  # fmt: skip
    graph = [{"key": k, "prefix": k.split("-")[0], "dependencies": v,
              "submitted": (submitted or {}).get(k, [])} for k, v in edges.items()]  # fmt: skip
    return RunData(pa.Table.from_pylist(rows, ts), pa.Table.from_pylist(graph, gs),
                   ms.empty_table(), tag="t", source="raw")  # fmt: skip


def c(start: float, stop: float) -> dict:
    return {"action": "compute", "start": start, "stop": stop}


def path_of(
    tasks: list[dict], edges: dict[str, list[str]], submitted: dict[str, list[float]] | None = None
) -> tuple[dict, list[tuple]]:
    """The critical path of hand-made tasks, and its segments as (kind, key, start, stop)."""
    cp = critical_path(run_data(tasks, edges, submitted))
    return cp, [(s["kind"], s["key"], s["start"], s["stop"]) for s in cp["segments"]]


def test_critical_path_segments_compute_transfer_and_wait():
    tasks = [
        {"key": "load-1", "worker": "a", "startstops": [c(0.0, 2.0)]},
        {"key": "load-2", "worker": "b", "startstops": [c(0.0, 1.0)]},  # not critical
        {"key": "add-1", "worker": "b", "startstops": [
            {"action": "transfer", "start": 2.5, "stop": 3.0, "source": "a"}, c(3.5, 4.0)]},
        {"key": "sum-1", "worker": "b", "startstops": [c(4.0, 6.0)]},
    ]  # fmt: skip
    cp, got = path_of(tasks, {"add-1": ["load-1", "load-2"], "sum-1": ["add-1"]})
    assert got == [
        ("compute", "load-1", 0.0, 2.0),
        ("wait", "add-1", 2.0, 2.5),
        ("transfer", "add-1", 2.5, 3.0),
        ("wait", "add-1", 3.0, 3.5),
        ("compute", "add-1", 3.5, 4.0),
        ("compute", "sum-1", 4.0, 6.0),
    ]
    assert cp["makespan"] == 6.0 and cp["totals"] == {"compute": 4.5, "transfer": 0.5, "wait": 1.0}
    assert cp["clock_skew_seconds"] == 0.0


def test_critical_path_names_a_tasks_own_phases_after_its_compute():
    """The last task's disk-write after its compute (it sets
    the task's stop) was counted as waiting."""
    tasks = [
        {"key": "load-1", "worker": "a", "startstops": [
            c(0.0, 1.0), {"action": "disk-write", "start": 1.0, "stop": 1.25}]},
        {"key": "save-1", "worker": "a", "startstops": [
            c(1.5, 2.0), {"action": "disk-write", "start": 2.0, "stop": 2.5}]},
    ]  # fmt: skip
    cp, got = path_of(tasks, {"save-1": ["load-1"]})
    assert got == [
        ("compute", "load-1", 0.0, 1.0),
        ("disk-write", "load-1", 1.0, 1.25),
        ("wait", "save-1", 1.25, 1.5),
        ("compute", "save-1", 1.5, 2.0),
        ("disk-write", "save-1", 2.0, 2.5),
    ]
    assert cp["totals"] == {"compute": 1.5, "disk-write": 0.75, "wait": 0.25}


def test_critical_path_tells_a_task_not_yet_submitted_from_one_waiting():
    """In one span, base ran, then a 3 s slowstep was computed
    and waited for, and only then was finish(base) submitted. The path read 3 s of "wait"
    for finish (queued, or no free thread), though no thread was busy and nothing was
    queued: finish did not exist. With the graph's submission times that time is
    "unsubmitted". The step stays with the dependency: what the client waited for is not
    recorded (the task that ended last before the submission was, in a busy run, often
    not it)."""
    tasks = [
        {"key": "base-0", "worker": "a", "startstops": [c(0.0, 0.25)]},
        {"key": "slow-0", "worker": "b", "startstops": [c(0.25, 3.0)]},
        {"key": "finish-0", "worker": "a", "startstops": [c(3.5, 3.75)]},
    ]
    edges = {"base-0": [], "slow-0": [], "finish-0": ["base-0"]}
    cp, got = path_of(tasks, edges, {"base-0": [0.0], "slow-0": [0.0], "finish-0": [3.25]})
    assert got == [
        ("compute", "base-0", 0.0, 0.25),
        ("unsubmitted", "finish-0", 0.25, 3.25),
        ("wait", "finish-0", 3.25, 3.5),
        ("compute", "finish-0", 3.5, 3.75),
    ]
    assert cp["totals"] == {"compute": 0.5, "unsubmitted": 3.0, "wait": 0.25}
    # Recorded without submission times (an agent before 2026-11-26): all of it waiting.
    cp, got = path_of(tasks, edges)
    assert [kind for kind, *_ in got] == ["compute", "wait", "compute"]
    # Submitted before its dependency ended: waiting, as ever.
    _, got = path_of(tasks, edges, {"base-0": [0.0], "slow-0": [0.0], "finish-0": [0.0]})
    assert [kind for kind, *_ in got] == ["compute", "wait", "compute"]


def test_a_key_computed_again_counts_from_its_own_submission():
    """A reviewer's case: a later computation of the run recomputed a-0; its record's
    submission is the later one, not the key's first."""
    tasks = [
        {"key": "a-0", "worker": "a", "startstops": [c(100.0, 110.0)]},
        {"key": "b-0", "worker": "a", "startstops": [c(110.0, 120.0)]},
        {"key": "a-0", "worker": "b", "startstops": [c(205.0, 210.0)]},
        {"key": "c-0", "worker": "b", "startstops": [c(210.0, 215.0)]},
    ]
    edges = {"a-0": [], "b-0": ["a-0"], "c-0": ["a-0"]}
    cp, got = path_of(tasks, edges, {"a-0": [100.0, 200.0], "b-0": [100.0], "c-0": [200.0]})
    assert got == [
        ("unsubmitted", "a-0", 100.0, 200.0),
        ("wait", "a-0", 200.0, 205.0),
        ("compute", "a-0", 205.0, 210.0),
        ("compute", "c-0", 210.0, 215.0),
    ]


def test_critical_path_clips_clock_skew_between_workers():
    # b's clock runs 0.25 s behind: its task appears to start before its dependency ended.
    tasks = [
        {"key": "load-1", "worker": "a", "startstops": [c(0.0, 2.0)]},
        {"key": "add-1", "worker": "b", "startstops": [c(1.75, 3.0)]},
    ]
    cp, got = path_of(tasks, {"add-1": ["load-1"]})
    assert got == [("compute", "load-1", 0.0, 1.75), ("compute", "add-1", 1.75, 3.0)]
    assert cp["clock_skew_seconds"] == pytest.approx(0.25)
    assert sum(s["seconds"] for s in cp["segments"]) == cp["makespan"] == 3.0


def test_critical_path_covers_a_run_that_computed_keys_twice():
    """A run that computed the same keys twice (a second
    compute(), a recomputation after a worker died) kept one record per key, so the path
    started at the second computation and covered 0.31 s of a 1.63 s run."""
    tasks = [
        {"key": "load-1", "worker": "a", "startstops": [c(0.0, 0.5)]},
        {"key": "sum-1", "worker": "a", "startstops": [c(0.5, 0.75)]},
        {"key": "load-1", "worker": "b", "startstops": [c(1.0, 1.5)]},
        {"key": "sum-1", "worker": "b", "startstops": [c(1.75, 2.0)]},
    ]
    cp, got = path_of(tasks, {"sum-1": ["load-1"]})
    assert got == [
        ("wait", "load-1", 0.0, 1.0),
        ("compute", "load-1", 1.0, 1.5),
        ("wait", "sum-1", 1.5, 1.75),
        ("compute", "sum-1", 1.75, 2.0),
    ]
    assert cp["makespan"] == sum(s["seconds"] for s in cp["segments"]) == 2.0
    # the recomputation's worker clock runs ahead: it appears to end after sum-1 began,
    # and is still the record sum-1 waited for
    skewed = [*tasks[:3], {"key": "sum-1", "worker": "a", "startstops": [c(1.4, 2.0)]}]
    cp, got = path_of(skewed, {"sum-1": ["load-1"]})
    assert [(kind, key) for kind, key, *_ in got] == [
        ("wait", "load-1"), ("compute", "load-1"), ("compute", "sum-1")]  # fmt: skip
    assert cp["clock_skew_seconds"] == pytest.approx(0.1)


def test_a_tasks_failed_attempts_are_not_waiting():
    """An attempt that erred and ran again (``retries=``, ``client.retry``) is its own
    segment, not waiting for the task."""
    tasks = [
        {"key": "load-1", "worker": "a", "startstops": [c(0.0, 1.0)]},
        {"key": "sum-1", "worker": "a", "status": "erred", "startstops": [c(1.0, 2.0)]},
        # its second attempt, on another worker whose clock reads a little ahead
        {"key": "sum-1", "worker": "b", "status": "erred", "startstops": [c(2.25, 3.02)]},
        {"key": "sum-1", "worker": "a", "startstops": [c(3.0, 4.0)]},
    ]
    cp, got = path_of(tasks, {"sum-1": ["load-1"]})
    assert got == [
        ("compute", "load-1", 0.0, 1.0),
        ("failed", "sum-1", 1.0, 2.0),
        ("wait", "sum-1", 2.0, 2.25),
        ("failed", "sum-1", 2.25, 3.0),
        ("compute", "sum-1", 3.0, 4.0),
    ]
    assert [s["worker"] for s in cp["segments"]] == ["a", "a", "a", "b", "a"]
    assert cp["totals"] == pytest.approx({"compute": 2.0, "failed": 1.75, "wait": 0.25})
    assert cp["makespan"] == sum(s["seconds"] for s in cp["segments"]) == 4.0


def test_a_failed_attempt_that_reads_as_started_before_its_submission_is_one_segment():
    # A root task retried: its worker's clock, corrected to the scheduler's by an estimate,
    # puts the failed attempt's start 5 ms before the scheduler received the task.
    tasks = [
        {"key": "flaky-0", "worker": "a", "status": "erred", "startstops": [c(0.995, 1.3)]},
        {"key": "flaky-0", "worker": "a", "startstops": [c(1.31, 1.5)]},
    ]
    cp, got = path_of(tasks, {"flaky-0": []}, {"flaky-0": [1.0]})
    assert got == [
        ("failed", "flaky-0", 0.995, 1.3),
        ("wait", "flaky-0", 1.3, 1.31),
        ("compute", "flaky-0", 1.31, 1.5),
    ]
    assert cp["makespan"] == pytest.approx(sum(s["seconds"] for s in cp["segments"]))


def test_histogram_quantiles_merge_and_stay_within_the_bucket_error():
    rng = random.Random(0)
    runs = [[rng.lognormvariate(-2, 1.5) for _ in range(rng.randint(100, 2000))] for _ in range(20)]
    hists = []
    for durations in runs:
        h: dict[int, int] = {}
        for d in durations:
            b = sketch.bucket(d)
            h[b] = h.get(b, 0) + 1
        hists.append(h)
    merged = sketch.merge(hists)
    values = sorted(d for r in runs for d in r)
    for q, got in zip((0.5, 0.9, 0.99), sketch.quantiles(merged, (0.5, 0.9, 0.99)), strict=True):
        exact = values[max(1, -(-int(q * len(values) * 1e6) // int(1e6))) - 1]
        assert got == pytest.approx(exact, rel=0.045)
    assert sketch.quantiles({}, (0.5,)) == [None]
    assert sketch.quantiles({sketch.bucket(0.0): 3}, (0.5,)) == [0.0]
