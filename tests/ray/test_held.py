"""Task patches a collector holds (storage.ray.hold.TaskHold) and what happens when it cannot
merge them: it dies, its index connection fails, retention removes the session, a value
is refused, the index is rebuilt. In every case users see what merging each body at once
gives."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DataError, OperationalError

from storage.core.db import make_engine, make_sessionmaker
from storage.core.tokens import create_token
from storage.ray import bodies as ray_bodies
from storage.ray import hold as ray_hold
from storage.ray import reindex as ray_reindex
from storage.ray import sweep as ray_sweep
from tests.conftest import new_tenant
from tests.ray.test_ingest import IDLE, SETTLE, Ray, bodies, ray_job, workload


def _split(events):
    """Body A: everything but the owners' end events and the jobs' ends (definition +
    RUNNING); body B: the ends (Ray's aggregator sends a task's end in a later body)."""
    a, b = [], []
    for e in events:
        tl = e.get("taskLifecycleEvent")
        jl = e.get("driverJobLifecycleEvent")
        ends = tl and any(s["state"] in ("FINISHED", "FAILED") for s in tl["stateTransitions"])
        jend = jl and any(s["state"] == "FINISHED" for s in jl["stateTransitions"])
        (b if ends or jend else a).append(e)
    return a, b


def _stack(db_url: str, blob_url: str, s3_endpoint: str | None = None) -> dict[str, Any]:
    return {
        "database_url": db_url,
        "blob_url": blob_url,
        "s3_endpoint_url": s3_endpoint,
        "auth": "required",
        "access_log": False,
        "finish_worker": False,
        "ray_settle_seconds": SETTLE,
        "ray_idle_close_seconds": IDLE,
    }


def _dies(app: Any) -> None:
    """The collector process dies: what it held in memory is gone (its sweeper was
    stopped before it took any)."""
    sw = app.extensions["hindsight.ray_sweeper"]
    sw.hold = ray_hold.TaskHold(age=sw.hold.age)


def _count(engine: Any, tenant: str, table: str, where: str = "true") -> int:
    """Rows of a session-keyed table (ray_tasks, ray_bodies) of ``tenant`` matching ``where``."""
    with engine.connect() as c:
        return c.execute(
            text(
                f"SELECT count(*) FROM {table} x JOIN sessions s ON s.id = x.session_id"
                " JOIN clusters c ON c.id = s.cluster_id JOIN tenants n ON n.id = c.tenant_id"
                f" WHERE n.name = :t AND {where}"
            ),
            {"t": tenant},
        ).scalar_one()


def _tokens(engine: Any, *tenants: str) -> list[str]:
    """A ray,read token for each tenant."""
    with make_sessionmaker(engine).begin() as db:
        return [create_token(db, t, "ray,read") for t in tenants]


def _sid(engine: Any, tenant: str) -> int:
    with engine.connect() as c:
        return c.execute(
            text(
                "SELECT s.id FROM sessions s JOIN clusters c ON c.id = s.cluster_id"
                " JOIN tenants t ON t.id = c.tenant_id WHERE t.name = :t"
            ),
            {"t": tenant},
        ).scalar_one()


def _held_app(pg_url: str, tmp_path: Any) -> tuple[Any, Any]:
    from services.embedded import create_app

    app = create_app({**_stack(pg_url, (tmp_path / "blobs").as_uri()), "ray_sweeper": True})
    sw = app.extensions["hindsight.ray_sweeper"]
    sw.stop()  # the hold is driven by hand
    return app, sw


@pytest.mark.postgres
def test_a_job_waits_for_the_ends_a_dead_collector_held(pg_url, s3_url, moto_endpoint):
    """A collector merged the tasks' definitions and RUNNING, another died holding the
    acknowledged body with their ends. The survivor's sweeper does not close the job at
    the settle time (it closed it and wrote the tasks as failed with the job, for good,
    before recovery merged their ends); recovery merges the ends, then the job closes."""
    from services.embedded import create_app

    stack = _stack(pg_url, s3_url, moto_endpoint)
    engine = make_engine(pg_url)
    tok_inline, tok_held = _tokens(engine, new_tenant(), new_tenant())
    _, _, events = workload(seed=11)
    a, b = _split(events)

    inline = Ray(create_app({**stack, "ray_sweeper": False}), tok_inline)
    inline.post_all(bodies(a, 10_000) + bodies(b, 10_000))
    inline.sweep(after=SETTLE + 1)
    ray_sweep.emit_ready(inline.store.sessions, inline.store.blobs)

    # P1 merged body A (no hold needed to show it: its patches went in).
    p1 = Ray(create_app({**stack, "ray_sweeper": False}), tok_held)
    p1.post_all(bodies(a, 10_000))
    # P2 holds body B's patches and dies (its sweeper stopped: nothing flushes).
    app2 = create_app({**stack, "ray_sweeper": True})
    sw = app2.extensions["hindsight.ray_sweeper"]
    assert sw.hold is not None
    sw.stop()
    p2 = Ray(app2, tok_held)
    p2.post_all(bodies(b, 10_000))
    assert len(sw.hold) > 0  # held, acknowledged
    _dies(app2)

    # The survivor's sweeper: passes at +6 s (job settles) and at +11 s (recovery).
    st = p1.store
    now = time.time()
    assert ray_hold.recover_held(st.sessions, st.blobs, now=now + SETTLE + 1).batches == 0
    ray_sweep.run_due(st.sessions, st.blobs, settle=SETTLE, idle=IDLE, now=now + SETTLE + 1)
    ray_sweep.emit_ready(st.sessions, st.blobs)
    got = ray_hold.recover_held(st.sessions, st.blobs, now=now + ray_hold.RECOVER_AFTER + 1)
    assert got.batches == 1
    ray_sweep.run_due(st.sessions, st.blobs, settle=SETTLE, idle=IDLE, now=now + 60)
    ray_sweep.emit_ready(st.sessions, st.blobs)

    want, have = inline.view(), p1.view()
    engine.dispose()
    assert have["runs"][ray_job(1)]["tasks"] == want["runs"][ray_job(1)]["tasks"]


@pytest.mark.postgres
def test_a_flush_after_retention_removed_the_session_writes_nothing(pg_url, s3_url, moto_endpoint):
    """Retention removes a session while a collector holds patches of its bodies: the
    flush then merges nothing into ray_tasks / ray_ready (no foreign key there): rows of a
    session that does not exist would fail the sweeper forever."""
    from services.embedded import create_app
    from storage.jobs import retention

    stack = _stack(pg_url, s3_url, moto_endpoint)
    engine = make_engine(pg_url)
    tenant = new_tenant()
    (tok,) = _tokens(engine, tenant)
    app = create_app({**stack, "ray_sweeper": True})
    sw = app.extensions["hindsight.ray_sweeper"]
    sw.stop()  # we drive the hold by hand
    r = Ray(app, tok)
    _, _, events = workload(seed=12)
    r.post_all(bodies(events, 10_000))
    assert len(sw.hold)
    st = r.store
    sid = _sid(engine, tenant)
    plan = retention.apply(st.blobs, st.sessions, tenant, max_age=0, now=time.time() + 3600)
    assert [s.id for s in plan.sessions] == [sid]
    n = sw.hold.flush(st.sessions, st.blobs, force=True)
    assert n > 0
    with engine.connect() as c:
        orphans = c.execute(
            text("SELECT count(*) FROM ray_tasks WHERE session_id=:s"), {"s": sid}
        ).scalar()
        ready = c.execute(
            text("SELECT count(*) FROM ray_ready WHERE session_id=:s"), {"s": sid}
        ).scalar()
        exists = c.execute(text("SELECT count(*) FROM sessions WHERE id=:s"), {"s": sid}).scalar()
    engine.dispose()
    assert exists == 0 and orphans == 0 and ready == 0


@pytest.mark.postgres
def test_a_refused_value_in_one_body_keeps_another_bodys_fields_of_the_task(
    pg_url, s3_url, moto_endpoint, tmp_path
):
    """Held patches are folded per task; when Postgres refuses a folded patch (one body's
    value it cannot hold), the task's definition and RUNNING from another, good, body are
    kept: the bodies are merged again one by one from their blobs, as for a collector that
    died holding them (the task was left out whole before)."""
    from services.embedded import create_app
    from storage.core.db import upgrade
    from tests.storage.jobs.test_reindex import fresh_index

    url = fresh_index({"database_url": pg_url}, tmp_path)
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE ray_tasks ALTER COLUMN error_type TYPE varchar(12)"))
    t_live, t_dead = new_tenant(), new_tenant()
    tok_live, tok_dead = _tokens(engine, t_live, t_dead)
    stack = {**_stack(url, s3_url, moto_endpoint), "ray_sweeper": True}
    _, _, events = workload(seed=13)
    a, b = _split(events)
    apps = [create_app(stack), create_app(stack)]
    for ap in apps:
        ap.extensions["hindsight.ray_sweeper"].stop()
    live, dead = Ray(apps[0], tok_live), Ray(apps[1], tok_dead)
    live.post_all(bodies(a, 10_000) + bodies(b, 10_000))
    dead.post_all(bodies(a, 10_000) + bodies(b, 10_000))
    _dies(apps[1])
    hold = apps[0].extensions["hindsight.ray_sweeper"].hold
    hold.flush(live.store.sessions, live.store.blobs, force=True)  # the live collector's flush
    st = dead.store  # the dead one's bodies (and the refused flush's): from their blobs
    ray_hold.recover_held(st.sessions, st.blobs, now=time.time() + ray_hold.RECOVER_AFTER + 1)
    started = "x.defined AND x.running_at IS NOT NULL"
    n_live, n_dead = (_count(engine, t, "ray_tasks", started) for t in (t_live, t_dead))
    engine.dispose()
    for ap in apps:
        ap.extensions["hindsight"].engine.dispose()
    assert n_live == n_dead == 63


@pytest.mark.postgres
def test_reindex_merges_the_bodies_a_dead_collector_held(pg_url, s3_url, moto_endpoint):
    """A body a dead collector held (tasks_merged false) is merged by `hindsight reindex`
    too, not only by a collector's sweeper: with HINDSIGHT_RAY_SWEEPER=false after the
    crash it stayed unmerged for good (reindex counted it as merged)."""
    from services.embedded import create_app

    stack = _stack(pg_url, s3_url, moto_endpoint)
    engine = make_engine(pg_url)
    tenant = new_tenant()
    (tok,) = _tokens(engine, tenant)
    app = create_app({**stack, "ray_sweeper": True})
    app.extensions["hindsight.ray_sweeper"].stop()  # "dies": nothing flushes
    r = Ray(app, tok)
    _, _, events = workload(seed=14)
    r.post_all(bodies(events, 10_000))
    _dies(app)
    after = create_app({**stack, "ray_sweeper": False})  # restarted without a sweeper
    st = after.extensions["hindsight"]
    counts = ray_reindex.reindex(st.blobs, st.sessions, settle=SETTLE, idle=IDLE)
    assert counts["ray_recovered"] == len(bodies(events, 10_000))
    q = text(
        "SELECT (SELECT count(*) FROM ray_tasks t WHERE t.session_id=s.id),"
        " (SELECT count(*) FROM ray_bodies b WHERE b.session_id=s.id AND NOT tasks_merged)"
        " FROM sessions s JOIN clusters c ON c.id=s.cluster_id JOIN tenants n ON n.id=c.tenant_id"
        " WHERE n.name=:t"
    )
    with engine.connect() as c:
        tasks, unmerged = c.execute(q, {"t": tenant}).one()
    engine.dispose()
    assert tasks == 63 and unmerged == 0


@pytest.mark.postgres
def test_a_job_waits_for_a_live_collector_whose_flush_failed(pg_url, s3_url, moto_endpoint):
    """No crash: collector P2's flush fails (Postgres restarted), and the bodies it held
    are left to recovery. Collector P1's sweeper does not close the job at the settle time
    meanwhile (it did, writing the tasks as failed with the job); recovery merges the ends
    and the job closes with the right errors."""
    from sqlalchemy.orm import sessionmaker

    from services.embedded import create_app

    stack = _stack(pg_url, s3_url, moto_endpoint)
    engine = make_engine(pg_url)
    tenant = new_tenant()
    (tok,) = _tokens(engine, tenant)
    _, _, events = workload(seed=15)
    a, b = _split(events)
    p1 = Ray(create_app({**stack, "ray_sweeper": False}), tok)
    p1.post_all(bodies(a, 10_000))
    app2 = create_app({**stack, "ray_sweeper": True})
    sw = app2.extensions["hindsight.ray_sweeper"]
    sw.stop()
    Ray(app2, tok).post_all(bodies(b, 10_000))
    down = sessionmaker(bind=make_engine("postgresql+psycopg2://postgres@127.0.0.1:1/x"))
    assert sw.hold.flush(down, app2.extensions["hindsight"].blobs, force=True) == 0
    assert len(sw.hold) == 0  # not kept in memory: left to recovery
    assert _count(engine, tenant, "ray_bodies", "NOT x.tasks_merged") > 0
    st = p1.store
    now = time.time()
    ray_hold.recover_held(st.sessions, st.blobs, now=now + SETTLE + 1)  # too early to recover
    ray_sweep.run_due(st.sessions, st.blobs, settle=SETTLE, idle=IDLE, now=now + SETTLE + 1)
    assert p1.run(1)["status"] == "running"  # not closed while the ends are held
    ray_hold.recover_held(st.sessions, st.blobs, now=now + ray_hold.RECOVER_AFTER + 1)
    ray_sweep.run_due(st.sessions, st.blobs, settle=SETTLE, idle=IDLE, now=now + 60)
    ray_sweep.emit_ready(st.sessions, st.blobs)
    summary = p1.run(1)
    engine.dispose()
    assert summary["error_count"] == 8  # every 7th of 60 fails


@pytest.mark.postgres
def test_a_session_whose_held_bodies_cannot_be_read_does_not_hold_up_the_others(pg_url, tmp_path):
    """Recovery takes the oldest held bodies first: a session whose bodies fail to merge
    again (their blobs unreadable) is left alone for a while, and another session's held
    body, behind more than a pass's worth of them, is merged meanwhile (it waited)."""
    from services.embedded import create_app

    stack = _stack(pg_url, (tmp_path / "blobs").as_uri())
    engine = make_engine(pg_url)
    bad, good = new_tenant(), new_tenant()
    bad_tok, good_tok = _tokens(engine, bad, good)
    app = create_app({**stack, "ray_sweeper": True})
    app.extensions["hindsight.ray_sweeper"].stop()  # a collector that dies holding them
    _, _, events = workload(seed=16)
    Ray(app, bad_tok).post_all(bodies(events, 5))  # 13 bodies, held
    Ray(app, good_tok).post_all(bodies(events, 10_000))  # then 1 body, held
    _dies(app)
    st = app.extensions["hindsight"]
    for key in list(st.blobs.list(f"{ray_bodies.RAW_PREFIX}/{bad}/")):
        path = tmp_path / "blobs" / key
        path.unlink()
        path.mkdir()  # a directory where the blob goes: reading it fails
    later = time.time() + ray_hold.RECOVER_AFTER + 1
    first = ray_hold.recover_held(st.sessions, st.blobs, now=later, limit=5)
    assert first.failed == 1 and first.batches == 0  # the bad session, then left alone
    second = ray_hold.recover_held(st.sessions, st.blobs, now=later, limit=5)
    assert second.batches == 1 and second.failed == 0  # the good session's body
    merged = _count(engine, good, "ray_tasks")
    engine.dispose()
    assert merged == 63


