"""Finished-run work: queued when a run finishes, done once it settles (by the collector
itself), done again after a late batch, retried after a failure; folding the appended
rollup rows changes no answer and counts every row once. On both stacks."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
from sqlalchemy import func, select

from storage.core import models as m
from storage.jobs import finish, silent
from storage.runs import rollups
from storage.runs.context import FinishedRun
from tests.conftest import STACKS, fresh_pg_database, make_bucket, new_tenant
from tests.helpers import auth, post
from tests.query.test_runs import T0, run_batch


@pytest.fixture(scope="module", params=list(STACKS))
def own_stack(request, tmp_path_factory, moto_endpoint):
    """A stack of this module's own: every finish job in its index can be done with its
    blob store (the shared test database holds other tests' runs, in other buckets)."""
    tmp = tmp_path_factory.mktemp("finish")
    config = {
        "data_dir": str(tmp),
        "s3_endpoint_url": moto_endpoint,
        "auth": "required",
        "finish_worker": False,
        "finish_settle_seconds": 0,
    }
    if request.param == "embedded":
        yield {
            **config,
            "database_url": f"sqlite:///{tmp / 'index.db'}",
            "blob_url": (tmp / "blobs").as_uri(),
        }
    else:
        for url in fresh_pg_database():
            yield {
                **config,
                "database_url": url,
                "blob_url": f"s3://{make_bucket(moto_endpoint)}/hindsight",
            }


@pytest.fixture
def stack(own_stack):
    return own_stack


@pytest.fixture
def apps(stack):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    config = stack
    collector = collector_app(config)
    return collector.test_client(), query_app(config).test_client(), collector


def store_of(app: Any) -> Any:
    return app.extensions["hindsight"]


def detail(query: Any, token: str, run_id: str) -> dict[str, Any]:
    resp = query.get(f"/v1/runs/{run_id}", headers=auth(token))
    assert resp.status_code == 200, resp.json
    return resp.json


def compacted(app: Any, run_id: str) -> list[str]:
    return sorted(k for k in store_of(app).blobs.list("compact/") if f"/{run_id}/" in k)


def appended_rows(app: Any, tenant: str) -> int:
    """The tenant's rollup rows not folded yet (tests share one Postgres database)."""
    with store_of(app).sessions() as db:
        clusters = select(m.Cluster.id).join(m.Tenant).where(m.Tenant.name == tenant)
        runs = select(m.Run.id).where(m.Run.cluster_id.in_(clusters))
        return sum(
            db.execute(
                select(func.count()).select_from(t).where(t.batch_id != 0, where)
            ).scalar_one()
            for t, where in (
                (m.RunPrefixHist, m.RunPrefixHist.run_id.in_(runs)),
                (m.PrefixDay, m.PrefixDay.cluster_id.in_(clusters)),
                (m.ClusterHour, m.ClusterHour.cluster_id.in_(clusters)),
            )
        )


def job_of(app: Any, run_id: str) -> m.FinishJob | None:
    with store_of(app).sessions() as db:
        return db.execute(
            select(m.FinishJob).join(m.Run).where(m.Run.public_id == run_id)
        ).scalar_one_or_none()


def test_a_finished_run_is_compacted_without_anyone_reading_it(apps, make_token):
    collector, query, app = apps
    token = make_token()
    assert post(collector, run_batch("c", "s", "r", 0, n_tasks=5), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    assert detail(query, token, run["id"])["finished_work"] == {"pending": True, "done_at": None}
    assert compacted(app, run["id"]) == []

    st = store_of(app)
    assert finish.run_due(st.sessions, st.blobs) == 1
    work = detail(query, token, run["id"])["finished_work"]
    assert work["pending"] is False and work["done_at"] is not None
    names = [k.rsplit("/", 1)[1] for k in compacted(app, run["id"])]
    assert [re.sub(r"^[0-9a-f]{32}\.", "<digest>.", n) for n in names] == [
        # storage.runs.facts: the task graph grouped by prefix (a big graph's view)
        "graph-groups-v1.json.zst",
        "graph.parquet",
        "metrics.parquet",
        # storage.runs.facts: the run page's critical path, progress and errors
        "page-v2.json.zst",
        # storage.runs.streamtiles: the task stream's pyramid and start/stops
        "index.json.zst",
        "level-0-0.npz.zst",
        "rects-0.parquet",
        "tasks.parquet",
        # storage.runs.detail: its replay samples and profile, out of the index
        "<digest>.msgpack.zst",
        # storage.query.explain: why it was slower or faster than its job's usual runs
        "explain-v1.json",
        # storage.runs.runlogs: the run's log records, emitted values, worker events
        "logs.parquet",
        "streams.parquet",
        "workers.parquet",
    ]
    assert finish.run_due(st.sessions, st.blobs) == 0  # nothing left to do


def test_a_run_whose_scheduler_went_silent_is_closed_lost(apps, make_token):
    """A scheduler killed with SIGKILL (the OOM killer, a pod
    evicted) never ends its runs; they stayed running for ever, with no finished-run work
    and nothing in the lake. Closed "lost", a run still takes the end its agent sends later
    (a scheduler that was only cut off: had it been closed erred, it would stay so)."""
    collector, query, app = apps
    token = make_token()
    body = run_batch("c", "s", "r", 0, n_tasks=3, status=None)  # no end, no final batch
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    assert run["status"] == "running"
    st = store_of(app)
    with st.sessions() as db:
        heard = db.scalar(select(m.Session.last_seen).join(m.Run).where(
            m.Run.public_id == run["id"]))  # fmt: skip
    assert silent.close_silent(st.sessions, silence=600, now=heard + 599) == 0
    assert silent.close_silent(st.sessions, silence=600, now=heard + 601) >= 1
    got = detail(query, token, run["id"])
    assert got["status"] == "lost" and got["finished_at"] == pytest.approx(T0 + 2.5)  # last stop
    assert got["finished_work"]["pending"] is True
    assert query.get("/v1/runs?status=lost", headers=auth(token)).json["runs"][0]["id"] == run["id"]
    assert silent.close_silent(st.sessions, silence=600, now=heard + 601) == 0
    with st.sessions() as db:  # closing it did not make its session look alive
        assert db.scalar(select(m.Session.last_seen).join(m.Run).where(
            m.Run.public_id == run["id"])) == heard  # fmt: skip
    # the scheduler was only cut off: its own end comes, and replaces "lost"
    late = run_batch("c", "s", "r", 1, n_tasks=1, t=T0 + 10)
    late["events"] = [e for e in late["events"] if e["kind"] != "run" or e["event"] != "started"]
    assert post(collector, late, token=token).status_code == 202
    got = detail(query, token, run["id"])
    assert got["status"] == "finished" and got["finished_at"] == pytest.approx(T0 + 11)


def test_a_late_batch_finishes_the_run_again(apps, make_token):
    collector, query, app = apps
    token = make_token()
    st = store_of(app)
    assert post(collector, run_batch("c", "s", "r", 0, n_tasks=5), token=token).status_code == 202
    finish.drain(st.sessions, st.blobs)
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    first = compacted(app, run["id"])

    late = run_batch("c", "s", "r", 1, n_tasks=4, status=None)
    assert post(collector, late, token=token).status_code == 202
    assert detail(query, token, run["id"])["finished_work"]["pending"] is True
    finish.drain(st.sessions, st.blobs)
    again = compacted(app, run["id"])
    # a copy of the new data, in place of the old (no version, a late batch's or a
    # rebuild's, leaves a full copy behind)
    assert len(again) == len(first)
    # the explanation is one object, rewritten in place by every finishing; the rest is
    # versioned by the data it was built from
    (explained,) = set(first) & set(again)
    assert explained.endswith("/explain-v1.json")
    assert query.get(f"/v1/runs/{run['id']}/tasks", headers=auth(token)).json["total"] == 9


def _failing(fr: FinishedRun) -> None:
    raise RuntimeError("disk on fire")


def test_a_failing_finisher_is_retried_and_does_not_stop_the_others(apps, make_token, monkeypatch):
    collector, query, app = apps
    token = make_token()
    st = store_of(app)
    monkeypatch.setattr(finish, "FINISHERS", (_failing, *finish.FINISHERS))
    assert post(collector, run_batch("c", "s", "r", 0), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    before = time.time()
    finish.run_due(st.sessions, st.blobs, limit=1000)
    assert len(compacted(app, run["id"])) == 13  # the finishers after the failing one ran
    job = job_of(app, run["id"])
    assert "disk on fire" in job.error and job.due_at >= before + finish.RETRY_SECONDS
    assert detail(query, token, run["id"])["finished_work"]["pending"] is True

    monkeypatch.setattr(finish, "FINISHERS", finish.FINISHERS[1:])
    finish.run_due(st.sessions, st.blobs, now=job.due_at, limit=1000)
    assert detail(query, token, run["id"])["finished_work"]["pending"] is False


def test_a_finisher_failing_as_a_late_batch_arrives_leaves_the_job_due(
    apps, make_token, monkeypatch
):
    """A late batch moves the job's due time; when a finisher
    failed meanwhile, its error was written to no row and the job stayed claimed for the
    whole lease (10 minutes), its failure nowhere to be seen."""
    collector, query, app = apps
    token = make_token()
    st = store_of(app)
    assert post(collector, run_batch("c", "s", "r", 0), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]

    def late_then_fail(fr: FinishedRun) -> None:
        late = run_batch("c", "s", "r", 1, t=T0 + 100, status=None)
        assert post(collector, late, token=token).status_code == 202
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(finish, "FINISHERS", (late_then_fail, *finish.FINISHERS))
    finish.run_due(st.sessions, st.blobs, limit=1000)
    job = job_of(app, run["id"])
    assert job.claimed_until is None and "disk on fire" in job.error
    monkeypatch.setattr(finish, "FINISHERS", finish.FINISHERS[1:])
    assert finish.run_due(st.sessions, st.blobs, now=job.due_at, limit=1000) == 1
    assert detail(query, token, run["id"])["finished_work"]["pending"] is False
    assert query.get(f"/v1/runs/{run['id']}/tasks", headers=auth(token)).json["total"] == 6


def test_a_crashed_workers_job_is_taken_once_its_lease_runs_out_a_live_one_is_not(
    apps, make_token, monkeypatch
):
    """A collector killed mid-job (``kill -9``) does not leave the run's job leased for long
    (no lake rows, no page facts meanwhile): the lease is short and renewed while the work
    goes on, so a live worker keeps its job however long its finishers take, and a dead
    one's is taken as soon as its lease runs out."""
    collector, query, app = apps
    token = make_token()
    st = store_of(app)
    # ten renewals a lease: with the embedded stack (SQLite, one writer at a time) this
    # test's own claims in a tight loop delayed the renewer past a lease of five (a CI run)
    monkeypatch.setattr(finish, "LEASE_SECONDS", 2.0)
    monkeypatch.setattr(finish, "RENEW_SECONDS", 0.2)
    assert post(collector, run_batch("c", "s", "r", 0), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]

    # A live worker whose first finisher outlasts the lease several times over.
    working, release = threading.Event(), threading.Event()

    def slow(fr: FinishedRun) -> None:
        working.set()
        assert release.wait(30)

    monkeypatch.setattr(finish, "FINISHERS", (slow, *finish.FINISHERS))
    worker = threading.Thread(target=finish.run_due, args=(st.sessions, st.blobs))
    worker.start()
    assert working.wait(30)
    claimed_at = time.time()
    while time.time() < claimed_at + 3 * finish.LEASE_SECONDS:
        with st.sessions.begin() as db:
            assert finish._claim(db, time.time(), 1) == [], "a live worker's job was taken"
    release.set()
    worker.join(30)
    assert job_of(app, run["id"]) is None
    assert detail(query, token, run["id"])["finished_work"]["pending"] is False

    # A worker that died holding a job (claimed, never renewed, never finished).
    late = run_batch("c", "s", "r", 1, t=T0 + 100, status=None)
    assert post(collector, late, token=token).status_code == 202
    due = job_of(app, run["id"]).due_at
    with st.sessions.begin() as db:
        assert len(finish._claim(db, due, 1)) == 1
    monkeypatch.setattr(finish, "FINISHERS", finish.FINISHERS[1:])
    claimed_until = job_of(app, run["id"]).claimed_until
    assert claimed_until <= due + finish.LEASE_SECONDS
    assert finish.run_due(st.sessions, st.blobs, now=claimed_until - 0.1) == 0
    assert finish.run_due(st.sessions, st.blobs, now=claimed_until + 0.1) == 1
    assert job_of(app, run["id"]) is None


def test_a_finished_run_counts_each_graph_task_once(apps, make_token):
    """Dask's agent sends a graph event for every task a
    submission touched, earlier submissions' too, and graph_count added them up: a
    ``client.submit(total, *futures)`` counted the futures twice (41 for 21 tasks)."""
    collector, query, app = apps
    token = make_token()
    st = store_of(app)

    def graph(key: str, deps: list[str]) -> dict[str, Any]:
        return {"kind": "graph", "key": key, "prefix": key.split("-")[0], "run": "r",
                "dependencies": deps}  # fmt: skip

    first = run_batch("c", "s", "r", 0, status=None)
    first["events"] += [graph(f"inc-{i}", []) for i in range(3)]
    second = run_batch("c", "s", "r", 1, n_tasks=0)
    second["events"] += [graph(f"inc-{i}", []) for i in range(3)]  # touched again
    second["events"].append(graph("total-0", [f"inc-{i}" for i in range(3)]))
    for body in (first, second):
        assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    finish.run_due(st.sessions, st.blobs, limit=1000)
    assert detail(query, token, run["id"])["graph_count"] == 4
    nodes = query.get(f"/v1/runs/{run['id']}/graph", headers=auth(token)).json["nodes"]
    keys = [n["key"] for n in nodes]
    assert len(keys) == len(set(keys)) and {"inc-0", "inc-1", "inc-2", "total-0"} <= set(keys)


ANSWERS = (
    "/v1/runs/{a}",
    "/v1/runs/{a}/summary",
    "/v1/runs/{b}/summary",
    "/v1/compare?a={a}&b={b}",
    "/v1/history/clusters?bucket=hour",
    "/v1/history/clusters?bucket=day",
    "/v1/history/prefixes?prefix=inc&bucket=day",
    "/v1/history/prefixes?prefix=inc&bucket=hour",
)


def test_folding_the_appended_rows_changes_no_answer(apps, make_token):
    collector, query, app = apps
    tenant = new_tenant()
    token = make_token(tenant)
    st = store_of(app)
    seqs = iter(range(100))
    for run, start in (("a", T0), ("b", T0 + 86_000)):  # b's tasks cross a day boundary
        for part in range(3):
            body = run_batch(
                "c",
                "s",
                run,
                part,
                n_tasks=40,
                t=start + 900 * part,
                status="finished" if part == 2 else None,
            )
            body["seq"] = next(seqs)
            assert post(collector, body, token=token).status_code == 202
    runs = {r["name"]: r["id"] for r in query.get("/v1/runs", headers=auth(token)).json["runs"]}
    urls = [u.format(a=runs["job-a"], b=runs["job-b"]) for u in ANSWERS]

    def answers() -> list[Any]:
        out = [query.get(u, headers=auth(token)) for u in urls]
        assert all(r.status_code == 200 for r in out), [
            (u, r.json) for u, r in zip(urls, out, strict=True)
        ]
        return [r.json for r in out]

    before = answers()
    assert appended_rows(app, tenant) > 0
    finish.drain(st.sessions, st.blobs)
    assert appended_rows(app, tenant) == 0
    after = answers()
    for url, b, a in zip(urls, before, after, strict=True):
        if url.startswith(f"/v1/runs/{runs['job-a']}") and "summary" not in url:
            a.pop("finished_work"), b.pop("finished_work")
        assert a == b, url


def test_concurrent_folds_count_every_row_once(apps, make_token, own_stack):
    if own_stack["database_url"].startswith("sqlite"):
        pytest.skip("SQLite has one writer at a time")
    collector, query, app = apps
    tenant = new_tenant()
    token = make_token(tenant)
    st = store_of(app)
    for seq in range(6):
        body = run_batch("c", "s", "r", seq, n_tasks=30, t=T0 + 600 * seq, status=None)
        assert post(collector, body, token=token).status_code == 202
    hist = "/v1/history/clusters?bucket=hour"
    want = query.get(hist, headers=auth(token)).json
    with st.sessions() as db:
        run_id, cluster_id = db.execute(
            select(m.Run.id, m.Run.cluster_id).join(m.Tenant).where(m.Tenant.name == tenant)
        ).one()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def fold() -> None:
        try:
            start.wait(timeout=30)
            with st.sessions.begin() as db:
                rollups.fold_cluster(db, cluster_id)
                rollups.fold_run(db, run_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=fold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert appended_rows(app, tenant) == 0
    assert query.get(hist, headers=auth(token)).json == want


def test_the_collector_does_the_work_by_itself(stack, make_token):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    config = {**stack, "finish_worker": True}
    collector, query = collector_app(config).test_client(), query_app(config).test_client()
    token = make_token()
    assert post(collector, run_batch("c", "s", "r", 0), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    deadline = time.monotonic() + 60
    while detail(query, token, run["id"])["finished_work"]["done_at"] is None:
        assert time.monotonic() < deadline, "the collector's finish worker did not run"
        time.sleep(0.05)


def test_the_collector_collapses_the_manifest_and_no_answer_changes(apps, make_token):
    """The finish worker packs an agent's manifest rows into a chunk once they are
    ``HINDSIGHT_MANIFEST_COLLAPSE_SECONDS`` old and their runs finished: the runs, their
    tasks from the blob store, completeness, comparisons and histories read the same."""
    import dataclasses
    import gc

    from collector.app import create_app as collector_app
    from tests.storage.core.test_manifest import manifest_rows

    collector, query, app = apps
    tenant = new_tenant()
    token = make_token(tenant)
    st = store_of(app)
    for run, start in (("a", T0), ("b", T0 + 3600)):
        for part in range(3):
            body = run_batch("c", "s", run, part, n_tasks=40, t=start + 900 * part,
                             status="finished" if part == 2 else None)  # fmt: skip
            body["agent"] = f"scheduler-{run}"
            assert post(collector, body, token=token).status_code == 202
    finish.drain(st.sessions, st.blobs)
    runs = {r["name"]: r["id"] for r in query.get("/v1/runs", headers=auth(token)).json["runs"]}
    urls = [
        u.format(a=runs["job-a"], b=runs["job-b"])
        for u in (*ANSWERS, "/v1/runs/{a}/tasks", "/v1/runs/{b}/tasks", "/v1/runs/{b}")
    ]
    before = [query.get(u, headers=auth(token)).json for u in urls]

    def rows() -> int:
        return manifest_rows(st.sessions, tenant)

    assert rows() == 6
    worker = collector_app(
        settings=dataclasses.replace(
            st.settings, finish_worker=True, manifest_collapse_seconds=0.5, ray_sweeper=False
        )
    )
    deadline = time.monotonic() + 60
    # SQLite keeps the table's newest row (its ids are never handed out twice)
    while rows() > (1 if st.settings.database_url.startswith("sqlite") else 0):
        assert time.monotonic() < deadline, "the finish worker did not collapse the manifest"
        time.sleep(0.05)
    del worker
    gc.collect()
    after = [query.get(u, headers=auth(token)).json for u in urls]
    for url, b, a in zip(urls, before, after, strict=True):
        assert a == b, url
    assert before[urls.index(f"/v1/runs/{runs['job-a']}/tasks")]["tasks"]


def test_a_new_version_of_a_runs_copy_replaces_the_ones_it_supersedes(tmp_path):
    """Versions are ``{batches}-{highest batch id}``: one with fewer batches, or as many
    under other ids (a rebuilt index renumbers them), goes; one with more batches is a
    newer one another process wrote, and stays."""
    from storage.core.blobs import LocalBlobStore
    from storage.runs.runfile import prune_tags

    blobs = LocalBlobStore(str(tmp_path))
    base = "compact/v1/t/c/s/run"
    for tag in ("4-9", "5-10", "5-12", "6-20", "extras/5-10"):
        blobs.put(f"{base}/{tag}/tasks.parquet", b"x")
    assert prune_tags(blobs, base, "5-12") == 2
    assert sorted(blobs.list(f"{base}/")) == [
        f"{base}/5-12/tasks.parquet",
        f"{base}/6-20/tasks.parquet",
        f"{base}/extras/5-10/tasks.parquet",
    ]


def test_the_look_for_silent_runs_reads_only_the_running_ones(pg_url):
    """Every finish worker (a process each) looks once a minute for runs still running in
    silent sessions; without an index on the status that read the whole runs table (10^6
    rows a minute per process at 10^6 runs). Postgres's plan for the look, with scans of
    whole tables priced out, goes through the partial index of running runs."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.dialects import postgresql

    q = silent.silent_runs(1_800_000_000.0, 1000)
    sql = str(q.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SET enable_seqscan = off"))
            plan = "\n".join(r[0] for r in conn.execute(text("EXPLAIN " + sql)))
    finally:
        engine.dispose()
    assert "ix_runs_running" in plan, plan
