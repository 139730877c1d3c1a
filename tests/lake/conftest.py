"""Lake tests: a stack's storage opened in the test process, and the finish hook."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import select

from hindsight import lake as layout
from storage.core import models as m
from tests.dask.conftest import hindsight_server  # noqa: F401
from tests.helpers import auth, post
from tests.query.test_runs import T0, run_batch

DAY = 86_400.0


def finish_all(sessions: Any, blobs: Any, tenant: str | None = None) -> int:
    """Run the lake finisher for every run of ``tenant`` that is not running, as the finish
    queue would (the test stacks run no finish worker: they share one database)."""
    from storage.jobs.finish import finished_run
    from storage.lake import build as lake

    n = 0
    with sessions() as db:
        q = select(m.Run.id).where(m.Run.status != "running").order_by(m.Run.id)
        if tenant is not None:
            q = q.join(m.Tenant, m.Tenant.id == m.Run.tenant_id).where(m.Tenant.name == tenant)
        ids = list(db.scalars(q))
    for run_id in ids:
        with sessions.begin() as db:
            run = db.get(m.Run, run_id)
            assert run is not None
            t, c, s = db.execute(
                select(m.Tenant.name, m.Cluster.name, m.Session.name)
                .join(m.Cluster, m.Cluster.tenant_id == m.Tenant.id)
                .join(m.Session, m.Session.cluster_id == m.Cluster.id)
                .where(m.Session.id == run.session_id)
            ).one()
            lake.finish(finished_run(db, blobs, run, t, c, s))
            n += 1
    return n


def make_cluster(storage: Any, tenant: str, name: str) -> tuple[int, int]:
    """(tenant id, cluster id) of a cluster made directly in the index."""
    from storage.core.tokens import ensure_tenant

    with storage.sessions.begin() as db:
        tenant_id = ensure_tenant(db, tenant, T0)
        cluster = m.Cluster(tenant_id=tenant_id, name=name, first_seen=T0, last_seen=T0)
        db.add(cluster)
        db.flush()
        return tenant_id, cluster.id


@dataclass
class Storage:
    settings: Any
    engine: Any
    sessions: Any
    blobs: Any


@pytest.fixture
def storage(stack: dict[str, Any]) -> Iterator[Storage]:
    from storage.core.blobs import blob_store_for
    from storage.core.config import load_settings
    from storage.core.db import make_engine, make_sessionmaker, upgrade

    settings = load_settings(stack)
    engine = make_engine(settings.database_url)
    upgrade(engine)
    yield Storage(settings, engine, make_sessionmaker(engine), blob_store_for(settings))
    engine.dispose()


def lake_location(storage: Any) -> Any:
    from storage.lake.write import location_from_settings

    return location_from_settings(storage.settings)


def lake_records(
    storage: Any, stack: dict[str, Any], tenant: str, table: str = "tasks", **filters: Any
) -> list[dict[str, Any]]:
    """Rows of the lake read without the server (pyiceberg's scan), as dicts in the order
    of the table's sort keys within each run, without the partition columns."""
    from storage.lake import write

    f = layout.Filters.from_kwargs(**filters)
    t = write.table(lake_location(storage), table).scan(row_filter=f.iceberg(table, tenant))
    rows = t.to_arrow().drop_columns(["tenant", "cluster", "day"])
    keys = [("run", "ascending"), *write.SORT_KEYS[table]]
    return rows.sort_by(keys).to_pylist()


@pytest.fixture
def tenant_runs(stack, make_token, storage):
    """Runs on two clusters over three days (two runs on one day of one cluster), one
    erred, one still running, with metrics and emitted values."""
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    collector, query = collector_app(stack).test_client(), query_app(stack).test_client()
    token = make_token()
    specs = [
        ("prod", "s1", "r0", 0.0, "finished"),
        ("prod", "s1", "r1", 0.1, "erred"),
        ("prod", "s2", "r2", 1.0, "finished"),
        ("dev", "s3", "r3", 1.0, "finished"),
        ("dev", "s3", "r4", 2.0, None),
    ]
    seqs: dict[str, int] = {}
    for cluster, session, run, day, status in specs:
        t = T0 + day * DAY
        body = run_batch(cluster, session, run, 0, n_tasks=4, t=t, status=status)
        next(e for e in body["events"] if e["kind"] == "task")["attrs"] = {"retried": 1}
        body["seq"] = seqs.setdefault(session, 0)
        seqs[session] += 1
        body["events"] += [
            {"kind": "metric", "worker": "tcp://w:1", "time": t + 1, "values": {"cpu": 50.0}},
            {
                "kind": "custom",
                "stream": "rows-in",
                "time": t + 1,
                "value": 1000 * (1 + day),
                "worker": "tcp://w:1",
                "run": run,
                "key": f"inc-{run}-0-0",
            },
        ]
        if status == "erred":
            body["events"][1]["status"] = "erred"
            body["events"][1]["exception"] = "ValueError('boom')"
        assert post(collector, body, token=token).status_code == 202
    runs = query.get("/v1/runs?limit=100", headers=auth(token)).json["runs"]
    tenant = storage_tenant(storage, token)
    return {
        "query": query,
        "collector": collector,
        "token": token,
        "tenant": tenant,
        "runs": {r["name"].removeprefix("job-"): r for r in runs},
    }


def storage_tenant(storage: Any, token: str) -> str:
    from storage.core.tokens import verify_token

    with storage.sessions() as db:
        principal = verify_token(db, token)
        assert principal is not None
        return principal.tenant
