"""The batch manifest collapsed into chunks: every answer is the one its rows gave, a batch
already indexed is still indexed once, and one never indexed is still taken."""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import func, select

from storage.core import manifest
from storage.core import models as m
from storage.jobs import retention
from storage.runs import runfile
from tests.storage.ingest.test_index import NOW, apply, snapshot, synthetic_batches
from tests.storage.runs.test_packed import answers, pack_all, with_activity


def test_a_chunk_unpacks_to_its_rows():
    rng = random.Random(7)
    for _ in range(30):
        rows = []
        for seq in rng.sample(range(0, 10**6), rng.randrange(1, 60)):
            recv = 1.8e9 + rng.random() * 1e5
            t_min = rng.choice([None, recv - rng.random() * 100, rng.random() * 1e3])
            t_max = None if t_min is None else t_min + rng.choice([0.0, rng.random() * 50])
            key = rng.choice(["", f"legacy/{seq}"])
            rows.append(
                manifest._Row(
                    rng.randrange(1, 10**12),
                    seq,
                    key,
                    rng.randrange(10**5),
                    rng.randrange(10**7),
                    recv,
                    t_min,
                    t_max,
                )  # fmt: skip
            )
        chunk = manifest.pack(rows)

        class Chunk:
            agent_id = 9
            data = chunk["data"]
            id_lo, seq_lo, received_lo = chunk["id_lo"], chunk["seq_lo"], chunk["received_lo"]

        got = manifest.unpack(Chunk, ("t", "c", "s", "a"))
        by_seq = sorted(rows, key=lambda r: r.seq)
        assert [e[:1] + e[2:3] + e[4:] for e in got] == [  # every value exact
            (r.id, r.seq, r.events, r.bytes, r.received_at, r.t_min, r.t_max) for r in by_seq
        ]
        assert [e.key for e in got] == [r.blob_key or f"v1/t/c/s/a/{r.seq:012d}.json.zst"
                                        for r in by_seq]  # fmt: skip
        assert chunk["batches"] == len(rows) and chunk["bytes"] == sum(r.bytes for r in rows)
        # packed again as read (a collapse adding to a chunk): the same
        again = [manifest._Row(e.id, e.seq, e.key, e.events, e.bytes, e.received_at, e.t_min,
                               e.t_max) for e in manifest.unpack(Chunk)]  # fmt: skip
        assert manifest.pack(again) == chunk


def _state(sessions: Any, tenant: str) -> dict[str, Any]:
    """What readers of the manifest answer: runs and their batches, the session's batches
    around each run (the compacted copy's and profile's inputs), completeness, retention."""
    out = answers(sessions, tenant)
    with sessions() as db:
        out["detail"] = snapshot(db, tenant)
        tid = db.execute(select(m.Tenant.id).where(m.Tenant.name == tenant)).scalar_one()
        for run in db.scalars(select(m.Run).where(m.Run.tenant_id == tid).order_by(m.Run.run_key)):
            for slack in (0.0, 30.0):
                keys = runfile.session_batches_around(db, run, slack)
                out[f"around {run.run_key} {slack}"] = sorted(k.split("/", 2)[2] for _, k in keys)
            out[f"files {run.run_key}"] = sorted(
                (k.split("/", 2)[2], mine) for _, k, mine in runfile.batch_keys(db, run)
            )
        gone = retention.plan(db, tenant, max_runs=0)
        out["retention"] = [(s.name, s.runs, s.batches, s.bytes) for s in gone.sessions]
        kept = retention.plan(db, tenant, max_age=3600.0, now=NOW + 1800)
        out["cutoffs"] = sorted(kept.cutoffs.values())  # the kept sessions' first events
    return out


def _cached(sessions: Any, tenant: str, batches: list[Any]) -> list[bool]:
    """``apply`` as a collector does it: through ids cached by a first batch of each
    agent (ingest's guarded insert)."""
    from storage.core.idcache import IdCache

    return apply(sessions, tenant, batches, cache=IdCache())


def manifest_rows(sessions: Any, tenant: str) -> int:
    """The tenant's manifest rows."""
    with sessions() as db:
        return db.execute(
            select(func.count(m.Batch.id))
            .join(m.Agent)
            .join(m.Session)
            .join(m.Cluster)
            .join(m.Tenant)
            .where(m.Tenant.name == tenant)
        ).scalar_one()