@pytest.mark.postgres
def test_a_full_hold_is_merged_before_the_request_that_filled_it_is_acknowledged(
    pg_url, s3_url, moto_endpoint
):
    """Back-pressure, never a drop, never an unbounded hold: a request that takes the hold
    past its limit merges everything it holds first, young patches of tasks not yet ended
    too (merging only complete and aged ones, a hold of young ones would grow on)."""
    from services.embedded import create_app

    engine = make_engine(pg_url)
    tenant = new_tenant()
    (tok,) = _tokens(engine, tenant)
    app = create_app({**_stack(pg_url, s3_url, moto_endpoint), "ray_sweeper": True})
    sw = app.extensions["hindsight.ray_sweeper"]
    sw.stop()  # only the request flushes
    assert sw.hold is not None
    sw.hold.limit = 10
    _, _, events = workload(seed=17)
    started, _ = _split(events)  # definitions and RUNNING: no task complete
    Ray(app, tok).post_all(bodies(started, 10_000))
    assert len(sw.hold) == 0
    held = _count(engine, tenant, "ray_bodies", "NOT x.tasks_merged")
    engine.dispose()
    assert held == 0


@pytest.mark.postgres
def test_a_job_waits_for_ends_acknowledged_within_its_settle_time(pg_url, s3_url, moto_endpoint):
    """No crash: the tasks' ends come in a body acknowledged shortly before the job's
    settle time is up, and a live collector holds them (under half a second). The job
    does not close until they are merged (closed before, it would write every one of its
    tasks as failed with the job): a body counts as held from its acknowledgement, not
    only once it is a second old."""
    from services.embedded import create_app

    stack = _stack(pg_url, s3_url, moto_endpoint)
    engine = make_engine(pg_url)
    tenant = new_tenant()
    tok_inline, tok_held = _tokens(engine, new_tenant(), tenant)
    _, _, events = workload(seed=18)
    a, b = _split(events)
    inline = Ray(create_app({**stack, "ray_sweeper": False}), tok_inline)
    inline.post_all(bodies(a, 10_000) + bodies(b, 10_000))
    inline.sweep(after=SETTLE + 1)

    app = create_app({**stack, "ray_sweeper": True})
    sw = app.extensions["hindsight.ray_sweeper"]
    sw.stop()  # the flushes are driven by hand
    held = Ray(app, tok_held)
    held.post_all(bodies(a, 10_000))
    sw.hold.flush(
        held.store.sessions, held.store.blobs, force=True
    )  # definitions and RUNNING merged
    held.post_all(bodies(b, 10_000))  # the ends (and the job's end): held
    acked = time.time()
    with engine.begin() as c:  # the job's end as if it had come 0.5 s short of settling
        c.execute(
            text(
                "UPDATE ray_jobs j SET end_seen = :t FROM sessions s, clusters c, tenants n"
                " WHERE s.id = j.session_id AND c.id = s.cluster_id AND n.id = c.tenant_id"
                " AND n.name = :tenant"
            ),
            {"t": acked - SETTLE + 0.5, "tenant": tenant},
        )
    st = held.store
    ray_sweep.run_due(st.sessions, st.blobs, settle=SETTLE, idle=IDLE, now=acked + 0.6)
    assert held.run(1)["status"] == "running"  # waits for the held ends
    sw.hold.flush(st.sessions, st.blobs, force=True)  # the live collector's next flush
    ray_sweep.emit_ready(st.sessions, st.blobs)
    held.sweep(after=SETTLE + 1)
    engine.dispose()
    assert held.view()["runs"][ray_job(1)] == inline.view()["runs"][ray_job(1)]


