"""Every query endpoint on runs recorded from a real LocalCluster (worker processes)
through the Dask agent into a real embedded server (``hindsight serve``), and the Python
client round-tripping each into DataFrames."""

from __future__ import annotations

import io
import json
import math
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import pyarrow.parquet as pq
import pytest
from distributed import Client, LocalCluster, get_task_stream, span

from hindsight.client import Client as HindsightClient
from hindsight.client import HindsightError
from hindsight.schema import GraphEvent
from tests.dask.conftest import (
    EmbeddedServer,
    stored_events,
    wait_for_run,
    wait_until,
)


def inc(i: int) -> int:
    return i + 1


def boom(x: int) -> int:
    raise ValueError(f"boom on {x}")


def array_job() -> Any:
    x = da.random.random((400, 400), chunks=(50, 50))
    return (x + x.T).sum()  # the transpose moves chunks between workers


@pytest.fixture(scope="module")
def history(hindsight_server: EmbeddedServer) -> Iterator[dict[str, Any]]:
    """Three runs on one cluster: the same array job twice ("etl"), and a failing one."""
    cluster = f"q-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": hindsight_server.url,
        "hindsight.cluster": cluster,
        "hindsight.sample-interval": 0.1,
    }
    runs: dict[str, dict[str, Any]] = {}
    with dask.config.set(config):
        with LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
            worker_dashboard_address=":0", scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            workers = set(client.scheduler_info()["workers"])
            for label in ("etl-1", "etl-2"):
                with span("etl"), get_task_stream(client) as ts:
                    dask.compute(array_job(), optimize_graph=False)
                before = {r["id"] for r in runs.values()}

                def new(ts: Any = ts, before: set[str] = before) -> dict[str, Any] | None:
                    found = [r for r in hindsight_server.runs(cluster)
                             if r["name"] == "etl" and r["id"] not in before
                             and r["status"] == "finished" and r["task_count"] >= len(ts.data)]  # fmt: skip
                    return found[0] if found else None

                runs[label] = wait_until(new, 60, f"run {label}")
            parts = [dask.delayed(inc)(i) for i in range(20)]
            bad = [dask.delayed(boom)(parts[3])]
            total = dask.delayed(sum)([*parts, *bad])
            with span("failing"), get_task_stream(client) as ts:
                with pytest.raises(ValueError):
                    dask.compute(total, optimize_graph=False)
            runs["failing"] = wait_for_run(  # and the sum, erred because boom did
                hindsight_server, cluster, "failing", len(ts.data) + 1, "erred"
            )
    yield {"cluster": cluster, "runs": runs, "workers": workers, "server": hindsight_server}


def get(h: dict[str, Any], path: str, **params: Any) -> Any:
    return h["server"].get(path, **params)


def all_tasks(h: dict[str, Any], run_id: str) -> list[dict[str, Any]]:
    return h["server"].tasks(run_id)