def test_a_collapsed_manifest_changes_no_answer_and_takes_each_batch_once(sessions):
    from tests.conftest import new_tenant

    sent = with_activity(synthetic_batches(seed=9))
    held = [b for b in sent if b.agent == "worker-a" and b.seq == 2]  # in a spool meanwhile
    tenant = new_tenant()
    assert all(apply(sessions, tenant, [b for b in sent if b not in held]))
    pack_all(sessions, tenant)
    want = _state(sessions, tenant)
    assert want["retention"] and all(want[k] for k in want if k.startswith("around"))

    manifest.collapse_due(sessions, age=60.0, now=NOW + 30)  # too young (other tests' not)
    assert manifest_rows(sessions, tenant) == len(sent) - len(held)
    manifest.collapse_due(sessions, age=60.0, now=NOW + 61)
    # on SQLite the newest row of the table stays (its ids are never handed out twice)
    assert manifest_rows(sessions, tenant) == (
        1 if sessions.kw["bind"].dialect.name == "sqlite" else 0
    )
    assert _state(sessions, tenant) == want

    # every batch already taken is a duplicate still, in any order, in chunks or not
    again = [b for b in sent if b not in held]
    random.Random(3).shuffle(again)
    assert apply(sessions, tenant, again) == [False] * len(again)
    assert _cached(sessions, tenant, again + again) == [False] * 2 * len(again)
    assert _state(sessions, tenant) == want
    # the one never taken (a gap in the collapsed span) is taken, once
    assert apply(sessions, tenant, held) == [True]
    assert apply(sessions, tenant, held) == [False]
    pack_all(sessions, tenant)
    whole = new_tenant()
    apply(sessions, whole, sent)
    pack_all(sessions, whole)
    assert _state(sessions, tenant) == _state(sessions, whole)
    # collapsed again: the batch taken joins its agent's chunk
    manifest.collapse_due(sessions, age=60.0, now=NOW + 61)
    assert manifest_rows(sessions, tenant) == 0
    with sessions() as db:
        chunks = db.scalars(
            select(m.ManifestChunk.batches)
            .join(m.Agent)
            .join(m.Session)
            .join(m.Cluster)
            .join(m.Tenant)
            .where(m.Tenant.name == tenant)
        ).all()
    assert sorted(chunks) == [4, 4, 4]  # one chunk an agent, of its four batches
    assert _state(sessions, tenant) == _state(sessions, whole)
    assert apply(sessions, tenant, sent) == [False] * len(sent)


def test_collapses_racing_ingest_count_every_batch_once(pg_url):
    """Collapses run over and over while batches arrive, new ones and retries of ones
    already collapsed or being collapsed, through the collector's cached path: each batch
    is in the manifest once, the agent's counters count it once (Postgres: SQLite has one
    writer at a time)."""
    import threading

    from hindsight.schema import Batch
    from storage.core.db import make_engine, make_sessionmaker
    from tests.conftest import new_tenant

    engine = make_engine(pg_url)
    sessions = make_sessionmaker(engine)
    tenant = new_tenant()
    n = 240
    sent = [Batch(1, "c", "s", f"w-{a}", seq, []) for seq in range(n) for a in range(2)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def collapse() -> None:
        try:
            while not stop.is_set():
                manifest.collapse_due(sessions, age=60.0, now=NOW + 61)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=collapse) for _ in range(2)]
    for t in threads:
        t.start()
    rng = random.Random(5)
    try:
        for i in range(0, len(sent), 40):  # the next 40, then 40 retries of any before
            _cached(sessions, tenant, sent[i : i + 40])
            _cached(sessions, tenant, rng.sample(sent[: i + 40], 40))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    manifest.collapse_due(sessions, age=60.0, now=NOW + 61)
    with sessions() as db:
        agents = db.execute(
            select(m.Agent.id, m.Agent.name, m.Agent.batches)
            .join(m.Session)
            .join(m.Cluster)
            .join(m.Tenant)
            .where(m.Tenant.name == tenant)
        ).all()
        assert len(agents) == 2
        for agent_id, name, counted in agents:
            seqs = list(db.scalars(select(m.Batch.seq).where(m.Batch.agent_id == agent_id)))
            seqs += [e.seq for e in manifest.collapsed(db, m.ManifestChunk.agent_id == agent_id)]
            assert sorted(seqs) == list(range(n)), name
            assert counted == n, name
    engine.dispose()


def test_an_agent_numbering_its_batches_sparsely_keeps_its_rows(sessions):
    """Ray's derived batches are numbered by a hash of their body: a collapsed span over
    such numbers would hold every later one, each sent to the slow path. Dense agents are
    collapsed beside them."""
    from hindsight.schema import Batch
    from tests.conftest import new_tenant

    tenant = new_tenant()
    rng = random.Random(2)
    sparse = [Batch(1, "c", "s", "ray", rng.randrange(2**52), []) for _ in range(30)]
    dense = [Batch(1, "c", "s", "scheduler-1", seq, []) for seq in range(30)]
    assert all(apply(sessions, tenant, sparse + dense))
    manifest.collapse_due(sessions, age=60.0, now=NOW + 61)
    with sessions() as db:
        left = dict(
            db.execute(
                select(m.Agent.name, func.count(m.Batch.id))
                .join(m.Batch)
                .join(m.Session)
                .join(m.Cluster)
                .join(m.Tenant)
                .where(m.Tenant.name == tenant)
                .group_by(m.Agent.name)
            ).all()
        )
    assert left["ray"] == 30 and left.get("scheduler-1", 0) <= 1  # SQLite: the newest stays
    assert apply(sessions, tenant, sparse + dense) == [False] * 60
