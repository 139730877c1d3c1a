"""Fine performance metrics and submitting code in the index: any batch order and any
retry give the same rows (the latest sample of each metric wins, code is stored once)."""

from __future__ import annotations

import random
from typing import Any

from hindsight.schema import (
    ActivityEvent,
    ActivityMetric,
    Batch,
    CodeEvent,
    CodeFrame,
    RunEvent,
)
from tests.storage.ingest.test_index import NOW, apply


def batches() -> list[Batch]:
    """A scheduler's activity samples of one run: cumulative seconds that grow, one value
    that falls ('idle or other spans', as Dask computes it), sent only when changed."""
    out = []
    for seq in range(6):
        t = NOW + seq
        metrics = [
            ActivityMetric("execute", "inc", "thread-cpu", "seconds", 1.0 + seq),
            ActivityMetric("execute", "N/A", "idle or other spans", "seconds", 10.0 - seq),
        ]
        if seq % 2 == 0:
            metrics.append(ActivityMetric("execute", "inc", "disk-write", "bytes", 100.0 * seq))
        events: list[Any] = [ActivityEvent(run="r", time=t, metrics=metrics)]
        if seq == 0:
            events.insert(0, RunEvent("started", "r", NOW - 1, name="job", span=["job"]))
        if seq in (1, 4):  # the same submission sent twice (an agent restarted)
            events.append(CodeEvent(run="r", time=t, frames=[CodeFrame(code="x.compute()\n")]))
        if seq == 2:
            events.append(
                CodeEvent(run="r", time=t, frames=[CodeFrame(code="y.persist()\n", lineno_frame=3)])
            )
        out.append(Batch(schema=1, cluster="c", session="s", agent="scheduler-1", seq=seq,
                         events=events))  # fmt: skip
    return out


def snapshot(sessions: Any, tenant: str) -> dict[str, Any]:
    from sqlalchemy import select

    from storage.core import models as m
    from storage.query.activity import run_activity
    from storage.runs.runcode import run_code

    with sessions() as db:
        tid = db.execute(select(m.Tenant.id).where(m.Tenant.name == tenant)).scalar_one()
        (run_id,) = db.execute(select(m.Run.id).where(m.Run.tenant_id == tid)).one()
        return {"activity": run_activity(db, run_id), "code": run_code(db, run_id)}


def test_activity_and_code_do_not_depend_on_order_or_retries(index_url):
    from storage.core.db import make_engine, make_sessionmaker, upgrade
    from tests.conftest import new_tenant

    engine = make_engine(index_url)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    sent = batches()
    t1, t2 = new_tenant(), new_tenant()
    apply(sessions, t1, sent)
    shuffled = sent[:]
    random.Random(5).shuffle(shuffled)
    apply(sessions, t2, shuffled)
    assert apply(sessions, t2, shuffled[:3]) == [False] * 3  # retries change nothing
    a, b = snapshot(sessions, t1), snapshot(sessions, t2)
    engine.dispose()
    assert a == b
    values = {(r["activity"], r["unit"]): r["value"] for r in a["activity"]["activity"]}
    # the latest sample of each, including the one that fell
    assert values == {
        ("thread-cpu", "seconds"): 6.0,
        ("idle or other spans", "seconds"): 5.0,
        ("disk-write", "bytes"): 400.0,
    }
    assert a["activity"]["as_of"] == NOW + 5
    assert [c["frames"][0]["code"] for c in a["code"]] == ["x.compute()\n", "y.persist()\n"]
    assert a["code"][0]["time"] == NOW + 1  # the first time it was sent
