"""Moving a lake of Hindsight's own format (``lake/v1/``: Hive-partitioned Parquet with a
JSON manifest per partition, before the lake became Iceberg tables) into the Iceberg tables.

The manifests are read here and nowhere else: for each partition, the newest manifest
(highest ``seq``) names the live files and the runs with their versions (``tag``). Its
rows are committed to the Iceberg partition, replacing whatever the partition holds of
those runs (so a migration run twice, or stopped half way and run again, counts every row
once), the row counts are checked against the manifest's, and only then are the old
files and manifests deleted (unless kept). The index's ``lake_runs`` already name each
run's version: tags are computed as before, so no finisher rewrites a migrated run.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from hindsight import lake as layout
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.lake import write
from storage.lake.write import Partition, RunRows

logger = logging.getLogger(__name__)

OLD_ROOT = "lake/v1"
_MANIFEST = re.compile(
    rf"^{OLD_ROOT}/_manifests/tenant=(?P<tenant>[^/]+)/cluster=(?P<cluster>[^/]+)"
    r"/day=(?P<day>\d{4}-\d{2}-\d{2})/(?P<seq>\d{10})\.json$"
)


def old_partitions(blobs: BlobStore) -> dict[tuple[str, str, str], str]:
    """The newest manifest key of each partition of the old lake."""
    best: dict[tuple[str, str, str], tuple[int, str]] = {}
    for key in blobs.list(f"{OLD_ROOT}/_manifests/"):
        g = _MANIFEST.match(key)
        if g is None:
            continue
        part, seq = (g["tenant"], g["cluster"], g["day"]), int(g["seq"])
        if part not in best or seq > best[part][0]:
            best[part] = (seq, key)
    return {part: key for part, (_seq, key) in sorted(best.items())}


def _tables(blobs: BlobStore, manifest: dict[str, Any]) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tags = {r: e["tag"] for r, e in manifest["runs"].items()}
    out = {}
    for name in layout.TABLES:
        schema = layout.schema(name)
        parts = []
        for f in manifest["files"]:
            if f["table"] != name:
                continue
            t = pq.read_table(io.BytesIO(blobs.get(f["key"])))
            if name == "runs" and "tag" not in t.column_names:
                t = t.append_column("tag", pa.array([tags.get(r) for r in t["run"].to_pylist()]))
            parts.append(t.select(schema.names).cast(schema))
        out[name] = pa.concat_tables(parts) if parts else schema.empty_table()
    return out


def migrate(
    blobs: BlobStore,
    sessions: sessionmaker[Session],
    *,
    keep: bool = False,
    on_partition: Callable[[str, dict[str, int]], None] | None = None,
) -> dict[str, int]:
    """Move every partition of the old lake into the Iceberg tables. Returns counts: the
    partitions moved and the rows of each table."""
    with sessions() as db:
        loc = write.location_of(db, blobs)
    counts = {"partitions": 0, **dict.fromkeys(layout.TABLES, 0)}
    for (tenant, cluster, day), key in old_partitions(blobs).items():
        manifest = json.loads(blobs.get(key))
        part = Partition(tenant, cluster, day)
        tables = _tables(blobs, manifest)
        runs = sorted(manifest["runs"])
        if runs:
            rows = RunRows(",".join(runs), "", "", lambda t=tables: t)
            write.commit_runs(loc, part, [rows], replace=runs)
            _check(loc, part, runs, tables)
        moved = {n: len(t) for n, t in tables.items()}
        with sessions.begin() as db:
            _index(db, tenant, cluster, day)
        if not keep:
            for f in manifest["files"]:
                blobs.delete(f["key"])
            for r in manifest.get("removed", []):
                blobs.delete(r["key"])
            prefix = f"{OLD_ROOT}/_manifests/tenant={tenant}/cluster={cluster}/day={day}/"
            for k in list(blobs.list(prefix)):
                blobs.delete(k)
        counts["partitions"] += 1
        for n, c in moved.items():
            counts[n] += c
        if on_partition is not None:
            on_partition(f"{tenant}/{cluster}/{day}", moved)
    return counts


def _check(loc: write.Location, part: Partition, runs: list[str], tables: dict[str, Any]) -> None:
    """The partition holds exactly the manifest's rows of its runs (else nothing is deleted)."""
    from pyiceberg.expressions import And, In

    for name, t in tables.items():
        cond = And(part.expression(), In("run", runs))
        got = write.table(loc, name).scan(row_filter=cond, selected_fields=("run",)).to_arrow()
        if len(got) != len(t):
            raise RuntimeError(
                f"lake migration of {part} {name}: {len(got)} rows in Iceberg, {len(t)} in "
                "the old lake; the old files are kept"
            )


def _index(db: Session, tenant: str, cluster: str, day: str) -> None:
    """The index's view of a migrated partition: no file rows (the catalog plans now), and
    sealed (one file per table, as migrated) unless it is today's."""
    P = m.LakePartition
    pid = db.scalar(
        select(P.id)
        .join(m.Cluster, m.Cluster.id == P.cluster_id)
        .join(m.Tenant, m.Tenant.id == P.tenant_id)
        .where(m.Tenant.name == tenant, m.Cluster.name == cluster, P.day == day)
    )
    if pid is None:
        return
    db.execute(delete(m.LakeFile).where(m.LakeFile.partition_id == pid))
    sealed = int(day < layout.day_of(time.time()))
    db.execute(update(P).where(P.id == pid).values(seq=sealed, vacuum_at=None))
