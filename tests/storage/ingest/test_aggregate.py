"""The aggregation pass (vectorised for speed) gives exactly what a plain task-by-task
reading of the batch gives, on any batch: several runs, missing workers and runs, tasks
without phases, zero and negative durations, unknown actions, statuses, day boundaries."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hindsight.schema import Batch, GraphEvent, RunEvent, StartStop, TaskEvent
from storage.analysis import sketch
from storage.analysis.runfacts import ACTION_COLUMNS, action_index
from storage.core.batches import DEFAULT_RUN
from storage.ingest.aggregate import aggregate

T0 = 1_800_000_000.0 - 3_600.0  # an hour before a day boundary

phases = st.lists(
    st.builds(
        lambda a, s, d: StartStop(a, T0 + s, max(0.0, T0 + s + d)),
        st.sampled_from(["compute", "transfer", "disk-read", "disk-write", "plugin-x"]),
        st.floats(0, 7_200),
        st.sampled_from([0.0, -0.25, 1e-6, 0.5, 3.0, 900.0]),
    ),
    max_size=3,
)
tasks = st.builds(
    lambda i, p, s, r, w, nb, ss: TaskEvent(
        key=f"k{i}", prefix=p, status=s, run=r, worker=w, nbytes=nb, startstops=ss
    ),
    st.integers(0, 10**6),
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from(["memory", "memory", "erred", "lost"]),
    st.sampled_from([None, "r1", "r2", DEFAULT_RUN]),
    st.sampled_from([None, "w1", "w2", ""]),
    st.sampled_from([None, 0, 7, 10**12, -3]),
    phases,
)
others = st.one_of(
    st.builds(lambda r: GraphEvent(key="g", prefix="a", run=r), st.sampled_from([None, "r3"])),
    st.builds(lambda r: RunEvent("finished", r, T0), st.sampled_from(["r1", "r4"])),
)


def reference(batch: Batch) -> dict[str, Any]:
    """The batch's figures, one task and one phase at a time."""
    runs: dict[str, dict[str, Any]] = {}

    def run(key: str) -> dict[str, Any]:
        return runs.setdefault(
            key,
            {
                "tasks": 0,
                "errors": 0,
                "graph": 0,
                "nbytes": 0,
                "start": None,
                "stop": None,
                "statuses": {},
                "prefixes": {},
                "actions": {},
                "hists": {},
                "workers": {},
                "events": 0,
            },
        )

    hours: dict[int, list[Any]] = {}
    days: dict[tuple[str, str, int], list[Any]] = {}
    # the batch's latest time: a task without phases counts in its hour
    times = [t for ev in batch.events if isinstance(ev, TaskEvent)
             for ph in ev.startstops for t in (ph.start, ph.stop)]  # fmt: skip
    times += [ev.time for ev in batch.events if isinstance(ev, RunEvent)]
    latest = max(times, default=None)
    for ev in batch.events:
        if isinstance(ev, GraphEvent):
            run(ev.run or DEFAULT_RUN)["graph"] += 1
        elif isinstance(ev, RunEvent):
            run(ev.id)["events"] += 1
        elif isinstance(ev, TaskEvent):
            r = run(ev.run or DEFAULT_RUN)
            erred = ev.status == "erred"
            r["tasks"] += 1
            r["errors"] += erred
            r["nbytes"] += ev.nbytes or 0
            r["statuses"][ev.status] = r["statuses"].get(ev.status, 0) + 1
            p = r["prefixes"].setdefault(ev.prefix, [0, 0, 0])
            p[0] += 1
            p[1] += erred
            p[2] += ev.nbytes or 0
            seconds = [0.0] * len(ACTION_COLUMNS)
            first = last = None
            for ph in ev.startstops:
                d = ph.stop - ph.start
                seconds[action_index(ph.action)] += d
                first = ph.start if first is None else min(first, ph.start)
                last = ph.stop if last is None else max(last, ph.stop)
                a = r["actions"].setdefault((ev.prefix, ph.action), [0, 0.0, d, d])
                a[0] += 1
                a[1] += d
                a[2] = min(a[2], d)
                a[3] = max(a[3], d)
                h = r["hists"].setdefault((ev.prefix, ph.action), {})
                h[sketch.bucket(d)] = h.get(sketch.bucket(d), 0) + 1
                day = days.setdefault(
                    (ev.prefix, ph.action, math.floor(ph.start / 86400)), [0, 0.0, d, {}]
                )
                day[0] += 1
                day[1] += d
                day[2] = max(day[2], d)
                day[3][sketch.bucket(d)] = day[3].get(sketch.bucket(d), 0) + 1
            if first is not None:
                r["start"] = first if r["start"] is None else min(r["start"], first)
                r["stop"] = last if r["stop"] is None else max(r["stop"], last)
            if first is not None or latest is not None:
                hour = math.floor((first if first is not None else latest) / 3600)
                hr = hours.setdefault(hour, [0, 0, 0.0, 0.0, 0.0, 0])
                hr[0] += 1
                hr[1] += erred
                hr[2] += seconds[0]
                hr[3] += seconds[1]
                hr[4] += seconds[2] + seconds[3]
                hr[5] += ev.nbytes or 0
            if ev.worker is not None:
                w = r["workers"].setdefault(ev.worker, [0, 0, [0.0] * 5, None, None])
                w[0] += 1
                w[1] += erred
                w[2] = [x + y for x, y in zip(w[2], seconds, strict=True)]
                if first is not None:
                    w[3] = first if w[3] is None else min(w[3], first)
                    w[4] = last if w[4] is None else max(w[4], last)
    return {"runs": runs, "hours": hours, "days": days}


def close(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return a == b


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(tasks, tasks, tasks, others), max_size=60))
def test_aggregate_equals_a_plain_reading(events):
    batch = Batch(1, "c", "s", "a", 0, events)
    got, want = aggregate(batch), reference(batch)
    assert set(got.runs) == set(want["runs"])
    for key, w in want["runs"].items():
        g = got.runs[key]
        assert (g.tasks, g.errors, g.graph, g.nbytes, len(g.events)) == (
            w["tasks"],
            w["errors"],
            w["graph"],
            w["nbytes"],
            w["events"],
        )
        assert close(g.task_start, w["start"]) and close(g.task_stop, w["stop"])
        assert g.statuses == w["statuses"]
        assert {p: [v.count, v.errors, v.nbytes] for p, v in g.prefixes.items()} == w["prefixes"]
        assert set(g.actions) == set(w["actions"])
        for k, (n, total, lo, hi) in w["actions"].items():
            assert close(
                [g.actions[k].count, g.actions[k].total, g.actions[k].min, g.actions[k].max],
                [n, total, lo, hi],
            )
        assert g.hists == w["hists"]
        assert set(g.workers) == set(w["workers"])
        for name, (n, errors, seconds, first, last) in w["workers"].items():
            gw = g.workers[name]
            assert (gw.tasks, gw.errors) == (n, errors)
            assert close(gw.seconds, seconds)
            assert close(gw.first_start, first) and close(gw.last_stop, last)
    assert set(got.hours) == set(want["hours"])
    for h, v in want["hours"].items():
        gh = got.hours[h]
        assert close([gh.tasks, gh.errors, gh.compute, gh.transfer, gh.disk, gh.nbytes], v)
    assert set(got.days) == set(want["days"])
    for k, (n, total, hi, buckets) in want["days"].items():
        gd = got.days[k]
        assert close([gd.count, gd.total, gd.max], [n, total, hi]) and gd.buckets == buckets