@pytest.mark.postgres
def test_a_held_session_that_cannot_be_written_does_not_hold_up_the_others(pg_url, tmp_path):
    """A flush writes the tasks it completes in the same transaction as the merge, a
    transaction per session. One session's tasks cannot be stored (its derived prefix is
    taken by a file): the other session's are merged and written in the same flush; the
    failed one has nothing merged or taken, its patches leave the hold (which must not
    grow with a session that cannot be written) and its bodies are merged again by
    recovery and written once its store takes writes again, every task once."""
    blobs = tmp_path / "blobs"
    app, sw = _held_app(pg_url, tmp_path)
    engine = make_engine(pg_url)
    tenants = [new_tenant(), new_tenant()]
    clients = [Ray(app, tok) for tok in _tokens(engine, *tenants)]
    sessions, held = [], []  # task attempts held, per session
    for seed, r in zip((21, 22), clients, strict=True):
        sim, _, events = workload(seed=seed)
        r.post_all(bodies(events, 10_000))
        sessions.append(sim.session)
        held.append(len(sw.hold) - sum(held))
    st = clients[0].store
    (broken,) = (blobs / ray_bodies.DERIVED_PREFIX).glob(f"{tenants[1]}/rc/{sessions[1]}")
    aside = broken.with_name(broken.name + ".aside")
    broken.rename(aside)
    broken.write_bytes(b"")  # a file where the session's directory goes

    assert sw.hold.flush(st.sessions, st.blobs) == held[0]
    assert clients[0].run(1)["task_count"] == 60  # written in the same flush
    assert clients[1].run(1)["task_count"] == 0
    assert _count(engine, tenants[1], "ray_tasks") == 0  # nothing merged, nothing taken
    assert _count(engine, tenants[1], "ray_ready") == 0
    assert len(sw.hold) == 0
    assert _count(engine, tenants[1], "ray_bodies", "NOT x.tasks_merged") > 0  # for recovery
    broken.unlink()
    aside.rename(broken)  # the store takes writes again
    ray_hold.recover_held(st.sessions, st.blobs, now=time.time() + ray_hold.RECOVER_AFTER + 1)
    ray_sweep.emit_ready(st.sessions, st.blobs)  # what recovery merged and queued
    assert clients[1].run(1)["task_count"] == 60
    for tenant, n in zip(tenants, held, strict=True):
        assert _count(engine, tenant, "ray_tasks", "emitted") == n
        assert _count(engine, tenant, "ray_bodies", "NOT x.tasks_merged") == 0
    engine.dispose()


