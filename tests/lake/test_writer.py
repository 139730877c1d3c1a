"""The lake's writer on both stacks: finished runs land in the Iceberg partition of their
day with the records the run's tasks route returns; commits are idempotent, merge small
runs, replace a run that changed without counting it twice, expire old snapshots so storage
follows the data, and two writers committing to one partition at once both land."""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import pytest
from sqlalchemy import select

from hindsight import lake as layout
from storage.core import models as m
from storage.lake import write as lakewrite
from storage.lake.spill import SortedRows
from tests.helpers import auth
from tests.lake.conftest import DAY, finish_all, lake_location, lake_records
from tests.query.test_runs import T0

RECORD_FIELDS = (
    "key",
    "prefix",
    "group",
    "worker",
    "thread",
    "status",
    "nbytes",
    "typename",
    "startstops",
    "exception",
    "traceback",
)


def as_task_record(row: dict[str, Any]) -> dict[str, Any]:
    rec = {f: row[f] for f in RECORD_FIELDS}
    rec["startstops"] = json.loads(rec["startstops"])
    rec["duration"] = row["duration"]
    return rec


def route_records(query: Any, token: str, run_id: str) -> list[dict[str, Any]]:
    body = query.get(f"/v1/runs/{run_id}/tasks?limit=10000", headers=auth(token)).json
    return [{k: t[k] for k in (*RECORD_FIELDS, "duration")} for t in body["tasks"]]


