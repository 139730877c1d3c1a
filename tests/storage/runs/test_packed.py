"""A finished run's histograms and fine metrics packed into catalog rows: every answer is
the one the unpacked rows gave, whenever the packing happens and whatever arrives after."""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import func, select

from hindsight.schema import ActivityEvent, ActivityMetric, Batch
from storage.core import models as m
from storage.runs import packed
from tests.storage.ingest.test_index import NOW, apply, synthetic_batches


def test_a_histogram_packs_and_unpacks_to_itself():
    rng = random.Random(3)
    for _ in range(50):
        h = {rng.randrange(-400, 400): rng.randrange(1, 10**9) for _ in range(rng.randrange(30))}
        assert packed.unpack_hist(packed.pack_hist(h)) == h
    assert packed.unpack_hist(packed.pack_hist({})) == {}
    assert packed.unpack_hist(packed.pack_hist({3: 0, 4: 2})) == {4: 2}
    # neighbouring buckets with small counts: two bytes a bucket, plus msgpack's header
    assert len(packed.pack_hist({b: 5 for b in range(100, 130)})) <= 2 * 30 + 3


def with_activity(batches: list[Batch]) -> list[Batch]:
    """The synthetic runs, plus the scheduler's fine-metric samples of both runs."""
    out = []
    for b in batches:
        if b.agent == "scheduler-1":
            t = NOW + 10 * b.seq
            metrics = [
                ActivityMetric("execute", "inc", "thread-cpu", "seconds", 1.0 + b.seq),
                ActivityMetric("execute", "add", "thread-noncpu", "seconds", 0.5 * b.seq),
                ActivityMetric("gather-dep", "", "network", "seconds", 10.0 - b.seq),
                ActivityMetric("execute", "inc", "disk-write", "bytes", 100.0 * b.seq),
            ]
            extra = [ActivityEvent(run=r, time=t, metrics=metrics) for r in ("run-1", "run-2")]
            b = Batch(b.schema, b.cluster, b.session, b.agent, b.seq, [*b.events, *extra],
                      dropped=b.dropped)  # fmt: skip
        out.append(b)
    return out


def answers(sessions: Any, tenant: str) -> dict[str, Any]:
    from storage.query.activity import history as activity_history
    from storage.query.activity import run_activity
    from storage.query.breakdown import time_breakdown
    from storage.query.explain import _activity, _prefix_facts
    from storage.query.history import prefix_history
    from storage.query.summary import merged_hists

    with sessions() as db:
        tid = db.execute(select(m.Tenant.id).where(m.Tenant.name == tenant)).scalar_one()
        runs = dict(db.execute(select(m.Run.run_key, m.Run.id).where(m.Run.tenant_id == tid)).all())
        ids = sorted(runs.values())
        key = {v: k for k, v in runs.items()}

        def rounded(x: Any) -> Any:
            if isinstance(x, float):
                return round(x, 9)
            if isinstance(x, dict):
                return {k: rounded(v) for k, v in x.items()}
            if isinstance(x, list):
                return [rounded(v) for v in x]
            return x

        return rounded(
            {
                "activity": {k: run_activity(db, r) for k, r in sorted(runs.items())},
                "hists": {k: sorted(merged_hists(db, [r]).items()) for k, r in runs.items()},
                "explain": {key[r]: v for r, v in _activity(db, ids).items()},
                "batches": {k: batches_of(db, r) for k, r in sorted(runs.items())},
                "tags": {k: packed.batch_tag(db, r)[0] for k, r in sorted(runs.items())},
                "facts": {key[r]: v for r, v in _prefix_facts(db, ids).items()},
                "activity_history": [
                    activity_history(db, tid, bucket="hour", prefix=p, unit=u)
                    for p in (None, "inc")
                    for u in ("seconds", "bytes")
                ],
                "workers": {k: _workers(db, r) for k, r in sorted(runs.items())},
                "breakdown": time_breakdown(db, ids),
                "prefix_history": [  # by hour from the runs' rows, by day from prefix_days
                    prefix_history(db, tid, p, "compute", bucket, None, None)
                    for p in ("inc", "add", "sum-aggregate")
                    for bucket in ("hour", "day")
                ],
            }
        )


