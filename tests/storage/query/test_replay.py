"""Replay samples in the index: ``state`` events give the same ``run_states`` rows in any
order and on retries, and replay at T reads the latest sample at or before T. Runs on
SQLite and Postgres."""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import select

from hindsight.schema import Batch, PrefixState, RunEvent, StateEvent, WorkerState
from storage.core import models as m
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.query.replay import state_at
from tests.conftest import new_tenant
from tests.storage.ingest.test_index import NOW, apply

TASKS = {"load": 40, "sum": 4}


def sample(t: float, done: int, run: str = "run-1") -> StateEvent:
    """The run ``done`` seconds in: ``done`` loads finished, one processing per worker."""
    busy = min(2, TASKS["load"] - done)
    return StateEvent(
        run=run,
        time=t,
        prefixes=[
            PrefixState(
                prefix="load", waiting=TASKS["load"] - done - busy, processing=busy, memory=done
            ),
            PrefixState(prefix="sum", waiting=TASKS["sum"]),
        ],  # fmt: skip
        workers=[
            WorkerState(
                worker=f"tcp://w{i}",
                managed=done * 1000 + i,
                limit=10**9,
                processing=1 if i < busy else 0,
            )
            for i in range(2)
        ],  # fmt: skip
    )


def batches() -> list[Batch]:
    events: list[Any] = [RunEvent(event="started", id="run-1", time=NOW, name="replayed")]
    events += [sample(NOW + s, s) for s in range(0, 21)]
    end = StateEvent(
        run="run-1",
        time=NOW + 30,
        prefixes=[PrefixState(prefix="load", released=40), PrefixState(prefix="sum", memory=4)],
        workers=[WorkerState(worker="tcp://w0", managed=32), WorkerState(worker="tcp://w1")],
    )
    events += [end, RunEvent(event="finished", id="run-1", time=NOW + 30)]
    return [
        Batch(schema=1, cluster="c", session="s", agent="scheduler", seq=i, events=events[i::4])
        for i in range(4)
    ]


def rows(sessions: Any, tenant: str) -> tuple[m.Run, list[tuple[Any, ...]]]:
    with sessions() as db:
        tid = db.execute(select(m.Tenant.id).where(m.Tenant.name == tenant)).scalar_one()
        run = db.execute(select(m.Run).where(m.Run.tenant_id == tid)).scalar_one()
        got = db.execute(
            select(m.RunState.time, m.RunState.prefixes, m.RunState.workers)
            .where(m.RunState.run_id == run.id)
            .order_by(m.RunState.time)
        ).all()
        db.expunge(run)
    return run, [tuple(r) for r in got]


def test_samples_do_not_depend_on_order_or_retries(index_url):
    engine = make_engine(index_url)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    t1, t2 = new_tenant(), new_tenant()
    apply(sessions, t1, batches())
    shuffled = batches()
    random.Random(5).shuffle(shuffled)
    apply(sessions, t2, shuffled + shuffled[:2])
    (_, a), (_, b) = rows(sessions, t1), rows(sessions, t2)
    engine.dispose()
    assert a == b and len(a) == 22
    assert a[3][1] == {"load": [35, 2, 3, 0, 0], "sum": [4, 0, 0, 0, 0]}


def test_state_at_reads_the_latest_sample_at_or_before_the_moment(index_url):
    engine = make_engine(index_url)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    tenant = new_tenant()
    apply(sessions, tenant, batches())
    run, _ = rows(sessions, tenant)
    with sessions() as db:
        for at, done in ((NOW + 5, 5), (NOW + 5.99, 5), (NOW + 20.5, 20), (NOW + 29.9, 20)):
            got = state_at(db, run, at)
            assert got["time"] == at and got["sampled_at"] == NOW + done
            load = {p["prefix"]: p for p in got["prefixes"]}["load"]
            assert load["memory"] == done and load["processing"] == 2
            assert [w["memory"]["managed"] for w in got["workers"]] == [
                done * 1000,
                done * 1000 + 1,
            ]
            assert [w["processing"] for w in got["workers"]] == [1, 1]
        for at in (NOW + 30, NOW + 3600):  # from the run's end on: its last sample
            got = state_at(db, run, at)
            assert got["sampled_at"] == NOW + 30
            assert all(p["waiting"] == p["processing"] == 0 for p in got["prefixes"])
        before = state_at(db, run, NOW - 1)  # before the first sample: all waiting
        assert before["sampled_at"] is None and before["workers"] == []
        assert {p["prefix"]: p["waiting"] for p in before["prefixes"]} == TASKS
        for at in (NOW - 1, NOW, NOW + 7.5, NOW + 30):
            total = sum(
                p[k] for p in state_at(db, run, at)["prefixes"]
                for k in ("waiting", "processing", "memory", "released", "erred")
            )  # fmt: skip
            assert total == sum(TASKS.values())
    engine.dispose()