def by_key(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {r["key"]: r for r in records}
    assert len(out) == len(records), "a task is in the lake twice"
    return out


def snapshots(storage: Any) -> dict[str, int | None]:
    """The current snapshot of each lake table (a commit makes a new one)."""
    from storage.lake import write

    loc = lake_location(storage)
    return {t: write.table(loc, t).metadata.current_snapshot_id for t in layout.TABLES}


def planned(storage: Any, table: str, tenant: str, **filters: Any) -> list[Any]:
    """The data files a scan of the tenant's ``table`` plans (pyiceberg)."""
    from storage.lake import read as lakeread

    f = layout.Filters.from_kwargs(**filters)
    return lakeread.plan(lake_location(storage), tenant, table, f)


def test_finished_runs_land_in_their_day_with_the_route_records(stack, storage, tenant_runs):
    tenant, query, token = tenant_runs["tenant"], tenant_runs["query"], tenant_runs["token"]
    assert finish_all(storage.sessions, storage.blobs, tenant) == 4  # r4 is still running
    # finishing again changes nothing: no file written, no commit
    before = snapshots(storage)
    files = sorted(f.key for f in planned(storage, "tasks", tenant))
    finish_all(storage.sessions, storage.blobs, tenant)
    assert snapshots(storage) == before
    assert sorted(f.key for f in planned(storage, "tasks", tenant)) == files
    runs = tenant_runs["runs"]
    for name in ("r0", "r1", "r2", "r3"):
        run = runs[name]
        rows = lake_records(storage, stack, tenant, run=run["id"])
        assert by_key([as_task_record(r) for r in rows]) == by_key(
            route_records(query, token, run["id"])
        )
        assert {r["session"] for r in rows} == {run["session"]}
    assert lake_records(storage, stack, tenant, run=runs["r4"]["id"]) == []
    # one partition per cluster and day the runs started
    for table in layout.TABLES:
        parts = {(f.cluster, f.day) for f in planned(storage, table, tenant)}
        assert parts <= {
            ("prod", layout.day_of(T0)),
            ("prod", layout.day_of(T0 + DAY)),
            ("dev", layout.day_of(T0 + DAY)),
        }
    assert len({(f.cluster, f.day) for f in planned(storage, "tasks", tenant)}) == 3
    # r0 and r1 share a day that is over: one file per table
    for table in layout.TABLES:
        day0 = planned(storage, table, tenant, cluster="prod", until=layout.day_of(T0))
        day0 = [f for f in day0 if f.day == layout.day_of(T0)]
        assert len(day0) <= 1, table
    t0_tasks = [f for f in planned(storage, "tasks", tenant) if f.day == layout.day_of(T0)]
    assert len(t0_tasks) == 1 and t0_tasks[0].rows == 8
    # run summaries, metric samples and emitted values came along
    summaries = {r["run"]: r for r in lake_records(storage, stack, tenant, "runs")}
    assert set(summaries) == {runs[n]["id"] for n in ("r0", "r1", "r2", "r3")}
    r1 = summaries[runs["r1"]["id"]]
    assert (r1["status"], r1["error_count"], r1["task_count"]) == ("erred", 1, 4)
    assert r1["name"] == "job-r1" and r1["prefixes"] == ["inc"]
    assert r1["compute_seconds"] == pytest.approx(4 * 0.5)
    emitted = lake_records(storage, stack, tenant, "streams", stream="rows-in")
    assert sorted((e["run"], e["number"]) for e in emitted) == sorted(
        (runs[n]["id"], 1000.0 * (1 + d)) for n, d in (("r0", 0), ("r1", 0.1), ("r2", 1), ("r3", 1))
    )
    metrics = lake_records(storage, stack, tenant, "metrics", name="cpu")
    assert {r["run"] for r in metrics} == {runs[n]["id"] for n in ("r0", "r1", "r2", "r3")}
    # the index knows which version of each run the lake holds
    with storage.sessions() as db:
        tags = dict(
            db.execute(
                select(m.Run.public_id, m.LakeRun.tag)
                .join(m.LakeRun, m.LakeRun.run_id == m.Run.id)
                .where(m.Run.tenant_id == run_tenant_id(db, tenant))
            ).all()
        )
    assert tags == {r: s["tag"] for r, s in summaries.items()}


def run_tenant_id(db: Any, tenant: str) -> int:
    return db.scalar(select(m.Tenant.id).where(m.Tenant.name == tenant))


# ---------------------------------------------------------------- commits on synthetic runs


def synthetic(
    run: str, n: int, t0: float, tag: str = "v1", prefix: str = "load"
) -> lakewrite.RunRows:
    """A run's lake rows made up directly (no batches): ``n`` tasks of one prefix."""

    def load() -> dict[str, Any]:
        tables = {}
        for table in layout.TABLES:
            schema = layout.schema(table)
            rows = n if table == "tasks" else (1 if table == "runs" else 0)
            cols: dict[str, list[Any]] = {f.name: [None] * rows for f in schema}
            cols["run"], cols["session"] = [run] * rows, ["s"] * rows
            if table == "tasks":
                cols["key"] = [f"{run}-{i}" for i in range(n)]
                cols["prefix"] = [prefix] * n
                cols["status"] = ["memory"] * n
                cols["start"] = [t0 + i for i in range(n)]
                cols["stop"] = [t0 + i + 0.5 for i in range(n)]
                cols["duration"] = [0.5 + i / 1000 for i in range(n)]
                cols["nbytes"] = [i for i in range(n)]
            if table == "runs":
                cols["started_at"], cols["status"], cols["tag"] = [t0], ["finished"], [tag]
            tables[table] = pa_table(cols, schema)
        return tables

    return lakewrite.RunRows(run, "s", tag, load)


def pa_table(cols: dict[str, list[Any]], schema: Any) -> Any:
    import pyarrow as pa

    return pa.table(cols, schema=schema)


@pytest.fixture
def partition(storage):
    """A partition of a fresh tenant's cluster for a day, ``T0``'s."""
    from tests.conftest import new_tenant

    return lakewrite.Partition(new_tenant(), "c", layout.day_of(T0))


def commit(storage: Any, part: lakewrite.Partition, *runs: Any, replace: bool = True) -> None:
    lakewrite.commit_runs(
        lake_location(storage), part, runs, replace=[r.run for r in runs] if replace else ()
    )


def task_keys(storage: Any, part: lakewrite.Partition) -> list[str]:
    """The task keys of a partition, as pyiceberg scans them."""
    t = lakewrite.table(lake_location(storage), "tasks")
    return (
        t.scan(row_filter=part.expression(), selected_fields=("key",)).to_arrow()["key"].to_pylist()
    )


def data_files(storage: Any, part: lakewrite.Partition, table: str = "tasks") -> list[Any]:
    t = lakewrite.table(lake_location(storage), table)
    return [task.file for task in t.scan(row_filter=part.expression()).plan_files()]


def stored(storage: Any, table: str = "tasks") -> list[str]:
    """Every object under a lake table's location in the blob store."""
    loc = lake_location(storage)
    base = loc.key(lakewrite.table(loc, table).location())
    # (pyarrow's S3 writer leaves empty "directory" objects, key ending in /: not files)
    return [k for k in storage.blobs.list(base + "/") if not k.endswith("/")]


def test_small_runs_of_a_day_merge_and_the_day_seals_into_one_file(storage, partition):
    loc = lake_location(storage)
    expected: list[str] = []
    most_files = 0
    for i in range(12):
        commit(storage, partition, synthetic(f"run-{i:02d}", 500, T0 + i))
        expected += [f"run-{i:02d}-{j}" for j in range(500)]
        lakewrite.compact(loc, partition, now=T0 + 3600)  # the day still runs
        assert sorted(task_keys(storage, partition)) == sorted(expected)  # each run once
        most_files = max(most_files, len(data_files(storage, partition)))
    assert 1 < most_files < lakewrite.FANOUT
    # the day is over: one file per table
    lakewrite.compact(loc, partition, now=T0 + 2 * DAY)
    assert len(data_files(storage, partition)) == 1
    assert sorted(task_keys(storage, partition)) == sorted(expected)
    runs = lakewrite.table(loc, "runs").scan(row_filter=partition.expression()).to_arrow()
    assert len(runs) == 12 and len(data_files(storage, partition, "runs")) == 1


def test_old_snapshots_expire_and_storage_follows_the_data(storage, partition):
    """Every commit and merge leaves files behind for readers of older snapshots; once
    those expire, what is stored is what the current snapshot holds, however many runs
    were committed."""
    loc = lake_location(storage)
    for i in range(8):
        commit(storage, partition, synthetic(f"run-{i}", 300, T0 + i))
        lakewrite.compact(loc, partition, now=T0 + 2 * DAY)  # sealed at every commit
    tbl = lakewrite.table(loc, "tasks")
    live = {loc.key(f.file_path) for f in data_files(storage, partition)}
    data = [k for k in stored(storage) if "/data/" in k]
    assert len(live) == 1 and len(data) > 1  # older snapshots still hold the rest
    # within the retention period, nothing goes
    assert lakewrite.expire(loc, now=time.time() + lakewrite.RETAIN_S - 60) == 0
    assert lakewrite.expire(loc, now=time.time() + lakewrite.RETAIN_S + 1) > 0
    tbl = tbl.refresh()
    assert len(tbl.metadata.snapshots) == 1
    assert {k for k in stored(storage) if "/data/" in k} == live
    meta = [k for k in stored(storage) if "/metadata/" in k]
    assert len(meta) <= 20  # metadata files kept: previous-versions-max, one manifest list...
    assert sorted(task_keys(storage, partition)) == sorted(
        f"run-{i}-{j}" for i in range(8) for j in range(300)
    )


def test_a_changed_run_replaces_its_rows_and_keeps_its_neighbours(storage, partition):
    from pyiceberg.expressions import EqualTo

    loc = lake_location(storage)
    commit(storage, partition, synthetic("a", 100, T0), synthetic("b", 100, T0))
    commit(storage, partition, synthetic("a", 150, T0, tag="v2"))  # a late batch
    keys = task_keys(storage, partition)
    assert sorted(keys) == sorted([f"a-{i}" for i in range(150)] + [f"b-{i}" for i in range(100)])
    tags = lakewrite.table(loc, "runs").scan(row_filter=partition.expression()).to_arrow()
    assert dict(zip(tags["run"].to_pylist(), tags["tag"].to_pylist(), strict=True)) == {
        "a": "v2",
        "b": "v1",
    }
    # a run that moved to another day (a late batch moved its start) leaves its old day
    later = lakewrite.Partition(partition.tenant, partition.cluster, layout.day_of(T0 + DAY))
    lakewrite.commit_runs(
        loc, later, [synthetic("a", 10, T0 + DAY, tag="v3")], replace=["a"], days=[partition.day]
    )
    assert sorted(task_keys(storage, partition)) == sorted(f"b-{i}" for i in range(100))
    assert sorted(task_keys(storage, later)) == sorted(f"a-{i}" for i in range(10))
    lakewrite.delete_rows(loc, EqualTo("tenant", partition.tenant))
    assert task_keys(storage, partition) == [] and task_keys(storage, later) == []


def test_a_stale_writer_retries_and_loses_nothing(storage, partition):
    """A collector that loaded the table before another committed gets CommitFailedException
    from the catalog; pyiceberg refreshes, checks that nothing it deletes changed, and
    commits again: both runs are in the lake, each once."""
    loc = lake_location(storage)
    stale = lakewrite.table(loc, "tasks")
    commit(storage, partition, synthetic("x", 20, T0))
    rows = lakewrite.with_partition(synthetic("y", 20, T0).tables["tasks"], "tasks", partition)
    with stale.transaction() as txn, warnings.catch_warnings():  # on the snapshot before x's
        warnings.simplefilter("ignore", UserWarning)  # "did not match any records": y is new
        txn.delete(lakewrite._run_filter(partition, ["y"], []))
        txn.append(rows)
    assert sorted(task_keys(storage, partition)) == sorted(
        f"{r}-{i}" for r in "xy" for i in range(20)
    )


def test_concurrent_commits_to_one_partition_keep_every_run(storage, partition):
    """Two collectors commit runs to one partition at once (threads, each with its own
    catalog connection): every run lands, each once."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    barrier = Barrier(2)

    def collector(name: str) -> None:
        barrier.wait()
        for i in range(6):
            commit(storage, partition, synthetic(f"{name}{i}", 10, T0 + i))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(collector, ["p", "q"]))
    assert sorted(task_keys(storage, partition)) == sorted(
        f"{n}{i}-{j}" for n in "pq" for i in range(6) for j in range(10)
    )
    runs = lakewrite.table(lake_location(storage), "runs").scan(row_filter=partition.expression())
    assert sorted(runs.to_arrow()["run"].to_pylist()) == sorted(
        f"{n}{i}" for n in "pq" for i in range(6)
    )


def test_lake_tasks_and_metrics_are_the_compacted_copys_columns():
    """One schema for a run's tasks: the lake's (a public contract) is the compacted copy's
    with the run's identity in front. If runfile changes, the lake's version must follow."""
    from storage.runs.runfile import _schemas

    tasks, _graph, metrics = _schemas()
    tasks = tasks.set(
        tasks.get_field_index("compute"), tasks.field("compute").with_name("duration")
    )
    for table, copy in (("tasks", tasks), ("metrics", metrics)):
        s = layout.schema(table)
        assert s.names[:2] == ["run", "session"]
        assert s.remove(0).remove(0).equals(copy), table


def test_a_big_runs_rows_sorted_through_files_equal_the_rows_sorted_in_memory(storage, monkeypatch):
    # A run past SPILL_ROWS tasks is sorted a bucket at a time through temporary files;
    # its files must hold what sorting it whole in memory gives: the same rows, in the
    # same order (prefix, then start; nulls last; ties in arrival order), the same footers.
    import random

    from tests.conftest import new_tenant

    monkeypatch.setattr(lakewrite, "ROW_GROUP", 16)
    monkeypatch.setitem(lakewrite.TARGET_ROWS, "tasks", 70)
    rng = random.Random(5)
    n = 230
    tables = synthetic("big", n, T0).tables
    tasks = tables["tasks"]
    prefixes = ["load", "inc", None, "sum", "a-longer-prefix"]
    tasks = tasks.set_column(
        tasks.schema.get_field_index("prefix"),
        "prefix",
        pa_table({"p": [rng.choice(prefixes) for _ in range(n)]}, None)["p"],
    )
    starts = [None if rng.random() < 0.05 else T0 + rng.randrange(40) for _ in range(n)]
    tasks = tasks.set_column(
        tasks.schema.get_field_index("start"), "start", pa_table({"s": starts}, None)["s"]
    )
    tasks = tasks.set_column(
        tasks.schema.get_field_index("status"),
        "status",
        pa_table({"s": [rng.choice(["memory", "erred"]) for _ in range(n)]}, None)["s"],
    )

    def parts(cols: list[str] | None) -> Any:
        t = tasks if cols is None else tasks.select(cols)
        for lo in range(0, n, 37):
            yield t.slice(lo, 37)

    spilled = SortedRows(lakewrite.SORT_KEYS["tasks"], parts, 16).spill()
    assert len(spilled) == n
    tenant = new_tenant()
    in_memory = lakewrite.Partition(tenant, "mem", layout.day_of(T0))
    through_files = lakewrite.Partition(tenant, "files", layout.day_of(T0))
    commit(
        storage, in_memory, lakewrite.RunRows("big", "s", "v1", lambda: {**tables, "tasks": tasks})
    )
    commit(
        storage,
        through_files,
        lakewrite.RunRows("big", "s", "v1", lambda: {**tables, "tasks": spilled}),
    )
    assert task_keys(storage, through_files) == task_keys(storage, in_memory)
    assert sorted(task_keys(storage, in_memory)) == sorted(tasks["key"].to_pylist())
    from storage.lake import read as lakeread

    loc = lake_location(storage)
    io = lakewrite.table(loc, "tasks").io

    def footers(part: Any) -> list[Any]:
        files = sorted(data_files(storage, part), key=lambda f: f.file_path.rsplit("/", 1)[1][:5])
        return [(f.record_count, lakeread.footer_stats(io, f.file_path)) for f in files]

    assert [c for c, _ in footers(through_files)] == [70, 70, 70, 20]
    assert footers(through_files) == footers(in_memory)


def test_a_run_past_the_spill_size_lands_with_the_route_records(
    stack, storage, tenant_runs, monkeypatch
):
    # the finisher's path for big runs: the compacted copy read a row group at a time,
    # the rows sorted through files, the run's summary from its columns part by part
    from storage.lake import build as lakebuild
    from storage.runs import runfile

    monkeypatch.setattr(lakebuild, "SPILL_ROWS", 1)
    monkeypatch.setattr(runfile, "BUILD_CHUNK", 1)
    monkeypatch.setattr(lakewrite, "ROW_GROUP", 2)
    tenant, query, token = tenant_runs["tenant"], tenant_runs["query"], tenant_runs["token"]
    assert finish_all(storage.sessions, storage.blobs, tenant) == 4
    runs = tenant_runs["runs"]
    summaries = {r["run"]: r for r in lake_records(storage, stack, tenant, "runs")}
    for name in ("r0", "r1", "r2", "r3"):
        rows = lake_records(storage, stack, tenant, run=runs[name]["id"])
        assert by_key([as_task_record(r) for r in rows]) == by_key(
            route_records(query, token, runs[name]["id"])
        )
        assert [r["start"] for r in rows] == sorted(r["start"] for r in rows)
        summary = summaries[runs[name]["id"]]
        assert summary["prefixes"] == ["inc"] and summary["workers"] == 1
        assert summary["compute_seconds"] == pytest.approx(4 * 0.5)