@pytest.mark.postgres
def test_a_request_far_ahead_of_the_flushes_merges_what_is_due_before_its_ack(
    pg_url, s3_url, moto_endpoint
):
    """Back-pressure: a request's threads can outrun the sweeper's flushes (they share the
    process). Past the hold's ``behind`` mark, a request merges and writes what is due
    itself before it is acknowledged; here the sweeper never flushes at all."""
    from services.embedded import create_app

    engine = make_engine(pg_url)
    (tok,) = _tokens(engine, new_tenant())
    engine.dispose()
    app = create_app({**_stack(pg_url, s3_url, moto_endpoint), "ray_sweeper": True})
    sw = app.extensions["hindsight.ray_sweeper"]
    sw.stop()
    sw.hold.behind_at = 10
    r = Ray(app, tok)
    _, _, events = workload(seed=23)
    r.post_all(bodies(events, 10_000))
    assert len(sw.hold) <= 10
    assert r.run(1)["task_count"] == 60


@pytest.mark.postgres
def test_two_processes_flushes_of_one_session_do_not_wait_for_each_other(
    pg_url, s3_url, moto_endpoint
):
    """A flush holds its session's row against retention for its whole transaction (the
    merge and the write). Found under bench/ray_ingest.py: it took the row FOR NO KEY
    UPDATE, so the flushes of two collector processes (and each one's derived batch, which
    touches the row) waited for one another, ~0.44 s a flush. KEY SHARE, as a foreign key
    holds it, lets them run side by side and still keeps retention's delete waiting."""
    from services.embedded import create_app

    engine = make_engine(pg_url)
    tenant = new_tenant()
    (tok,) = _tokens(engine, tenant)
    r = Ray(create_app({**_stack(pg_url, s3_url, moto_endpoint), "ray_sweeper": False}), tok)
    r.post_all(bodies(workload(seed=24)[2], 10_000))
    sid = _sid(engine, tenant)
    other = make_sessionmaker(engine)
    with r.store.sessions.begin() as first:
        assert ray_hold._session_kept(first, sid)  # one process's flush, under way
        with other.begin() as second:  # the other process's flush of the same session
            second.execute(text("SET LOCAL lock_timeout = '2s'"))
            assert ray_hold._session_kept(second, sid)
            second.execute(
                text("UPDATE sessions SET last_seen = last_seen WHERE id = :s"), {"s": sid}
            )
        with other.begin() as retention:
            retention.execute(text("SET LOCAL lock_timeout = '200ms'"))
            with pytest.raises(OperationalError, match="lock timeout"):
                retention.execute(text("DELETE FROM sessions WHERE id = :s"), {"s": sid})
    engine.dispose()


