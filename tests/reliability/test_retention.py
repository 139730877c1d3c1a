"""Retention per tenant (maximum age, maximum runs, dry run): removes blobs and index rows,
touches no other tenant, and a later reindex resurrects nothing. Also the CLI paths:
`hindsight retention apply` and `hindsight reindex` after the index is deleted."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from sqlalchemy import update

from storage.core import models as m
from storage.core.blobs import open_blob_store
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token
from storage.jobs.reindex import reindex
from storage.jobs.retention import apply
from tests.conftest import new_tenant
from tests.helpers import auth, post
from tests.query.test_runs import T0, run_batch
from tests.test_cli import env, run

DAY = 86400.0


@pytest.fixture
def world(stack: dict[str, Any]) -> dict[str, Any]:
    """Two tenants with the same cluster and session names: three sessions each, one run per
    session, the runs started a day apart; session s0 last heard of 30 days ago."""
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    engine = make_engine(stack["database_url"])
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    tenants = [new_tenant(), new_tenant()]
    tokens = {}
    with sessions.begin() as db:
        for t in tenants:
            tokens[t] = create_token(db, t, "ingest,read")
    collector = collector_app(stack).test_client()
    for t in tenants:
        for i in range(3):
            body = run_batch("prod", f"s{i}", f"r{i}", 0, t=T0 + i * DAY)
            assert post(collector, body, token=tokens[t]).status_code == 202
    with sessions.begin() as db:
        db.execute(
            update(m.Session).where(m.Session.name == "s0").values(last_seen=time.time() - 30 * DAY)
        )
    blobs = open_blob_store(stack["blob_url"], endpoint_url=stack.get("s3_endpoint_url"))
    yield {
        "tenants": tenants,
        "tokens": tokens,
        "sessions": sessions,
        "blobs": blobs,
        "query": query_app(stack).test_client(),
    }
    engine.dispose()


def run_names(w: dict[str, Any], tenant: str) -> list[str]:
    resp = w["query"].get("/v1/runs", headers=auth(w["tokens"][tenant]))
    assert resp.status_code == 200
    return sorted(r["name"] for r in resp.json["runs"])


def keys(w: dict[str, Any], tenant: str) -> list[str]:
    return list(w["blobs"].list(f"v1/{tenant}/"))


def test_dry_run_changes_nothing_then_max_age_removes_blobs_and_rows(world):
    w, (t, other) = world, world["tenants"]
    before = keys(w, t)
    plan = apply(w["blobs"], w["sessions"], t, max_age=7 * DAY, dry_run=True)
    assert [s.name for s in plan.sessions] == ["s0"]
    assert (plan.runs, plan.batches) == (1, 1) and plan.bytes > 0
    assert keys(w, t) == before and run_names(w, t) == ["job-r0", "job-r1", "job-r2"]

    done = apply(w["blobs"], w["sessions"], t, max_age=7 * DAY)
    assert done.blobs_deleted == 1
    assert keys(w, t) == [k for k in before if "/s0/" not in k]
    assert run_names(w, t) == ["job-r1", "job-r2"]
    # The other tenant's identically named session is untouched.
    assert run_names(w, other) == ["job-r0", "job-r1", "job-r2"]
    assert len(keys(w, other)) == 3
    # Blobs went first: a reindex finds nothing to bring back.
    counts = reindex(w["blobs"], w["sessions"])
    assert counts["indexed"] == 0
    assert run_names(w, t) == ["job-r1", "job-r2"]
    # And a second apply has nothing left to do.
    assert apply(w["blobs"], w["sessions"], t, max_age=7 * DAY).sessions == []


def test_max_age_keeps_the_history_of_the_sessions_it_keeps(world, stack):
    """Cluster hours older than the age cut-off were deleted
    whatever their sessions, so a session delivered late (a spool pushed long after) kept
    its runs and lost their history, for good (reindex does not redo what it has)."""
    from collector.app import create_app as collector_app

    w, (t, _) = world, world["tenants"]
    late = run_batch("late", "s-late", "r-late", 0, t=time.time() - 30 * DAY)
    assert post(collector_app(stack).test_client(), late, token=w["tokens"][t]).status_code == 202

    def tasks(bucket: str) -> int:
        resp = w["query"].get(f"/v1/history/clusters?cluster=late&bucket={bucket}",
                              headers=auth(w["tokens"][t]))  # fmt: skip
        assert resp.status_code == 200, resp.json
        return sum(p["tasks"] for p in resp.json["points"])

    assert tasks("hour") == tasks("day") == 3
    done = apply(w["blobs"], w["sessions"], t, max_age=7 * DAY)
    assert [s.name for s in done.sessions] == ["s0"]
    assert "job-r-late" in run_names(w, t)
    assert tasks("hour") == tasks("day") == 3


def test_max_age_removes_a_removed_clusters_history_whatever_other_clusters_keep(world, stack):
    """The hours kept for a late-delivered session were kept across
    the whole tenant, so a removed cluster's history (hours and prefix days) stayed: the
    history counted runs that were gone, and disagreed with a rebuilt index."""
    from collector.app import create_app as collector_app

    w, (t, _) = world, world["tenants"]
    collector = collector_app(stack).test_client()
    late = run_batch("late", "s-late", "r-late", 0, t=time.time() - 30 * DAY)  # kept
    gone = run_batch("gone", "s-gone", "r-gone", 0, t=time.time() - 20 * DAY)
    for body in (late, gone):
        assert post(collector, body, token=w["tokens"][t]).status_code == 202
    with w["sessions"].begin() as db:
        db.execute(update(m.Session).where(m.Session.name == "s-gone")
                   .values(last_seen=time.time() - 20 * DAY))  # fmt: skip

    def history(cluster: str) -> tuple[int, int, int]:
        h = auth(w["tokens"][t])
        got = [w["query"].get(f"/v1/history/clusters?cluster={cluster}&bucket={b}", headers=h)
               for b in ("hour", "day")]  # fmt: skip
        days = w["query"].get(f"/v1/history/prefixes?prefix=inc&cluster={cluster}&bucket=day",
                              headers=h)  # fmt: skip
        assert all(r.status_code == 200 for r in (*got, days))
        return (*(sum(p["tasks"] for p in r.json["points"]) for r in got),
                sum(p["count"] for p in days.json["points"]))  # fmt: skip

    assert history("gone") == history("late") == (3, 3, 3)
    done = apply(w["blobs"], w["sessions"], t, max_age=7 * DAY)
    assert sorted(s.name for s in done.sessions) == ["s-gone", "s0"]
    assert history("gone") == (0, 0, 0)
    assert history("late") == (3, 3, 3)
    # ... and the cluster itself is no longer listed (it stayed, with no session and no run)
    listed = w["query"].get("/v1/clusters", headers=auth(w["tokens"][t])).json["clusters"]
    assert sorted(c["name"] for c in listed) == ["late", "prod"]


def test_max_runs_keeps_the_sessions_of_the_newest_runs(world):
    w, (t, _) = world, world["tenants"]
    done = apply(w["blobs"], w["sessions"], t, max_runs=1)
    assert sorted(s.name for s in done.sessions) == ["s0", "s1"]
    assert run_names(w, t) == ["job-r2"]
    assert [k.split("/")[3] for k in keys(w, t)] == ["s2"]


def test_a_crash_between_blob_and_index_deletes_is_finished_by_the_next_apply(world):
    w, (t, _) = world, world["tenants"]
    # The state a crash after the blob deletes leaves: rows whose blobs are gone.
    for key in keys(w, t):
        if "/s0/" in key:
            w["blobs"].delete(key)
    done = apply(w["blobs"], w["sessions"], t, max_age=7 * DAY)
    assert [s.name for s in done.sessions] == ["s0"]
    assert run_names(w, t) == ["job-r1", "job-r2"]


class LateWriter:
    """The tenant's blob store, with a finisher's put landing just after retention listed a
    session's compacted copies: the moment a run finished while retention removed it."""

    def __init__(self, blobs: Any, prefix: str) -> None:
        self.blobs, self.prefix, self.written = blobs, prefix, False

    def list(self, prefix: str) -> Any:
        listed = list(self.blobs.list(prefix))
        if prefix == self.prefix and not self.written:
            self.written = True
            self.blobs.put(f"{prefix}late-run/1-1/tasks.parquet", b"a finisher's copy")
        return iter(listed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.blobs, name)