def test_runs_filters_and_sort(history):
    h, cluster = history, history["cluster"]
    runs = history["runs"]
    names = lambda **p: [r["id"] for r in get(h, "/v1/runs", cluster=cluster, **p)["runs"]]  # noqa: E731
    assert set(names(name="etl")) == {runs["etl-1"]["id"], runs["etl-2"]["id"]}
    assert names(name="fail*") == [runs["failing"]["id"]]
    assert names(has_errors="true") == [runs["failing"]["id"]]
    assert set(names(has_errors="false")) == {runs["etl-1"]["id"], runs["etl-2"]["id"]}
    by_makespan = get(h, "/v1/runs", cluster=cluster, sort="-makespan")["runs"]
    spans = [r["makespan"] for r in by_makespan]
    assert spans == sorted(spans, reverse=True) and len(spans) == 3
    longest = spans[0]
    assert names(min_duration=longest) == [by_makespan[0]["id"]]
    # cursor pagination under a sort visits each run once, in order
    seen, cursor = [], None
    while True:
        page = get(h, "/v1/runs", cluster=cluster, sort="task_count", limit=1,
                   **({"cursor": cursor} if cursor else {}))  # fmt: skip
        seen += [r["task_count"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == sorted(r["task_count"] for r in by_makespan)


def test_run_detail_additions(history):
    h = history
    a, b, f = (
        get(h, f"/v1/runs/{history['runs'][k]['id']}") for k in ("etl-1", "etl-2", "failing")
    )
    assert a["fingerprint"] == b["fingerprint"] != f["fingerprint"]
    assert a["workers_used"] == 2 and {w["worker"] for w in a["workers"]} == history["workers"]
    assert sum(w["tasks"] for w in a["workers"]) == a["task_count"]
    tasks = all_tasks(h, a["id"])
    compute = sum(
        s["stop"] - s["start"] for t in tasks for s in t["startstops"] if s["action"] == "compute"
    )
    assert a["seconds_by_action"]["compute"] == pytest.approx(compute)
    transfer = sum(
        s["stop"] - s["start"] for t in tasks for s in t["startstops"] if s["action"] == "transfer"
    )
    assert transfer > 0 and a["seconds_by_action"]["transfer"] == pytest.approx(transfer)
    assert a["tasks_by_status"] == {"memory": a["task_count"]}
    assert a["completeness"]["batches_received"] >= 1
    assert f["tasks_by_status"]["erred"] == f["error_count"] == 2  # boom, and the sum after it


def test_tasks_filters_sort_pages_stream_and_parquet(history, tmp_path):
    import pandas as pd

    h = history
    run_id = history["runs"]["etl-1"]["id"]
    tasks = all_tasks(h, run_id)
    worker = sorted(history["workers"])[0]
    on_worker = get(h, f"/v1/runs/{run_id}/tasks", worker=worker, limit=10000)["tasks"]
    assert on_worker and {t["key"] for t in on_worker} == {
        t["key"] for t in tasks if t["worker"] == worker
    }
    prefix = tasks[0]["prefix"]
    by_prefix = get(h, f"/v1/runs/{run_id}/tasks", prefix=prefix, limit=10000)
    assert by_prefix["total"] == sum(t["prefix"] == prefix for t in tasks)
    longest = get(h, f"/v1/runs/{run_id}/tasks", sort="-duration", limit=5)["tasks"]
    durations = sorted((t["duration"] for t in tasks), reverse=True)
    assert [t["duration"] for t in longest] == durations[:5]
    # a time window: tasks that ran at some point in [t, t+dt)
    mid = sorted(t["startstops"][-1]["stop"] for t in tasks)[len(tasks) // 2]
    window = get(h, f"/v1/runs/{run_id}/tasks", since=mid, until=mid + 0.01, limit=10000)["tasks"]
    assert window and all(min(s["start"] for s in t["startstops"]) < mid + 0.01 for t in window)
    # sorted pages chain through the cursor
    keys, cursor = [], None
    while True:
        page = get(h, f"/v1/runs/{run_id}/tasks", sort="-duration", limit=37,
                   **({"cursor": cursor} if cursor else {}))  # fmt: skip
        keys += [t["key"] for t in page["tasks"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(keys) == sorted(t["key"] for t in tasks) and len(keys) == len(set(keys))
    # the streaming form equals the pages
    resp = h["server"].http.get(f"{h['server'].url}/v1/runs/{run_id}/tasks/stream", stream=True)
    assert resp.headers["Content-Type"].startswith("application/x-ndjson")
    streamed = [json.loads(line) for line in resp.iter_lines() if line]
    assert streamed == tasks
    # Parquet: one row per task, and the compacted copy is in the blob store
    resp = h["server"].http.get(f"{h['server'].url}/v1/runs/{run_id}/tasks.parquet")
    assert resp.status_code == 200
    (tmp_path / "t.parquet").write_bytes(resp.content)
    df = pd.read_parquet(tmp_path / "t.parquet")
    assert sorted(df["key"]) == sorted(t["key"] for t in tasks)
    compacted = list(
        (h["server"].data_dir / "blobs" / "compact").rglob(f"{run_id}/*/tasks.parquet")
    )
    assert len(compacted) == 1


def exact_quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(1, math.ceil(q * len(values))) - 1]


def test_summary_quantiles_match_the_records(history):
    h = history
    run_id = history["runs"]["etl-1"]["id"]
    tasks = all_tasks(h, run_id)
    summary = get(h, f"/v1/runs/{run_id}/summary")["prefixes"]
    checked = 0
    for p in summary:
        durations = [s["stop"] - s["start"] for t in tasks if t["prefix"] == p["prefix"]
                     for s in t["startstops"] if s["action"] == "compute"]  # fmt: skip
        c = p["actions"]["compute"]
        assert c["count"] == len(durations)
        assert c["min"] <= c["p50"] <= c["p90"] <= c["p99"] <= c["max"]
        for q, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            exact = exact_quantile(durations, q)
            if exact > 1e-4:  # below that, clock granularity
                assert c[key] == pytest.approx(exact, rel=0.05), (p["prefix"], key)
                checked += 1
    assert checked


def test_metrics_progress_graph_errors(history):
    h = history
    run_id = history["runs"]["etl-1"]["id"]
    series = get(h, f"/v1/runs/{run_id}/metrics", points=3)["series"]
    assert history["workers"] <= {s["worker"] for s in series}
    assert all(len(s["points"]) <= 3 for s in series)
    assert any(s["samples"] > 3 for s in series)  # downsampled, not truncated
    one = get(h, f"/v1/runs/{run_id}/metrics", points=3, name="cpu")["series"]
    assert one and {s["name"] for s in one} == {"cpu"}

    tasks = all_tasks(h, run_id)
    prog = get(h, f"/v1/runs/{run_id}/progress", buckets=7)
    assert len(prog["times"]) == 7
    for prefix, counts in prog["prefixes"].items():
        assert sum(counts) == sum(t["prefix"] == prefix for t in tasks)

    g = get(h, f"/v1/runs/{run_id}/graph")
    run_key = get(h, f"/v1/runs/{run_id}")["run_key"]
    stored = {e.key: set(e.dependencies) for e in stored_events(h["server"], history["cluster"])
              if type(e) is GraphEvent and e.run == run_key}  # fmt: skip
    got: dict[str, set[str]] = {n["key"]: set() for n in g["nodes"]}
    for e in g["edges"]:
        got[e["target"]].add(e["source"])
    assert {k: got[k] for k in stored} == stored
    by_key = {n["key"]: n for n in g["nodes"]}
    t = tasks[0]
    assert (
        by_key[t["key"]]["worker"] == t["worker"] and by_key[t["key"]]["duration"] == t["duration"]
    )

    failing = history["runs"]["failing"]["id"]
    (group,) = get(h, f"/v1/runs/{failing}/errors")["groups"]
    assert group["count"] == 2 and "boom on 4" in group["exception"]  # boom, and the sum
    assert group["prefixes"] == {"boom": 1, "sum": 1} and "raise ValueError" in group["traceback"]
    assert get(h, f"/v1/runs/{run_id}/errors")["groups"] == []


def test_critical_path_covers_the_makespan(history):
    h = history
    run_id = history["runs"]["etl-1"]["id"]
    cp = get(h, f"/v1/runs/{run_id}/critical-path")
    tasks = all_tasks(h, run_id)
    last = max(tasks, key=lambda t: max(s["stop"] for s in t["startstops"]))
    segs = cp["segments"]
    assert segs[-1]["key"] == last["key"] and segs[-1]["kind"] == "compute"
    for a, b in zip(segs, segs[1:], strict=False):
        assert b["start"] >= a["stop"] - 1e-9  # in order, not overlapping
    assert sum(s["seconds"] for s in segs) == pytest.approx(cp["makespan"], rel=1e-6)
    assert sum(cp["totals"].values()) == pytest.approx(cp["makespan"], rel=1e-6)
    # the chain walks the graph: each compute segment's task depends on the previous one's
    deps = {n["target"]: set() for n in get(h, f"/v1/runs/{run_id}/graph")["edges"]}
    for e in get(h, f"/v1/runs/{run_id}/graph")["edges"]:
        deps[e["target"]].add(e["source"])
    chain = [s["key"] for s in segs if s["kind"] == "compute"]
    for prev, nxt in zip(chain, chain[1:], strict=False):
        assert prev in deps[nxt]


def test_time_breakdown_compare_regressions(history):
    h = history
    a, b = history["runs"]["etl-1"]["id"], history["runs"]["etl-2"]["id"]
    detail = get(h, f"/v1/runs/{a}")
    tb = get(h, f"/v1/runs/{a}/time")
    assert tb["compute"] == pytest.approx(detail["seconds_by_action"]["compute"])
    assert tb["transfer"] == pytest.approx(detail["seconds_by_action"]["transfer"])
    assert tb["idle"] >= 0 and tb["capacity"] > tb["compute"]
    cl = get(h, f"/v1/clusters/{history['cluster']}/time")
    assert cl["runs"] == 3 and cl["compute"] > tb["compute"]

    cmp = get(h, "/v1/compare", a=a, b=b)
    assert cmp["new_prefixes"] == [] and cmp["missing_prefixes"] == []
    db_ = get(h, f"/v1/runs/{b}")
    assert cmp["makespan"]["delta"] == pytest.approx(db_["makespan"] - detail["makespan"])
    assert all(p["tasks"]["delta"] == 0 for p in cmp["prefixes"])
    # the same quantiles as the run's summary (both clamped to the exact min and max)
    summary = {
        p["prefix"]: p["actions"].get("compute")
        for p in get(h, f"/v1/runs/{a}/summary")["prefixes"]
    }
    for p in cmp["prefixes"]:
        if summary.get(p["prefix"]):
            assert p["p90"]["a"] == summary[p["prefix"]]["p90"], p["prefix"]
    f = history["runs"]["failing"]["id"]
    cmp2 = get(h, "/v1/compare", a=a, b=f)
    assert "boom" in cmp2["new_prefixes"]

    reg = get(h, f"/v1/runs/{b}/regressions", baseline=5, threshold=0)
    assert reg["baseline_runs"] == [a]
    assert {r["prefix"] for r in reg["checked"]} == {p["prefix"] for p in cmp["prefixes"]
                                                      if p["p90"]["a"]}  # fmt: skip
    assert {r["prefix"] for r in reg["regressions"]} == {
        r["prefix"] for r in reg["checked"] if r["change_pct"] != 0
    }
    high = get(h, f"/v1/runs/{b}/regressions", threshold=10_000)
    assert high["regressions"] == []
    assert get(h, f"/v1/runs/{a}/regressions")["baseline_runs"] == []


def test_histories_from_rollups(history):
    h = history
    cluster = history["cluster"]
    runs = [get(h, f"/v1/runs/{r['id']}") for r in history["runs"].values()]
    points = get(h, "/v1/history/clusters", cluster=cluster, bucket="day")["points"]
    assert sum(p["runs"] for p in points) == 3
    # tasks by when they ran; the sum that erred without running counts too (by its
    # batch's time): the history agrees with the runs list
    ran = [t for r in runs for t in h["server"].tasks(r["id"]) if t["startstops"]]
    assert sum(r["task_count"] for r in runs) == len(ran) + 1
    assert sum(p["tasks"] for p in points) == len(ran) + 1
    assert sum(p["errors"] for p in points) == sum(r["error_count"] for r in runs) == 2
    assert sum(p["compute_seconds"] for p in points) == pytest.approx(
        sum(r["seconds_by_action"]["compute"] for r in runs)
    )
    prefix = max(runs[0]["prefixes"], key=lambda p: p["count"])["prefix"]
    expected = sum(p["actions"]["compute"]["count"] for r in runs for p in r["prefixes"]
                   if p["prefix"] == prefix)  # fmt: skip
    slowest = max(p["actions"]["compute"]["max"] for r in runs for p in r["prefixes"]
                  if p["prefix"] == prefix)  # fmt: skip
    for bucket in ("day", "hour"):
        hist = get(h, "/v1/history/prefixes", prefix=prefix, bucket=bucket, cluster=cluster)[
            "points"
        ]
        assert sum(p["count"] for p in hist) == expected, bucket
        assert all(p["p50"] <= p["p90"] <= p["p99"] <= p["max"] for p in hist)
        assert max(p["max"] for p in hist) == pytest.approx(slowest)


def test_chrome_trace_has_a_track_per_worker_thread(history):
    h = history
    run_id = history["runs"]["etl-1"]["id"]
    resp = h["server"].http.get(f"{h['server'].url}/v1/runs/{run_id}/trace")
    trace = json.loads(resp.content)
    tasks = all_tasks(h, run_id)
    events = trace["traceEvents"]
    for e in events:
        assert e["ph"] in ("X", "M", "C") and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert {"name", "ts", "dur", "tid", "cat"} <= set(e) and e["dur"] >= 0
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"} == set(tracks)
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == history["workers"]
    worker_of = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    # a track per worker thread (and a lane more where slices would overlap) ...
    first_lanes = {
        (worker_of[p], n) for (p, _), n in tracks.items() if n.startswith("thread") and "(" not in n
    }
    assert first_lanes == {(t["worker"], f"thread {t['thread']}") for t in tasks}
    # ... transfers on their worker's transfer tracks, and on no track do two slices
    # overlap (a transfer drawn across the compute of the thread whose task it fed would
    # show in Perfetto as if nested)
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            assert (e["cat"] == "transfer") == tracks[(e["pid"], e["tid"])].startswith("transfers")
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-3 for a, b in zip(spans, spans[1:], strict=False))
    phases = sum(len(t["startstops"]) for t in tasks)
    assert sum(e["ph"] == "X" for e in events) == phases
    assert any(e.get("cat") == "transfer" and e["args"].get("source") for e in events)
    counters = [e for e in events if e["ph"] == "C"]
    names = {e["name"] for e in counters}
    assert {"memory.managed", "memory.spilled"} <= names
    pid_of = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert {e["pid"] for e in counters} == set(pid_of.values())


def test_python_client_round_trips_every_endpoint(history):
    h = history
    c = HindsightClient(h["server"].url)
    cluster = history["cluster"]
    a, b = history["runs"]["etl-1"]["id"], history["runs"]["etl-2"]["id"]
    f = history["runs"]["failing"]["id"]
    assert cluster in set(c.clusters()["name"])
    runs = c.runs(cluster=cluster)
    assert set(runs["id"]) == {a, b, f}
    assert list(c.runs(cluster=cluster, limit=2)["id"]) == list(runs["id"][:2])
    assert c.run(a)["id"] == a
    tasks = c.tasks(a)
    assert len(tasks) == c.run(a)["task_count"]
    some = c.tasks(a, prefix=tasks["prefix"].iloc[0])
    assert len(some) == (tasks["prefix"] == tasks["prefix"].iloc[0]).sum()
    # A filter gave other columns (the NDJSON records), one
    # that matched nothing no columns at all; limit was ignored; runs(limit=0) gave a run.
    assert list(some.columns) == list(tasks.columns) and "compute" in tasks.columns
    assert list(c.tasks(a, prefix="no-such-prefix").columns) == list(tasks.columns)
    assert list(c.tasks(a, limit=3)["key"]) == list(tasks["key"][:3])
    slowest = c.tasks(a, sort="-duration", limit=2)
    assert list(slowest["compute"]) == sorted(tasks["compute"], reverse=True)[:2]
    assert c.runs(cluster=cluster, limit=0).empty
    # Moments are UTC datetimes in every frame (epoch floats read as numbers), durations
    # stay seconds; the run's own detail is the route's JSON.
    detail = c.run(a)
    got = runs.set_index("id").loc[a]
    assert got["started_at"].timestamp() == pytest.approx(detail["started_at"])
    for frame, column in (
        (runs, "started_at"),
        (tasks, "start"),
        (tasks, "stop"),
        (c.metrics(a, points=4), "time"),
        (c.critical_path(a), "start"),
        (c.clusters(), "last_seen"),
    ):
        assert str(frame[column].dt.tz) == "UTC", column
    assert str(c.progress(a, buckets=5).index.tz) == "UTC"
    assert tasks["compute"].dtype.kind == "f"  # seconds
    assert str(c.state(a)["time"].tz) == "UTC"
    # A day alone as until includes that day, as a date or as text, here and in the lake
    # (a date object sent midnight at its start: the day's runs were left out).
    from datetime import UTC, datetime

    from hindsight.lake import Filters

    started = c.run(a)["started_at"]
    day = datetime.fromtimestamp(started, UTC).date()
    assert a in set(c.runs(cluster=cluster, until=day)["id"])
    assert a in set(c.runs(cluster=cluster, until=day.isoformat())["id"])
    assert (
        Filters.from_kwargs(until=day).until == Filters.from_kwargs(until=str(day)).until > started
    )
    assert Filters.from_kwargs(until=f"{day:%Y%m%d}").until == Filters.from_kwargs(until=day).until
    with c._open(f"/v1/runs/{a}/tasks.parquet", {"limit": 2, "sort": "-duration"}) as resp:
        assert pq.read_table(io.BytesIO(resp.read())).num_rows == 2  # cut by the server
    summary = c.summary(a)
    assert {"prefix", "action", "p50", "p90", "p99", "max"} <= set(summary.columns)
    assert len(c.metrics(a, points=4)) > 0
    prog = c.progress(a, buckets=5)
    assert prog.to_numpy().sum() == len(tasks)
    nodes, edges = c.graph(a)
    assert len(nodes) >= len(tasks) and len(edges) > 0
    assert c.errors(f)["count"].sum() == 2  # boom, and the sum that erred because it did
    assert c.critical_path(a)["seconds"].sum() > 0
    assert set(c.time(a)["worker"]) == history["workers"]
    assert set(c.cluster_time(cluster)["worker"]) == history["workers"]
    reg = c.regressions(b, threshold=10_000)
    assert list(reg.columns)[:1] == ["prefix"] and reg.attrs["baseline_runs"] == [a]
    # Misspelled, the threshold was the default's; and an empty frame
    # did not tell "no baseline" from "no regression" (the route's baseline_runs)
    with pytest.raises(HindsightError) as err:
        c.regressions(b, treshold=500)
    assert (err.value.status, err.value.code) == (400, "invalid_parameter")
    assert c.regressions(a).attrs["baseline_runs"] == []
    assert set(c.state(a)["prefixes"]["prefix"]) <= set(tasks["prefix"])  # at: now
    cmp = c.compare(a, f)
    assert "new" in set(cmp["status"]) and cmp.attrs["makespan"]["a"] > 0
    prefix = summary["prefix"].iloc[0]
    assert c.prefix_history(prefix, bucket="day", cluster=cluster)["count"].sum() > 0
    assert c.cluster_history(cluster=cluster, bucket="day")["runs"].sum() == 3
    # An empty answer was a frame without columns (the README's
    # ``runs.id[0]`` raised AttributeError), and a misspelled filter was ignored (every
    # run came back). Empty frames have the columns full ones have; a typo is a 400.
    for empty, full in (
        (c.runs(cluster="no-such-cluster"), runs),
        (c.errors(a), c.errors(f)),
        (c.summary(a).iloc[0:0], summary),
        (c.prefix_history("no-such-prefix"), c.prefix_history(prefix, bucket="day")),
        (c.cluster_history(cluster="no-such-cluster"), c.cluster_history(cluster=cluster)),
    ):
        assert empty.empty and list(empty.columns) == list(full.columns)
    for typo in ({"clusters": cluster}, {"custer": cluster}):
        with pytest.raises(HindsightError) as err:
            c.runs(**typo)
        assert (err.value.status, err.value.code) == (400, "invalid_parameter")
        assert next(iter(typo)) in err.value.message
    with pytest.raises(HindsightError) as err:
        c.tasks(a, prefixes="x")
    assert err.value.status == 400
    assert c.trace(a)["traceEvents"]
    with pytest.raises(HindsightError) as err:
        c.run("no-such-run")
    assert err.value.status == 404 and err.value.code == "not_found"
    # These raised bare ValueError / URLError, not the
    # documented HindsightError; lifecycle's columns came only with a departed worker.
    for bad in ({"since": "bogus"}, {"min_duration": "abc"}):
        with pytest.raises(HindsightError) as err:
            c.lake_rows("tasks", **bad)
        assert (err.value.status, err.value.code) == (400, "invalid_parameter")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(HindsightError) as err:
        HindsightClient(nobody).runs()
    assert (err.value.status, err.value.code) == (0, "unreachable")
    with pytest.raises(ValueError, match="http://"):
        HindsightClient("127.0.0.1:8700")
    workers = c.lifecycle(a)["workers"]
    assert {"joined_at", "left_at", "cause", "reason", "took_down"} <= set(workers.columns)
