"""`hindsight reindex`: drop the index, rebuild it from the blob store, same answers."""

from __future__ import annotations

import atexit
import secrets
import time
from typing import Any

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url

from storage.core import models as m
from storage.core.blobs import open_blob_store
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.manifest import collapse_due
from storage.core.tokens import create_token
from storage.jobs.finish import drain
from storage.jobs.reindex import reindex
from tests.conftest import TEST_DATABASE_URL, new_tenant
from tests.helpers import auth, example, post
from tests.query.test_runs import run_batch

VOLATILE = {"first_seen", "last_seen", "last_run_started_at"}  # when the index saw it


def answers(query: Any, token: str) -> dict[str, Any]:
    h = auth(token)

    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in VOLATILE}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    runs = query.get("/v1/runs", headers=h).json["runs"]
    return strip(
        {
            "clusters": query.get("/v1/clusters", headers=h).json,
            "runs": runs,
            "details": [query.get(f"/v1/runs/{r['id']}", headers=h).json for r in runs],
            "tasks": [query.get(f"/v1/runs/{r['id']}/tasks", headers=h).json for r in runs],
        }
    )


def fresh_index(stack: dict[str, Any], tmp_path: Any) -> str:
    """An empty index next to the stack's: a SQLite file, or a Postgres database that is
    dropped when the test run ends (each run used to leave its rebuilt databases behind)."""
    url = make_url(stack["database_url"])
    if url.get_backend_name() == "sqlite":
        return f"sqlite:///{tmp_path / 'rebuilt.db'}"
    name = f"{url.database}_re_{secrets.token_hex(3)}"
    with create_engine(url, isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    # At exit the stack's own database is gone (dropped by its fixture): drop this one
    # through the database the test fixtures create theirs from.
    atexit.register(_drop_database, TEST_DATABASE_URL, name)
    return url.set(database=name).render_as_string(hide_password=False)


def _drop_database(admin_url: str, name: str) -> None:
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    except Exception:  # the server went away first: nothing to clean
        pass
    finally:
        engine.dispose()


def test_rebuilt_index_answers_the_same(stack, tmp_path):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    tenant = new_tenant()
    engine = make_engine(stack["database_url"])
    upgrade(engine)
    with make_sessionmaker(engine).begin() as db:
        token = create_token(db, tenant, "ingest,read")
    engine.dispose()
    collector = collector_app(stack).test_client()
    assert post(collector, example(), token=token).status_code == 202
    for seq in range(3):
        body = run_batch(
            "c2", "s9", "r-long", seq, n_tasks=20, status="finished" if seq == 2 else None
        )
        assert post(collector, body, token=token).status_code == 202
    before = answers(query_app(stack).test_client(), token)
    assert len(before["runs"]) == 2

    rebuilt = {**stack, "database_url": fresh_index(stack, tmp_path)}
    engine = make_engine(rebuilt["database_url"])
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    blobs = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    counts = reindex(blobs, sessions)
    assert counts == {"blobs": 4, "indexed": 4, "already": 0, "skipped": 0}
    assert reindex(blobs, sessions)["already"] == 4  # running it again changes nothing
    with sessions.begin() as db:  # tokens live only in the index; the tenant is in the keys
        token2 = create_token(db, tenant, "read")
    assert answers(query_app(rebuilt).test_client(), token2) == before
    # its manifest collapsed (decision 0037), a rebuild over it still finds every batch
    drain(sessions, blobs)
    finished = answers(query_app(rebuilt).test_client(), token2)
    assert collapse_due(sessions, age=60.0, now=time.time() + 61) >= 3
    assert reindex(blobs, sessions)["already"] == 4
    drain(sessions, blobs)  # the rebuild queued every finished run's work again
    engine.dispose()
    again = answers(query_app(rebuilt).test_client(), token2)
    for d in (*again["details"], *finished["details"]):
        assert d.pop("finished_work")["done_at"] is not None
    assert again == finished


def test_a_rebuild_years_later_still_finds_a_runs_metrics(stack, tmp_path):
    """A run's metric samples sit in the session's other batches; they are found by the
    times they describe, not when they arrived: a worker's batch delivered an hour late
    (from its spool) still counts, and so does everything after a rebuild years later."""
    import zstandard

    from hindsight.schema import Batch, MetricEvent, RunEvent, StartStop, TaskEvent, encode_batch
    from storage.core import models as m
    from storage.core.batches import blob_key, decode_stored
    from storage.core.blobs import blob_store_for
    from storage.core.config import load_settings
    from storage.core.tokens import ensure_tenant
    from storage.ingest.writer import index_batch
    from storage.runs import runfile

    t0 = 1_700_000_000.0  # events of 2023, indexed "then" and rebuilt now
    tenant = new_tenant()
    blobs = blob_store_for(load_settings(stack))
    scheduler = Batch(
        1,
        "c",
        "s",
        "scheduler-1",
        0,
        [
            RunEvent("started", "r", t0),
            *(
                TaskEvent(
                    key=f"k{i}",
                    prefix="inc",
                    status="memory",
                    run="r",
                    worker="tcp://w:1",
                    startstops=[StartStop("compute", t0 + i, t0 + i + 0.5)],
                )
                for i in range(5)
            ),
            RunEvent("finished", "r", t0 + 6),
        ],
    )
    worker = Batch(
        1,
        "c",
        "s",
        "worker-1",
        0,
        [MetricEvent("tcp://w:1", t0 + i, {"memory.managed": float(i)}) for i in range(6)],
    )

    def metrics(url: str, index: bool) -> list[Any]:
        engine = make_engine(url)
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        if index:  # as the collector did back then; the worker's batch an hour late
            for b in (scheduler, worker):
                key = blob_key(tenant, b)
                blobs.put(key, zstandard.ZstdCompressor().compress(encode_batch(b)), if_absent=True)
                with sessions.begin() as db:
                    tid = ensure_tenant(db, tenant, t0)
                    index_batch(
                        db,
                        tenant_id=tid,
                        tenant=tenant,
                        batch=decode_stored(blobs.get(key)),
                        blob_key=key,
                        size=1,
                        now=t0 + 10 if b is scheduler else t0 + 3600,
                    )
        else:
            reindex(blobs, sessions, prefix=f"v1/{tenant}/")
        with sessions() as db:
            run = db.execute(
                select(m.Run).join(m.Tenant).where(m.Tenant.name == tenant)
            ).scalar_one()
            rows = runfile.load_run(db, blobs, run, write=False, cache=False).metrics.to_pylist()
        engine.dispose()
        return rows

    before = metrics(stack["database_url"], index=True)
    assert len(before) == 6
    assert metrics(fresh_index(stack, tmp_path), index=False) == before


def test_a_rebuilt_index_keeps_when_each_batch_arrived(stack, make_token, tmp_path):
    """Reindex indexed every batch as arriving at the time of
    the rebuild, so afterwards every session was new and retention by age kept everything
    for another term. A batch is indexed as of when it was stored."""
    import os
    import time

    from collector.app import create_app as collector_app
    from storage.jobs.retention import plan

    if not stack["blob_url"].startswith("file://"):
        pytest.skip("the stored time is set here on the batch's file (S3 sets its own)")
    tenant = new_tenant()
    token = make_token(tenant)
    assert post(collector_app(stack).test_client(), example(), token=token).status_code == 202
    blobs = open_blob_store(stack["blob_url"])
    (key,) = list(blobs.list(f"v1/{tenant}/"))
    month_ago = time.time() - 30 * 86400
    os.utime(blobs._path(key), (month_ago, month_ago))

    rebuilt = make_engine(fresh_index(stack, tmp_path))
    upgrade(rebuilt)
    sessions = make_sessionmaker(rebuilt)
    assert reindex(blobs, sessions, prefix=f"v1/{tenant}/")["indexed"] == 1
    with sessions() as db:
        expired = plan(db, tenant, max_age=7 * 86400).sessions
        assert [s.name for s in expired] == [example()["session"]]
        assert expired[0].last_seen == pytest.approx(month_ago, abs=1)
    rebuilt.dispose()


def test_a_rebuild_writes_equal_detail_objects(stack, tmp_path):
    """Each finished run's detail object (``storage.runs.detail``) rebuilt by a reindex
    holds what the original held: its replay samples and profile trees, frames by name.
    Profile tags name batch ids, which a rebuilt index may number otherwise."""
    from collector.app import create_app as collector_app
    from storage.jobs.finish import drain, finish_run
    from storage.runs import detail

    tenant = new_tenant()
    engine = make_engine(stack["database_url"])
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as db:
        token = create_token(db, tenant, "ingest,read")
    collector = collector_app(stack).test_client()
    for seq in range(3):
        body = run_batch("c3", "s3", "r", seq, n_tasks=20, status="finished" if seq == 2 else None)
        assert post(collector, body, token=token).status_code == 202
    blobs = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    with sessions() as db:  # this tenant's runs only: the stack's index is shared
        ids = (
            db.execute(select(m.Run.id).join(m.Tenant).where(m.Tenant.name == tenant))
            .scalars()
            .all()
        )
        for run_id in ids:
            assert finish_run(db, blobs, run_id) == []

    def objects(sessions: Any) -> dict[str, Any]:
        out = {}
        with sessions() as db:
            runs = db.execute(select(m.Run).join(m.Tenant).where(m.Tenant.name == tenant)).scalars()
            for run in runs:
                d = detail.read(db, blobs, run)
                out[run.public_id] = (
                    d.states,
                    d.frames,
                    [(p.prefix, p.worker, p.samples, p.nodes, p.data) for p in d.profiles],
                )
        return out

    before = objects(sessions)
    engine.dispose()
    assert len(before) == 1
    rebuilt = make_engine(fresh_index(stack, tmp_path))
    upgrade(rebuilt)
    again = make_sessionmaker(rebuilt)
    reindex(blobs, again)
    drain(again, blobs)
    detail.clear_cache()
    assert objects(again) == before
    rebuilt.dispose()