def _half_ended(seed: int) -> list[bytes]:
    """One body: every task's definition and RUNNING, and about half of their ends."""
    a, b = _split(workload(seed=seed)[2])
    return bodies(a + b[: len(b) // 2], 100_000)


@pytest.mark.postgres
def test_an_interrupted_flush_puts_back_the_sessions_it_had_not_merged(
    pg_url, tmp_path, monkeypatch
):
    """A flush takes every session's due patches, then merges them a session at a time.
    Interrupted in the first session (KeyboardInterrupt, SystemExit: not an Exception), it
    puts back every session's patches, not only the first's: the second's, dropped with
    their bodies' counts already lowered, would let a later flush mark the body merged
    without them (recovery never looks at it again)."""
    app, sw = _held_app(pg_url, tmp_path)
    engine = make_engine(pg_url)
    t1, t2 = new_tenant(), new_tenant()
    c1, c2 = (Ray(app, tok) for tok in _tokens(engine, t1, t2))
    c1.post_all(bodies(workload(seed=31)[2], 100_000))
    c2.post_all(_half_ended(32))
    s1, s2 = _sid(engine, t1), _sid(engine, t2)
    assert s1 < s2  # flushed in this order
    held2 = len(sw.hold._tasks[s2])
    sw.hold.age = 3600.0  # only complete tasks are due
    real = ray_hold._merge_and_write

    def interrupted(db, blobs, sid, *a, **k):
        if sid == s1:
            raise KeyboardInterrupt
        return real(db, blobs, sid, *a, **k)

    monkeypatch.setattr(ray_hold, "_merge_and_write", interrupted)
    st = c1.store
    with pytest.raises(KeyboardInterrupt):
        sw.hold.flush(st.sessions, st.blobs)
    monkeypatch.setattr(ray_hold, "_merge_and_write", real)
    sw.hold.flush(st.sessions, st.blobs, force=True)
    assert len(sw.hold) == 0
    rows = _count(engine, t2, "ray_tasks")
    unmerged = _count(engine, t2, "ray_bodies", "NOT x.tasks_merged")
    engine.dispose()
    assert (rows, unmerged) == (held2, 0)


@pytest.mark.postgres
def test_a_body_left_to_recovery_stays_so_when_a_later_flush_is_put_back(
    pg_url, tmp_path, monkeypatch
):
    """The index refuses some of a body's held patches (the body is left to recovery); the
    flush that takes its last patches is interrupted and puts them back. The body keeps its
    mark: were it lost, the flush after would mark the body merged, and the refused patches
    would never be merged again."""
    app, sw = _held_app(pg_url, tmp_path)
    engine = make_engine(pg_url)
    tenant = new_tenant()
    (c,) = (Ray(app, tok) for tok in _tokens(engine, tenant))
    c.post_all(_half_ended(41))
    held = len(sw.hold._tasks[_sid(engine, tenant)])
    st = c.store
    real = ray_hold._merge_and_write
    calls = {"n": 0}

    def flaky(db, blobs, sid, *a, **k):
        calls["n"] += 1
        if calls["n"] == 1:  # the complete tasks: a value the index refuses
            raise DataError("INSERT ...", {}, Exception("value too long"))
        if calls["n"] == 2:  # the rest: interrupted
            raise KeyboardInterrupt
        return real(db, blobs, sid, *a, **k)

    monkeypatch.setattr(ray_hold, "_merge_and_write", flaky)
    sw.hold.age = 3600.0
    sw.hold.flush(st.sessions, st.blobs)
    with pytest.raises(KeyboardInterrupt):
        sw.hold.flush(st.sessions, st.blobs, force=True)
    sw.hold.flush(st.sessions, st.blobs, force=True)  # the rest merged, the body not marked
    assert _count(engine, tenant, "ray_bodies", "NOT x.tasks_merged") == 1
    ray_hold.recover_held(st.sessions, st.blobs, now=time.time() + ray_hold.RECOVER_AFTER + 1)
    rows = _count(engine, tenant, "ray_tasks")
    engine.dispose()
    assert rows == held


@pytest.mark.postgres
def test_a_session_that_cannot_be_written_does_not_fail_other_tenants_requests(pg_url, tmp_path):
    """A session whose tasks cannot be stored leaves the hold for recovery, which bounds
    it: put back on every flush, its patches would pile up in the hold, and past its limit
    every request of the process would flush everything, the broken session included, and
    fail with it (500 to every tenant for as long as the session stayed broken)."""
    app, sw = _held_app(pg_url, tmp_path)
    engine = make_engine(pg_url)
    t1, t2 = new_tenant(), new_tenant()
    c1, c2 = (Ray(app, tok) for tok in _tokens(engine, t1, t2))
    sim, _, events = workload(seed=51)
    c1.post_all(bodies(events, 100_000))
    (broken,) = (tmp_path / "blobs" / ray_bodies.DERIVED_PREFIX).glob(f"{t1}/rc/{sim.session}")
    broken.rename(broken.with_name(broken.name + ".aside"))
    broken.write_bytes(b"")  # the session's derived prefix refuses writes
    sw.hold.limit = len(sw.hold)  # the broken session's patches stand for 200,000
    r = c2.post(bodies(workload(seed=52)[2], 100_000)[0])  # another tenant's body: past it
    assert r.status_code == 200, r.get_data()[:300]
    assert len(sw.hold) == 0  # the healthy tenant's merged, the broken one's left to recovery
    assert _count(engine, t2, "ray_bodies", "NOT x.tasks_merged") == 0
    assert _count(engine, t1, "ray_bodies", "NOT x.tasks_merged") > 0
    engine.dispose()


class _ReadHook:
    """The blob store, calling ``during`` once, at the first read of a key under ``prefix``:
    recovery reads a held body's blob between taking its row locks and merging."""

    def __init__(self, blobs: Any, prefix: str, during: Any) -> None:
        self.blobs, self.prefix, self.during = blobs, prefix, during

    def get(self, key: str) -> bytes:
        if self.during and key.startswith(self.prefix):
            during, self.during = self.during, None
            during()
        return self.blobs.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.blobs, name)


@pytest.mark.postgres
def test_recovery_and_retention_of_one_session_do_not_deadlock(pg_url, tmp_path):
    """Retention deletes a session while recovery merges one of its held bodies. Recovery
    takes the session's row (KEY SHARE) before the body's, in retention's order (its delete
    of the session cascades to the bodies): retention's delete waits for the merge, and
    both complete. In the reverse order the two deadlock and Postgres aborts one."""
    app, sw = _held_app(pg_url, tmp_path)
    engine = make_engine(pg_url)
    tenant = new_tenant()
    (tok,) = _tokens(engine, tenant)
    r = Ray(app, tok)
    r.post_all(bodies(workload(seed=61)[2], 10_000))
    assert len(sw.hold) > 0
    _dies(app)
    sid, st = _sid(engine, tenant), r.store
    failed: list[BaseException] = []
    deleting = threading.Event()
    pid: list[int] = []

    def delete_session() -> None:
        try:
            with engine.begin() as c:
                pid.append(c.execute(text("SELECT pg_backend_pid()")).scalar_one())
                deleting.set()
                c.execute(text("DELETE FROM sessions WHERE id = :s"), {"s": sid})
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            deleting.set()
            failed.append(exc)

    retention = threading.Thread(target=delete_session)

    def start_retention() -> None:  # recovery holds its locks: retention's delete comes
        retention.start()
        deleting.wait(10)
        with engine.connect() as c:  # until the delete waits on a lock, or is done
            deadline = time.monotonic() + 10
            while retention.is_alive() and time.monotonic() < deadline:
                waits = c.execute(
                    text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p"),
                    {"p": pid[0]},
                ).scalar()
                if waits == "Lock":
                    break
                c.rollback()
                time.sleep(0.01)

    hook = _ReadHook(st.blobs, f"{ray_bodies.RAW_PREFIX}/{tenant}/", start_retention)
    got = ray_hold.recover_held(st.sessions, hook, now=time.time() + ray_hold.RECOVER_AFTER + 1)
    retention.join(30)
    left = _count(engine, tenant, "ray_bodies")
    engine.dispose()
    assert hook.during is None  # retention came while recovery held this session's body
    assert not failed, failed
    assert got.failed == 0 and got.batches >= 1
    assert left == 0  # the session and its bodies are gone
