"""Retention and reindex keep the lake in step with the index: a removed session's runs
leave the lake (their files deleted at once), and a lake rebuilt from the batches equals
the one it replaces."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import delete, func, select

from hindsight import lake as layout
from storage.core import models as m
from storage.jobs import retention
from storage.jobs.reindex import reindex
from storage.lake import build as lake
from tests.lake.conftest import finish_all, lake_location, lake_records

SORT = {
    "tasks": ("run", "key"),
    "metrics": ("run", "worker", "time", "name"),
    "runs": ("run",),
    "streams": ("run", "stream", "time"),
}


def snapshot(storage: Any, stack: dict[str, Any], tenant: str) -> dict[str, list[dict[str, Any]]]:
    """Every row of every lake table of ``tenant``, in a canonical order."""
    out = {}
    for table in layout.TABLES:
        rows = lake_records(storage, stack, tenant, table)
        out[table] = sorted(rows, key=lambda r, t=table: tuple(str(r[c]) for c in SORT[t]))
    return out


def lake_blobs(storage: Any, tenant: str) -> list[str]:
    """The data files of the tenant's partitions in the blob store."""
    from storage.lake import write

    loc = lake_location(storage)
    # (pyarrow's S3 writer leaves empty "directory" objects, key ending in /: not files)
    return [
        k
        for t in layout.TABLES
        for k in storage.blobs.list(
            f"{loc.key(write.table(loc, t).location())}/data/tenant={tenant}/"
        )
        if not k.endswith("/")
    ]


def test_retention_takes_removed_sessions_out_of_the_lake(stack, storage, tenant_runs):
    tenant, runs = tenant_runs["tenant"], tenant_runs["runs"]
    finish_all(storage.sessions, storage.blobs, tenant)
    before = snapshot(storage, stack, tenant)
    files_before = set(lake_blobs(storage, tenant))
    # keep the newest run (r4, session s3): sessions s1 and s2 go
    plan = retention.apply(storage.blobs, storage.sessions, tenant, max_runs=1)
    assert sorted(s.name for s in plan.sessions) == ["s1", "s2"]
    after = snapshot(storage, stack, tenant)
    kept = {runs[n]["id"] for n in ("r3", "r4")}
    for table in layout.TABLES:
        assert after[table] == [r for r in before[table] if r["run"] in kept], table
    assert {r["run"] for r in after["tasks"]} == {runs["r3"]["id"]}  # r4 is still running
    # the prod partitions are gone (manifests and files), nothing waits for a grace period
    remaining = set(lake_blobs(storage, tenant))
    assert not any("cluster=prod" in k for k in remaining)
    assert all(storage.blobs.exists(k) for k in remaining)
    assert not any(storage.blobs.exists(k) for k in files_before - remaining)
    with storage.sessions() as db:
        days = db.scalars(
            select(m.LakePartition.day)
            .join(m.Cluster, m.Cluster.id == m.LakePartition.cluster_id)
            .join(m.Tenant, m.Tenant.id == m.Cluster.tenant_id)
            .where(m.Tenant.name == tenant)
        )
        assert list(days) == [layout.day_of(runs["r3"]["started_at"])]
    # applying again finds nothing more to do
    assert retention.apply(storage.blobs, storage.sessions, tenant, max_runs=1).sessions == []
    assert snapshot(storage, stack, tenant) == after


def wipe_index(storage: Any, tenant: str) -> None:
    with storage.sessions.begin() as db:
        db.execute(delete(m.Tenant).where(m.Tenant.name == tenant))  # cascades to everything


def test_a_rebuilt_lake_equals_the_old_one(stack, storage, tenant_runs):
    tenant = tenant_runs["tenant"]
    finish_all(storage.sessions, storage.blobs, tenant)
    before = snapshot(storage, stack, tenant)
    assert before["tasks"]
    # 1. the index is lost, the lake is not: reindex and finishing take it back as it is
    files = sorted(lake_blobs(storage, tenant))
    wipe_index(storage, tenant)
    reindex(storage.blobs, storage.sessions, prefix=f"v1/{tenant}/")
    finish_all(storage.sessions, storage.blobs, tenant)
    lake.reconcile(storage.blobs, storage.sessions)
    assert snapshot(storage, stack, tenant) == before
    assert sorted(lake_blobs(storage, tenant)) == files  # nothing was rewritten
    with storage.sessions() as db:
        n = db.scalar(
            select(func.count())
            .select_from(m.LakeRun)
            .join(m.Run, m.Run.id == m.LakeRun.run_id)
            .join(m.Tenant, m.Tenant.id == m.Run.tenant_id)
            .where(m.Tenant.name == tenant)
        )
        assert n == 4  # the index's catalog is back
    # 2. both are lost: the lake is rebuilt from the batches, row for row
    from pyiceberg.expressions import EqualTo

    from storage.lake import write

    write.delete_rows(lake_location(storage), EqualTo("tenant", tenant))
    assert snapshot(storage, stack, tenant) == {t: [] for t in layout.TABLES}
    wipe_index(storage, tenant)
    reindex(storage.blobs, storage.sessions, prefix=f"v1/{tenant}/")
    finish_all(storage.sessions, storage.blobs, tenant)
    assert snapshot(storage, stack, tenant) == before


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_reindex_drops_runs_the_index_no_longer_has(stack, storage, tenant_runs):
    tenant, runs = tenant_runs["tenant"], tenant_runs["runs"]
    finish_all(storage.sessions, storage.blobs, tenant)
    before = snapshot(storage, stack, tenant)
    # session s2 (run r2) vanishes from the blob store out of band; the index is rebuilt
    for key in list(storage.blobs.list(f"v1/{tenant}/prod/s2/")):
        storage.blobs.delete(key)
    wipe_index(storage, tenant)
    counts = reindex(storage.blobs, storage.sessions)  # a full reindex reconciles the lake
    assert counts["lake_runs_removed"] == 1
    after = snapshot(storage, stack, tenant)
    for table in layout.TABLES:
        assert after[table] == [r for r in before[table] if r["run"] != runs["r2"]["id"]]
