"""A lake of the earlier format (lake/v1/: Parquet files and a JSON manifest per
partition) moves into the Iceberg tables with ``hindsight lake migrate``: every row of the
newest manifests, none of the files they superseded, each once however often it runs, the
old files gone after; on both stacks."""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import pytest
from sqlalchemy import func, select

from hindsight import lake as layout
from storage.core import models as m
from storage.lake import write as lakewrite
from storage.lake.migrate import migrate
from tests.lake.conftest import DAY, lake_location, make_cluster
from tests.lake.test_writer import synthetic
from tests.query.test_runs import T0


def put_old_file(storage: Any, tenant: str, day: str, table: str, seq: int, t: Any) -> dict:
    """One Parquet file as the earlier lake wrote it (no partition columns inside; the runs
    table without ``tag``), and its manifest entry."""
    import pyarrow.parquet as pq

    if table == "runs":
        t = t.drop_columns(["tag"])
    buf = io.BytesIO()
    pq.write_table(t, buf, compression="zstd")
    h = hashlib.sha256(f"{table}{seq}{t['run'].to_pylist()}".encode()).hexdigest()[:16]
    key = f"lake/v1/{table}/tenant={tenant}/cluster=c/day={day}/part-{seq:010d}-{h}.parquet"
    storage.blobs.put(key, buf.getvalue())
    runs = sorted(set(t["run"].to_pylist()))
    return {"table": table, "key": key, "rows": len(t), "bytes": len(buf.getvalue()), "runs": runs}


def put_old_partition(
    storage: Any, tenant: str, day: str, seq: int, runs: list[Any], removed: list[str] = ()
) -> dict:
    import pyarrow as pa

    files = []
    for table in layout.TABLES:
        t = pa.concat_tables([r.tables[table] for r in runs])
        if len(t):
            files.append(put_old_file(storage, tenant, day, table, seq, t))
    manifest = {
        "format": "hindsight-lake", "lake": 1, "tenant": tenant, "cluster": "c", "day": day,
        "seq": seq, "committed_at": T0 + DAY, "files": files,
        "runs": {r.run: {"tag": r.tag, "session": "s"} for r in runs},
        "removed": [{"key": k, "at": T0 + DAY} for k in removed],
    }  # fmt: skip
    key = f"lake/v1/_manifests/tenant={tenant}/cluster=c/day={day}/{seq:010d}.json"
    storage.blobs.put(key, json.dumps(manifest).encode())
    return manifest


def iceberg_rows(storage: Any, tenant: str, table: str) -> list[tuple[str, str, str]]:
    from pyiceberg.expressions import EqualTo

    t = lakewrite.table(lake_location(storage), table)
    got = t.scan(row_filter=EqualTo("tenant", tenant)).to_arrow()
    col = "key" if table == "tasks" else "run"
    cols = (got["day"].to_pylist(), got["run"].to_pylist(), got[col].to_pylist())
    return sorted(zip(*cols, strict=True))


def test_an_old_lake_moves_into_iceberg_with_every_row_once(stack, storage):
    from tests.conftest import new_tenant

    tenant = new_tenant()
    tenant_id, cluster_id = make_cluster(storage, tenant, "c")
    day0, day1 = layout.day_of(T0), layout.day_of(T0 + DAY)
    a, b = synthetic("a", 300, T0), synthetic("b", 200, T0, tag="v7")
    c = synthetic("c", 50, T0 + DAY)
    # day 0: manifest 1 held an older version of a, manifest 2 (newest) holds a and b
    old = put_old_partition(storage, tenant, day0, 1, [synthetic("a", 999, T0, tag="v0")])
    superseded = [f["key"] for f in old["files"]]
    put_old_partition(storage, tenant, day0, 2, [a, b], removed=superseded)
    put_old_partition(storage, tenant, day1, 5, [c])
    with storage.sessions.begin() as db:  # the index's catalog of the old lake
        p = m.LakePartition(tenant_id=tenant_id, cluster_id=cluster_id, day=day0, seq=2)
        db.add(p)
        db.flush()
        db.add(m.LakeFile(partition_id=p.id, tbl="tasks", key=superseded[0], rows=999, bytes=1,
                          runs=["a"], stats={}))  # fmt: skip
    counts = migrate(storage.blobs, storage.sessions)
    assert counts == {"partitions": 2, "tasks": 550, "metrics": 0, "runs": 3, "streams": 0}
    want = sorted(
        [(day0, "a", f"a-{i}") for i in range(300)]
        + [(day0, "b", f"b-{i}") for i in range(200)]
        + [(day1, "c", f"c-{i}") for i in range(50)]
    )
    assert iceberg_rows(storage, tenant, "tasks") == want
    tags = lakewrite.table(lake_location(storage), "runs").scan().to_arrow()
    mine = {r: t for r, t, n in zip(tags["run"].to_pylist(), tags["tag"].to_pylist(),
            tags["tenant"].to_pylist(), strict=True) if n == tenant}  # fmt: skip
    assert mine == {"a": "v1", "b": "v7", "c": "v1"}
    assert [k for k in storage.blobs.list("lake/v1/") if tenant in k] == []
    with storage.sessions() as db:
        assert db.scalar(select(func.count()).select_from(m.LakeFile).where(
            m.LakeFile.partition_id == p.id)) == 0  # fmt: skip
        assert db.scalar(select(m.LakePartition.seq).where(m.LakePartition.id == p.id)) == 1
    # run again (a migration stopped half way, or twice by mistake): nothing changes
    put_old_partition(storage, tenant, day1, 5, [c])
    assert migrate(storage.blobs, storage.sessions)["tasks"] == 50
    assert iceberg_rows(storage, tenant, "tasks") == want


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_the_migrate_command_moves_a_servers_old_lake(stack, storage):
    """``hindsight lake migrate --data-dir`` on an embedded server's directory."""
    import subprocess
    import sys

    from tests.conftest import new_tenant

    tenant = new_tenant()
    put_old_partition(storage, tenant, layout.day_of(T0), 3, [synthetic("m", 40, T0)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    out = subprocess.run(
        [sys.executable, "-m", "hindsight.cli", "lake", "migrate", "--data-dir", stack["data_dir"]],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert out.startswith("1 partitions moved: 40 tasks rows")
    assert list(storage.blobs.list("lake/v1/")) == []
    assert iceberg_rows(storage, tenant, "tasks") == sorted(
        (layout.day_of(T0), "m", f"m-{i}") for i in range(40)
    )
