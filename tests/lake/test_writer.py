"""The lake's writer on both stacks: finished runs land in the partition of their day with
the records the run's tasks route returns; commits are idempotent, merge small runs,
replace a run that changed without counting it twice, and are fenced against a writer
that lost its lock."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from sqlalchemy import func, select

from hindsight import lake as layout
from storage.core import models as m
from storage.lake import build as lake
from storage.lake import write as lakewrite
from tests.helpers import auth
from tests.lake.conftest import DAY, finish_all, lake_records, make_cluster
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


def test_finished_runs_land_in_their_day_with_the_route_records(stack, storage, tenant_runs):
    tenant, query, token = tenant_runs["tenant"], tenant_runs["query"], tenant_runs["token"]
    assert finish_all(storage.sessions, storage.blobs, tenant) == 4  # r4 is still running
    # finishing again changes nothing: no file written, no commit
    files = sorted(storage.blobs.list(f"lake/v1/tasks/tenant={tenant}/"))
    seqs = manifest_seqs(storage, tenant)
    finish_all(storage.sessions, storage.blobs, tenant)
    assert sorted(storage.blobs.list(f"lake/v1/tasks/tenant={tenant}/")) == files
    assert manifest_seqs(storage, tenant) == seqs
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
    keys = list(storage.blobs.list(f"{layout.MANIFESTS}/tenant={tenant}/"))
    parts = {layout.parse_manifest_key(k)[1:3] for k in keys}
    assert parts == {
        ("prod", layout.day_of(T0)),
        ("prod", layout.day_of(T0 + DAY)),
        ("dev", layout.day_of(T0 + DAY)),
    }
    # r0 and r1 share a sealed day: one file per table
    first = lakewrite.read_manifest(storage.blobs, tenant, "prod", layout.day_of(T0))
    assert sorted(first.runs) == sorted([runs["r0"]["id"], runs["r1"]["id"]])
    assert sorted(f.table for f in first.files) == sorted(layout.TABLES)
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
    # the index's catalog says the same
    with storage.sessions() as db:
        assert db.scalar(select(func.count()).select_from(m.LakeRun)) >= 4
        files = db.scalars(
            select(m.LakeFile.key)
            .join(m.LakePartition, m.LakePartition.id == m.LakeFile.partition_id)
            .where(m.LakePartition.tenant_id == run_tenant_id(db, tenant))
        )
        assert sorted(files) == sorted(
            f.key
            for part in layout.latest_manifests(keys)
            for f in lakewrite.read_manifest(storage.blobs, *part).files
        )


def run_tenant_id(db: Any, tenant: str) -> int:
    return db.scalar(select(m.Tenant.id).where(m.Tenant.name == tenant))


def manifest_seqs(storage: Any, tenant: str) -> dict[tuple[str, str], int]:
    keys = storage.blobs.list(f"{layout.MANIFESTS}/tenant={tenant}/")
    return {p[1:3]: int(k[-15:-5]) for p, k in layout.latest_manifests(keys).items()}


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
                cols["started_at"], cols["status"] = [t0], ["finished"]
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

    tenant = new_tenant()
    tenant_id, cluster_id = make_cluster(storage, tenant, "c")
    return lakewrite.Partition(tenant, "c", layout.day_of(T0), tenant_id, cluster_id)


def commit(storage: Any, part: lakewrite.Partition, **kwargs: Any) -> Any:
    with storage.sessions.begin() as db:
        return lakewrite.commit(db, storage.blobs, part, now=kwargs.pop("now", T0 + 3600), **kwargs)


def task_keys(storage: Any, manifest: Any) -> list[str]:
    import io

    import pyarrow.parquet as pq

    keys: list[str] = []
    for f in manifest.files:
        if f.table == "tasks":
            keys += pq.read_table(io.BytesIO(storage.blobs.get(f.key)), columns=["key"])[
                "key"
            ].to_pylist()
    return keys


def test_small_runs_of_a_day_merge_and_the_day_seals_into_one_file(storage, partition):
    expected: list[str] = []
    most_files = 0
    for i in range(12):
        manifest = commit(storage, partition, add=[synthetic(f"run-{i:02d}", 500, T0 + i)])
        expected += [f"run-{i:02d}-{j}" for j in range(500)]
        tasks = [f for f in manifest.files if f.table == "tasks"]
        most_files = max(most_files, len(tasks))
        assert sorted(task_keys(storage, manifest)) == sorted(expected)  # each run once
    # while the day runs: tiered merging keeps few files (not one per run) ...
    assert 1 < most_files <= 2 * (lakewrite.FANOUT - 1)
    assert manifest.seq == 12
    # ... and once it is over, one file per table
    sealed = commit(storage, partition, seal=True)
    assert [f.table for f in sealed.files].count("tasks") == 1
    assert sorted(task_keys(storage, sealed)) == sorted(expected)
    assert len(sealed.runs) == 12
    # superseded files wait out the grace period, then go
    waiting = [r.key for r in sealed.removed]
    assert waiting and all(storage.blobs.exists(k) for k in waiting)
    with storage.sessions.begin() as db:
        assert lake.vacuum(db, storage.blobs, now=T0 + 3600 + lakewrite.GRACE_S - 1) == 0
        assert lake.vacuum(db, storage.blobs, now=T0 + 7200 + lakewrite.GRACE_S) == 1
    assert not any(storage.blobs.exists(k) for k in waiting)
    after = lakewrite.read_manifest(storage.blobs, *partition.names)
    assert after.removed == [] and sorted(task_keys(storage, after)) == sorted(expected)


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_a_day_committed_at_once_is_the_day_finished_run_by_run(storage, partition):
    """bench/lake.py's bulk path: a day's runs in one commit end in the files the finisher
    leaves once the day is sealed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    runs = [(f"r{i}", 300 + 50 * i) for i in range(6)]
    for name, n in runs:  # as the finisher does, while the day runs
        commit(storage, partition, add=[synthetic(name, n, T0)], now=T0 + 60, seal=False)
    one_by_one = commit(storage, partition, now=T0 + 2 * DAY)  # the day is over: sealed
    _tid, other = make_cluster(storage, partition.tenant, "bulk")
    bulk_part = lakewrite.Partition(partition.tenant, "bulk", partition.day, _tid, other)
    bulk = commit(
        storage, bulk_part, add=[synthetic(name, n, T0) for name, n in runs], now=T0 + 2 * DAY
    )

    def content(manifest: Any) -> dict[str, Any]:
        out = {}
        for f in manifest.files:
            t = pq.read_table(io.BytesIO(storage.blobs.get(f.key)))
            out[f.table] = t.sort_by(
                [(c, "ascending") for c in ("run", "key") if c in t.column_names]
            )
        return out

    a, b = content(one_by_one), content(bulk)
    assert sorted(f.table for f in one_by_one.files) == sorted(f.table for f in bulk.files)
    assert [f.table for f in bulk.files].count("tasks") == 1
    for table in a:
        assert a[table].equals(b[table]), table
    assert isinstance(a["tasks"], pa.Table) and len(a["tasks"]) == sum(n for _, n in runs)


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_a_changed_run_replaces_its_rows_and_keeps_its_neighbours(storage, partition):
    commit(
        storage, partition, add=[synthetic("a", 100, T0), synthetic("b", 100, T0 + 1)], seal=True
    )
    changed = commit(storage, partition, add=[synthetic("a", 150, T0, tag="v2")], seal=True)
    keys = task_keys(storage, changed)
    assert sorted(keys) == sorted([f"a-{i}" for i in range(150)] + [f"b-{i}" for i in range(100)])
    assert changed.runs["a"].tag == "v2" and changed.runs["b"].tag == "v1"
    same = commit(storage, partition, add=[synthetic("a", 150, T0, tag="v2")])
    assert same.seq == changed.seq  # already there: nothing written
    gone = commit(storage, partition, remove=["a"], grace=0.0)
    assert sorted(task_keys(storage, gone)) == sorted(f"b-{i}" for i in range(100))
    assert set(gone.runs) == {"b"}
    # grace 0: the files that held "a" are gone at once
    for key in {f.key for f in changed.files} - {f.key for f in gone.files}:
        assert not storage.blobs.exists(key)
    empty = commit(storage, partition, remove=["b"], grace=0.0)
    assert empty.files == [] and empty.runs == {}
    assert list(storage.blobs.list(layout.manifest_dir(*partition.names) + "/")) == []
    assert list(storage.blobs.list(f"lake/v1/tasks/tenant={partition.tenant}/")) == []
    with storage.sessions() as db:  # the index forgets the partition too
        P = m.LakePartition
        assert db.scalar(select(func.count()).where(P.cluster_id == partition.cluster_id)) == 0


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_a_writer_that_lost_its_lock_cannot_overwrite_a_commit(storage, partition):
    commit(storage, partition, add=[synthetic("a", 10, T0)])
    base = lakewrite.read_manifest(storage.blobs, *partition.names)
    # writer X prepares commit seq+1 from the base it read ...
    stale, _ = lakewrite._next_manifest(
        storage.blobs,
        partition,
        base,
        [synthetic("x", 10, T0)],
        set(),
        None,
        T0 + 3600,
        lakewrite.GRACE_S,
        False,
    )
    # ... while writer Y commits first
    won = commit(storage, partition, add=[synthetic("y", 10, T0)])
    assert won.seq == stale.seq
    key = layout.manifest_key(*partition.names, stale.seq)
    assert storage.blobs.put(key, layout.encode_manifest(stale), if_absent=True) is False
    # X, committing properly, re-reads and keeps Y's run
    final = commit(storage, partition, add=[synthetic("x", 10, T0)])
    assert set(final.runs) == {"a", "x", "y"}
    assert sorted(task_keys(storage, final)) == sorted(f"{r}-{i}" for r in "axy" for i in range(10))


