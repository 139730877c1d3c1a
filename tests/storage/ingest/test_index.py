"""The index is a function of the set of stored batches: order, retries and rebuilds
do not change it. Runs on SQLite and Postgres."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy.orm import Session

from hindsight.schema import Batch, RunEvent, StartStop, TaskEvent, WorkerEvent
from storage.core.batches import blob_key
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import ensure_tenant
from storage.ingest.writer import index_batch
from storage.query import runs as queries
from storage.query.runs import RunFilters
from tests.conftest import new_tenant

NOW = 1_800_000_000.0


def synthetic_batches(seed: int = 0) -> list[Batch]:
    """Two runs over three agents, with run events, errors, workers and several batches each."""
    rng = random.Random(seed)
    batches = []
    for agent in ("scheduler-1", "worker-a", "worker-b"):
        for seq in range(4):
            events: list[Any] = []
            for i in range(25):
                run = "run-1" if (seq + i) % 3 else "run-2"
                start = NOW + rng.random() * 100
                events.append(
                    TaskEvent(
                        key=f"('inc-{seq}', {i}, '{agent}')",
                        prefix=rng.choice(["inc", "add", "sum-aggregate"]),
                        status="erred" if i == 7 else "memory",
                        run=run,
                        worker=agent,
                        thread=1,
                        nbytes=rng.randrange(1000),
                        startstops=[
                            StartStop("transfer", start - 0.5, start - 0.1, source="w"),
                            StartStop("compute", start, start + rng.random()),
                        ],
                    )
                )
            if agent == "scheduler-1" and seq == 0:
                events.append(RunEvent("started", "run-1", NOW - 1, name="etl", span=["etl"]))
                events.append(WorkerEvent("joined", "tcp://w:1", NOW - 2, name="w1", nthreads=2))
            if agent == "scheduler-1" and seq == 3:
                events.append(RunEvent("finished", "run-1", NOW + 200))
                events.append(RunEvent("erred", "run-2", NOW + 150))
                events.append(WorkerEvent("left", "tcp://w:1", NOW + 300, reason="scale-down"))
            batches.append(
                Batch(1, "c1", "sess-1", agent, seq, events, dropped={"buffer_full": seq})
            )
    return batches


def apply(sessions: Any, tenant: str, batches: list[Batch], cache: Any = None) -> list[bool]:
    """Index ``batches``, each in a transaction; ``cache``: an ``IdCache``, as a collector
    passes (ingest's guarded insert, after each agent's first batch)."""
    done = []
    for b in batches:
        with sessions.begin() as db:
            tid = ensure_tenant(db, tenant, NOW)
            done.append(
                index_batch(
                    db,
                    tenant_id=tid,
                    tenant=tenant,
                    batch=b,
                    blob_key=blob_key(tenant, b),
                    size=100,
                    now=NOW,
                    cache=cache,
                )
            )
    return done


def snapshot(db: Session, tenant: str) -> dict[str, Any]:
    from sqlalchemy import select

    from storage.core import models as m

    tid = db.execute(select(m.Tenant.id).where(m.Tenant.name == tenant)).scalar_one()
    runs, _ = queries.list_runs(db, tid, RunFilters(), 100, None)
    out = {}
    for r in runs:
        run, cluster, session = queries.find_run(db, tid, r["id"])
        d = queries.run_detail(db, run, cluster, session)
        d.pop("id")  # public ids are per tenant; everything else must match
        for p in d["prefixes"]:
            for a in p["actions"].values():
                a["total"] = round(a["total"], 9)
        out[d["run_key"]] = d
    return out


def test_index_does_not_depend_on_order_or_retries(sessions):
    batches = synthetic_batches()
    t1, t2 = new_tenant(), new_tenant()
    assert all(apply(sessions, t1, batches))
    shuffled = batches[:]
    random.Random(1).shuffle(shuffled)
    assert all(apply(sessions, t2, shuffled))
    assert not any(apply(sessions, t2, shuffled[:5]))  # retries change nothing
    with sessions() as db:
        a, b = snapshot(db, t1), snapshot(db, t2)
    assert a == b
    run1 = a["run-1"]
    assert run1["name"] == "etl" and run1["status"] == "finished"
    assert a["run-2"]["status"] == "erred"
    assert run1["task_count"] + a["run-2"]["task_count"] == 12 * 25
    assert run1["completeness"]["batches_received"] == 12
    assert run1["completeness"]["ratio"] == 1.0
    # cumulative drop counters: the highest sequence number's report wins
    assert run1["completeness"]["events_dropped_at_agents"] == 3 * 3


def test_a_run_takes_one_id_however_many_batches_it_has(sessions, index_url):
    """Run ids grow with runs, not batches: the per-run tables are partitioned by ranges
    of them (decision 0038), sized in runs."""
    if not index_url.startswith("postgresql"):
        pytest.skip("SQLite hands out the highest id + 1: no sequence to spend")
    from sqlalchemy import text

    def taken() -> int:
        with sessions() as db:
            # the ids handed out: a fresh sequence's last_value is its first, not yet taken
            sql = "SELECT last_value - (NOT is_called)::int FROM runs_id_seq"
            return db.execute(text(sql)).scalar_one()

    before = taken()
    batches = synthetic_batches(seed=3)
    assert all(apply(sessions, new_tenant(), batches))
    assert taken() - before == 2  # two runs, each in all 12 batches


def test_rollups_match_the_task_records(sessions):
    batches = synthetic_batches(seed=5)
    tenant = new_tenant()
    apply(sessions, tenant, batches)
    tasks = [e for b in batches for e in b.events if isinstance(e, TaskEvent) and e.run == "run-1"]
    with sessions() as db:
        run1 = snapshot(db, tenant)["run-1"]
    assert run1["task_count"] == len(tasks)
    assert run1["error_count"] == sum(t.status == "erred" for t in tasks)
    assert run1["nbytes"] == sum(t.nbytes for t in tasks)
    by_prefix = {p["prefix"]: p for p in run1["prefixes"]}
    for prefix in {t.prefix for t in tasks}:
        mine = [t for t in tasks if t.prefix == prefix]
        durations = [
            ss.stop - ss.start for t in mine for ss in t.startstops if ss.action == "compute"
        ]
        compute = by_prefix[prefix]["actions"]["compute"]
        assert by_prefix[prefix]["count"] == len(mine)
        assert compute["count"] == len(durations)
        assert compute["total"] == pytest.approx(sum(durations))
        assert compute["min"] == pytest.approx(min(durations))
        assert compute["max"] == pytest.approx(max(durations))
    starts = [ss.start for t in tasks for ss in t.startstops]
    stops = [ss.stop for t in tasks for ss in t.startstops]
    assert run1["makespan"] == pytest.approx(max(stops) - min(starts))


def test_completeness_reports_gaps(sessions):
    batches = [b for b in synthetic_batches() if not (b.agent == "worker-a" and b.seq == 1)]
    tenant = new_tenant()
    apply(sessions, tenant, batches)
    with sessions() as db:
        c = snapshot(db, tenant)["run-1"]["completeness"]
    assert (c["batches_received"], c["batches_expected"]) == (11, 12)
    (wa,) = [a for a in c["agents"] if a["agent"] == "worker-a"]
    assert wa["missing"] == 1 and not wa["final"]


def test_completeness_lists_workers_that_left_with_no_batch_of_their_own(sessions):
    """A worker whose agent never got a batch through (killed
    first, or closed while the collector was away: its batches wait in a spool) was not in
    completeness at all, which read ratio 1.0, closed. Its address is listed now, and the
    run is not closed; a worker still in the cluster (it may not have sent yet) is not."""
    tenant = new_tenant()

    def batch(agent: str, seq: int, events: list[Any], final: bool = True) -> Batch:
        return Batch(1, "c1", "Scheduler-1", agent, seq, events, final=final)

    scheduler = [
        RunEvent("started", "run-1", NOW, name="etl", span=["etl"]),
        *(WorkerEvent("joined", f"tcp://w:{n}", NOW, name=str(n)) for n in range(3)),
        WorkerEvent("left", "tcp://w:0", NOW + 5, reason="worker-close"),
        WorkerEvent("left", "tcp://w:1", NOW + 5, reason="handle-worker-cleanup"),
        RunEvent("finished", "run-1", NOW + 4),
    ]
    apply(sessions, tenant, [batch("scheduler-0123456789ab", 0, scheduler),
                             batch("worker-0-0123456789ab", 0, [])])  # fmt: skip
    with sessions() as db:
        c = snapshot(db, tenant)["run-1"]["completeness"]
    assert c["workers_without_batches"] == ["tcp://w:1"]  # w:2 is still there
    assert c["ratio"] == 1.0 and not c["closed"]
    apply(sessions, tenant, [batch("worker-1-ba9876543210", 0, [])])  # its spool, delivered
    with sessions() as db:
        c = snapshot(db, tenant)["run-1"]["completeness"]
    assert c["workers_without_batches"] == [] and c["closed"]


def test_cached_ids_from_a_rebuilt_index_never_misattribute_a_batch(index_url, tmp_path):
    """A collector keeps ids in memory; if the index is dropped and rebuilt under it, the
    same numeric ids now name other rows. The guarded insert must notice."""
    from sqlalchemy import select

    from storage.core import models as m
    from storage.core.idcache import IdCache

    cache = IdCache()
    first = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(first)
    mine, other = new_tenant(), new_tenant()
    b0, b1 = synthetic_batches()[:2]  # scheduler-1, seq 0 and 1
    with make_sessionmaker(first).begin() as db:
        tid = ensure_tenant(db, mine, NOW)
        assert index_batch(
            db, tenant_id=tid, tenant=mine, batch=b0, blob_key="k0", size=1, now=NOW, cache=cache
        )
    first.dispose()

    engine = make_engine(index_url)  # the "rebuilt" index: another tenant's rows get the low ids
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    apply(sessions, other, [b0])
    with sessions.begin() as db:
        tid = ensure_tenant(db, mine, NOW)
        assert index_batch(
            db, tenant_id=tid, tenant=mine, batch=b1, blob_key="k1", size=1, now=NOW, cache=cache
        )
    with sessions() as db:
        owners = db.execute(
            select(m.Tenant.name, m.Batch.seq)
            .join(m.Agent, m.Agent.id == m.Batch.agent_id)
            .join(m.Session, m.Session.id == m.Agent.session_id)
            .join(m.Cluster, m.Cluster.id == m.Session.cluster_id)
            .join(m.Tenant, m.Tenant.id == m.Cluster.tenant_id)
            .where(m.Tenant.name.in_([mine, other]))
            .order_by(m.Tenant.name)
        ).all()
    assert sorted(owners) == sorted([(other, 0), (mine, 1)])
    engine.dispose()


HOSTILE = ["it's", "back\\slash", "%(run_id)s", "100%% %s", ";DROP TABLE runs;--", "é ü 日本 🙂"]


def test_every_indexed_string_comes_back_as_sent(sessions):
    """Strings reach the index as they were sent, whatever they hold (on Postgres the writer
    renders its statements client-side: quotes, backslashes, placeholders and semicolons
    must stay data)."""
    for i, text in enumerate(HOSTILE):
        events: list[Any] = [
            RunEvent("started", f"r{i}", NOW, name=f"job {text}", span=[text]),
            TaskEvent(
                key=f"k {text}",
                prefix=f"p {text}",
                status="memory",
                run=f"r{i}",
                worker=f"w {text}",
                startstops=[StartStop(f"a {text}", NOW, NOW + 1)],
            ),  # fmt: skip
            WorkerEvent("left", f"tcp://{text}", NOW + 2, reason=f"why {text}"),
            RunEvent("finished", f"r{i}", NOW + 3),
        ]
        batch = Batch(1, "c1", "sess-1", "agent", i, events, dropped={f"d {text}": 1})
        assert apply(sessions, "hostile", [batch]) == [True]
    with sessions() as db:
        runs = snapshot(db, "hostile")
    assert len(runs) == len(HOSTILE)
    for i, text in enumerate(HOSTILE):
        d = runs[f"r{i}"]
        assert d["name"] == f"job {text}"
        assert [p["prefix"] for p in d["prefixes"]] == [f"p {text}"]
        assert list(d["prefixes"][0]["actions"]) == [f"a {text}"]
        assert [w["worker"] for w in d["workers"]] == [f"w {text}"]