def test_a_compacted_copy_written_while_its_session_goes_goes_too(world):
    """Retention listed the session's compacted copies once,
    before deleting its index rows, and a copy a finisher wrote meanwhile stayed for good
    (a second apply has no session to look under)."""
    w, (t, _) = world, world["tenants"]
    prefix = f"compact/v1/{t}/prod/s0/"
    late = LateWriter(w["blobs"], prefix)
    done = apply(late, w["sessions"], t, max_age=7 * DAY)
    assert [s.name for s in done.sessions] == ["s0"] and late.written
    assert list(w["blobs"].list(prefix)) == []


def test_limits_are_validated(world):
    w, (t, _) = world, world["tenants"]
    with pytest.raises(ValueError):
        apply(w["blobs"], w["sessions"], t)
    with pytest.raises(ValueError):
        apply(w["blobs"], w["sessions"], t, max_runs=-1)


def test_cli_retention_dry_run_apply_and_reindex_rebuild(tmp_path):
    """The operator's path on the embedded stack: retention, then a deleted index rebuilt by
    `hindsight reindex` (with its progress bar) answers the same."""
    from services.embedded import create_app

    # The runs' finished-run work stays not yet due: done by the app's background worker
    # while the CLI ran (seconds on a loaded machine), it wrote each run's own objects and
    # retention counted them with the batch's blob.
    settings = {"data_dir": str(tmp_path), "auth": "disabled", "finish_settle_seconds": 3600}
    client = create_app(settings).test_client()
    for i in range(3):
        assert (
            post(client, run_batch("prod", f"s{i}", f"r{i}", 0, t=T0 + i * DAY)).status_code == 202
        )
    engine = make_engine(f"sqlite:///{tmp_path / 'index.db'}")
    with make_sessionmaker(engine).begin() as db:
        db.execute(update(m.Session).where(m.Session.name == "s0").values(last_seen=0.0))
    engine.dispose()

    args = ("retention", "apply", "--tenant", "default", "--max-age-days", "7")
    dry = run(*args, "--dry-run", "--data-dir", str(tmp_path), env=env())
    assert dry.returncode == 0, dry.stderr
    assert "would remove 1 sessions" in dry.stdout and "prod/s0" in dry.stdout
    assert len(list((tmp_path / "blobs").rglob("*.json.zst"))) == 3
    done = run(*args, "--data-dir", str(tmp_path), env=env())
    assert done.returncode == 0, done.stderr
    assert "removed 1 sessions" in done.stdout and "(1 blobs deleted)" in done.stdout
    assert len(list((tmp_path / "blobs").rglob("*.json.zst"))) == 2
    assert run("retention", "apply", "--tenant", "default", "--data-dir", str(tmp_path),
               env=env()).returncode != 0  # fmt: skip
    # a tenant's name mistyped (in a cron job, say) is an error, not "removed 0 sessions"
    typo = run("retention", "apply", "--tenant", "defualt", "--max-age-days", "7",
               "--data-dir", str(tmp_path), env=env())  # fmt: skip
    assert typo.returncode != 0 and "no tenant 'defualt'" in typo.stderr, typo.stdout

    client = create_app(settings).test_client()
    before = client.get("/v1/runs").json
    for f in tmp_path.glob("index.db*"):
        f.unlink()
    rebuilt = run("reindex", "--data-dir", str(tmp_path), env=env())
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "reindexing" in rebuilt.stderr  # the progress bar
    assert "2 blobs: 2 indexed" in rebuilt.stdout
    after = create_app(settings).test_client().get("/v1/runs").json
    strip = lambda runs: [  # noqa: E731
        {k: v for k, v in r.items() if k not in ("first_seen", "last_seen")} for r in runs["runs"]
    ]
    assert strip(after) == strip(before) and len(after["runs"]) == 2
    assert json.dumps(after)  # plain JSON