def test_concurrent_commits_to_one_partition_keep_every_run(storage, partition):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        commit(storage, partition, add=[synthetic(f"r{i}", 50, T0 + i)])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(12)))
    final = lakewrite.read_manifest(storage.blobs, *partition.names)
    assert final.seq == 12 and len(final.runs) == 12
    assert sorted(task_keys(storage, final)) == sorted(
        f"r{i}-{j}" for i in range(12) for j in range(50)
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


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_a_day_left_unsealed_is_sealed_by_the_clusters_next_day(storage, partition):
    for i in range(3):  # finished while their day ran: three small files
        commit(storage, partition, add=[synthetic(f"r{i}", 100, T0 + i)], now=T0 + 60, seal=False)
    before = lakewrite.read_manifest(storage.blobs, *partition.names)
    assert [f.table for f in before.files].count("tasks") == 3
    later = lakewrite.Partition(
        partition.tenant,
        "c",
        layout.day_of(T0 + 2 * DAY),
        partition.tenant_id,
        partition.cluster_id,
    )
    with storage.sessions.begin() as db:
        lake.seal_previous(db, storage.blobs, later, now=T0 + 2 * DAY + 60)
    after = lakewrite.read_manifest(storage.blobs, *partition.names)
    assert [f.table for f in after.files].count("tasks") == 1
    assert sorted(task_keys(storage, after)) == sorted(task_keys(storage, before))