def _workers(db: Any, run_id: int) -> list[dict[str, Any]]:
    """The run page's workers (``GET /v1/runs/{id}``'s ``workers``)."""
    from storage.query.runs import run_detail

    return run_detail(db, db.get(m.Run, run_id), "cluster", "session")["workers"]


def batches_of(db: Any, run_id: int) -> list[tuple[str, int]]:
    """The run's batches as (blob key without its tenant, tasks of the run), by key."""
    tasks = dict(packed.run_batches(db, run_id))
    keys = packed.batch_keys(db, db.get(m.Run, run_id).session_id, list(tasks))
    assert [b for b, _ in keys] == sorted(tasks)
    return sorted((k.split("/", 2)[2], tasks[b]) for b, k in keys)


def rows_left(sessions: Any, tenant: str) -> int:
    with sessions() as db:
        runs = select(m.Run.id).join(m.Tenant).where(m.Tenant.name == tenant)
        return sum(
            db.execute(select(func.count()).select_from(t).where(t.run_id.in_(runs))).scalar_one()
            for t in (m.RunActivity, m.RunPrefixHist, m.RunBatch, m.RunWorker)
        )


def pack_all(sessions: Any, tenant: str) -> int:
    with sessions.begin() as db:
        runs = db.execute(select(m.Run.id).join(m.Tenant).where(m.Tenant.name == tenant))
        return sum(packed.pack_run(db, r) for r in runs.scalars().all())


def test_packing_changes_no_answer_and_late_batches_count_once(sessions):
    from tests.conftest import new_tenant

    sent = with_activity(synthetic_batches(seed=5))
    order = sent[:]
    random.Random(11).shuffle(order)
    plain, packs = new_tenant(), new_tenant()
    apply(sessions, plain, sent)
    want = answers(sessions, plain)
    assert want["activity"]["run-1"]["activity"] and want["hists"]["run-1"]
    assert want["explain"]["run-1"] == {"thread-cpu": 4.0, "thread-noncpu": 1.5}

    # packed halfway, then the rest arrives (late batches, out of order, some again)
    apply(sessions, packs, order[:7])
    assert pack_all(sessions, packs) > 0
    apply(sessions, packs, order[7:])
    assert apply(sessions, packs, order[:3]) == [False] * 3  # retries change nothing
    assert rows_left(sessions, packs) > 0
    assert answers(sessions, packs) == want  # packed values and rows, read together
    assert pack_all(sessions, packs) > 0
    assert rows_left(sessions, packs) == 0
    assert answers(sessions, packs) == want
    assert pack_all(sessions, packs) == 0  # a second pack has nothing to do
    assert answers(sessions, packs) == want
    with sessions() as db:
        runs = select(m.Run.id).join(m.Tenant).where(m.Tenant.name == packs)
        n = db.execute(select(func.count()).where(m.RunMetrics.run_id.in_(runs))).scalar_one()
    assert n == 2  # one row a run
    assert want["workers"]["run-1"] and want["breakdown"]["workers"]
    assert sum(len(v) for v in want["batches"].values()) == 12 + 12  # each batch has both runs
    assert sum(t for v in want["batches"].values() for _, t in v) == 12 * 25


def test_a_worker_list_packs_and_unpacks_to_itself():
    rng = random.Random(5)
    for _ in range(20):
        workers = [
            packed.WorkerSeconds(
                f"tcp://10.0.0.{i}:{rng.randrange(1, 65536)}",
                rng.randrange(10**6),
                rng.randrange(10),
                *(rng.choice([0.0, rng.random() * 100]) for _ in range(5)),
                *rng.choice([(None, None), (1.8e9 + rng.random(), 1.8e9 + 10 + rng.random())]),
            )
            for i in range(rng.randrange(6))
        ]
        want = sorted(workers, key=lambda w: w.worker)
        assert packed.unpack_worker_list(packed.pack_worker_list(workers)) == want


def test_a_batch_list_packs_and_unpacks_to_itself():
    rng = random.Random(4)
    for _ in range(50):
        ids = sorted(rng.sample(range(1, 10**12), rng.randrange(40)))
        pairs = [(b, rng.randrange(0, 10**6)) for b in ids]
        assert packed.unpack_batch_list(packed.pack_batch_list(pairs)) == pairs
