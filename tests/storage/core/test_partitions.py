"""The per-run tables partitioned by ranges of run ids (Postgres; decision 0038): a
populated index migrates in and out with every answer the same, a row beyond the ranges
waits in the default partition until its range is made (by a collector's finish worker,
no command), and retention drops a range whose runs all expire, never one that holds a kept
run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from sqlalchemy import text

from storage.core import locks, partitions
from storage.core.blobs import open_blob_store
from storage.core.db import downgrade, make_engine, make_sessionmaker, upgrade
from storage.jobs import retention
from tests.conftest import fresh_pg_database, new_tenant
from tests.storage.ingest.test_index import apply, synthetic_batches
from tests.storage.runs.test_packed import answers

W = partitions.WIDTH


@pytest.fixture
def engine() -> Iterator[Any]:
    """A Postgres database of this test's own: run ids are placed by hand here."""
    gen = fresh_pg_database()
    url = next(gen)
    engine = make_engine(url)
    yield engine
    engine.dispose()
    next(gen, None)  # the database dropped


def session_batches(session: str, seed: int) -> list[Any]:
    return [msgspec.structs.replace(b, session=session) for b in synthetic_batches(seed=seed)]


def next_run_id(engine: Any, value: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"ALTER SEQUENCE runs_id_seq RESTART WITH {value}"))


def rows_by_partition(engine: Any) -> dict[str, int]:
    """Rows in each partition of every per-run table, by partition name."""
    out = {}
    with engine.connect() as conn:
        for table in partitions.TABLES:
            for name, _, _ in partitions.ranges(conn, table):
                out[name] = conn.execute(text(f'SELECT count(*) FROM "{name}"')).scalar_one()
            default = f"{table}_default"
            out[default] = conn.execute(text(f'SELECT count(*) FROM "{default}"')).scalar_one()
    return out


def lows(engine: Any, table: str) -> list[int]:
    with engine.connect() as conn:
        return [lo for _, lo, _ in partitions.ranges(conn, table)]


def assert_answers_as_indexed_again(sessions: Any, written: list[tuple[str, int]]) -> None:
    """Every (tenant, seed) written answers as ``synthetic_batches(seed)`` indexed afresh."""
    for tenant, seed in written:
        again = new_tenant()
        apply(sessions, again, synthetic_batches(seed=seed))
        assert answers(sessions, tenant) == answers(sessions, again)


def test_a_populated_index_migrates_into_partitions_and_back(engine):
    downgrade(engine, "0022")
    sessions = make_sessionmaker(engine)
    tenant = new_tenant()
    apply(sessions, tenant, synthetic_batches(seed=3))
    before = answers(sessions, tenant)
    with engine.connect() as conn:
        assert not partitions.partitioned(conn)
        plain = {
            t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one()
            for t in partitions.TABLES
        }
    assert plain["run_prefix_actions"] > 0 and plain["run_status_counts"] > 0

    upgrade(engine)
    with engine.connect() as conn:
        assert partitions.partitioned(conn)
    for table in partitions.TABLES:
        assert lows(engine, table) == [0, W]  # two ranges: the runs', one ahead
    counts = rows_by_partition(engine)
    for table, n in plain.items():  # every row moved, into its range
        assert counts[f"{table}_r0"] == n and counts[f"{table}_default"] == 0
    assert answers(sessions, tenant) == before

    downgrade(engine, "0022")
    with engine.connect() as conn:
        assert not partitions.partitioned(conn)
        assert partitions.ensure(engine) == 0  # nothing to keep ahead of plain tables
    assert answers(sessions, tenant) == before
    upgrade(engine)
    assert answers(sessions, tenant) == before


def test_rows_past_the_ranges_wait_in_the_default_until_their_range_is_made(engine):
    sessions = make_sessionmaker(engine)
    next_run_id(engine, 2 * W + 10)  # past the two ranges the migration made
    tenant = new_tenant()
    apply(sessions, tenant, synthetic_batches(seed=4))
    before = answers(sessions, tenant)
    assert rows_by_partition(engine)["run_prefixes_default"] > 0  # nothing refused

    # nothing while a migration runs (it holds the upgrade lock): the tables may be changing
    with engine.begin() as migrating:
        migrating.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": locks.UPGRADE})
        assert partitions.ensure(engine) == 0
        assert partitions.drop_expired(engine, []) == []
    # ranges up to two beyond the newest run, the default's rows moved into the first
    assert partitions.ensure(engine) == 2 * len(partitions.TABLES)
    assert partitions.ensure(engine) == 0
    counts = rows_by_partition(engine)
    for table in partitions.TABLES:
        assert lows(engine, table) == [0, W, 2 * W, 3 * W]
        assert counts[f"{table}_default"] == 0
    assert counts[f"run_prefixes_r{2 * W}"] > 0
    assert answers(sessions, tenant) == before
    # ingest goes on into the new range
    apply(sessions, tenant, session_batches("sess-2", seed=5))
    assert rows_by_partition(engine)["run_prefixes_default"] == 0
    # a stretch of ids no run took gets no partition: only the next ids' ranges are made
    next_run_id(engine, 100 * W + 5)
    assert partitions.ensure(engine) == 2 * len(partitions.TABLES)
    assert lows(engine, "run_prefixes") == [0, W, 2 * W, 3 * W, 100 * W, 101 * W]


def test_retention_drops_a_range_whose_runs_all_expire_and_keeps_one_with_a_kept_run(
    engine, tmp_path
):
    sessions = make_sessionmaker(engine)
    blobs = open_blob_store((tmp_path / "blobs").as_uri())
    old, kept, mixed = new_tenant(), new_tenant(), new_tenant()
    apply(sessions, old, session_batches("old", seed=6))  # run ids in the first range
    next_run_id(engine, W + 1)
    apply(sessions, kept, session_batches("kept", seed=7))  # in the second, beside ...
    apply(sessions, mixed, session_batches("mixed", seed=8))  # ... another tenant's
    partitions.ensure(engine)
    kept_before, mixed_before = answers(sessions, kept), answers(sessions, mixed)
    assert rows_by_partition(engine)["run_prefix_actions_r0"] > 0

    # every run of the first range expires: the range goes whole, from every table
    result = retention.apply(blobs, sessions, old, max_runs=0)
    assert [s.name for s in result.sessions] == ["old"]
    for table in partitions.TABLES:
        assert lows(engine, table) == [W, 2 * W]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs WHERE id < :w"), {"w": W}).scalar() == 0
    assert answers(sessions, kept) == kept_before
    assert answers(sessions, mixed) == mixed_before

    # a range holding another tenant's kept run stays; the expired runs' rows still go
    retention.apply(blobs, sessions, mixed, max_runs=0)
    for table in partitions.TABLES:
        assert lows(engine, table) == [W, 2 * W]
    with engine.connect() as conn:
        ids = "SELECT r.id FROM runs r JOIN tenants t ON t.id = r.tenant_id WHERE t.name = :t"
        assert conn.execute(text(ids), {"t": mixed}).all() == []
        left = conn.execute(
            text(f"SELECT count(DISTINCT run_id) FROM run_prefixes WHERE run_id IN ({ids})"),
            {"t": kept},
        ).scalar()
        assert left == 2 and rows_by_partition(engine)["run_prefixes_default"] == 0
        assert conn.execute(text("SELECT count(DISTINCT run_id) FROM run_prefixes")).scalar() == 2
    assert answers(sessions, kept) == kept_before


def test_a_collectors_finish_worker_makes_the_ranges_new_runs_need(engine, tmp_path):
    """No command: a collector with its finish worker on makes the range of run ids past
    the migration's at once, and the rows that waited in the default partition move in."""
    import gc
    import time

    from collector.app import create_app

    sessions = make_sessionmaker(engine)
    next_run_id(engine, 2 * W + 10)
    tenant = new_tenant()
    apply(sessions, tenant, synthetic_batches(seed=9))
    before = answers(sessions, tenant)
    assert rows_by_partition(engine)["run_prefixes_default"] > 0
    app = create_app(
        {
            "database_url": engine.url.render_as_string(hide_password=False),
            "blob_url": (tmp_path / "blobs").as_uri(),
            "finish_worker": True,
            "ray_sweeper": False,
        }
    )
    deadline = time.monotonic() + 60
    while any(lows(engine, t)[-1] < 3 * W for t in partitions.TABLES):
        assert time.monotonic() < deadline, "the finish worker made no range"
        time.sleep(0.05)
    del app
    gc.collect()
    counts = rows_by_partition(engine)
    assert all(counts[f"{t}_default"] == 0 for t in partitions.TABLES)
    assert counts[f"run_prefixes_r{2 * W}"] > 0
    assert answers(sessions, tenant) == before


def test_ranges_made_while_batches_arrive_lose_nothing(engine):
    """Ranges made over rows the default took, again and again, while two writers index
    runs into them: every run of theirs answers as the same batches indexed afterwards."""
    import threading

    sessions = make_sessionmaker(engine)
    # a tenant a session: answers() names runs by their keys, alike in every session
    writers = [[new_tenant() for _ in range(6)] for _ in range(2)]
    errors: list[BaseException] = []

    def write(tenants: list[str]) -> None:
        try:
            for seed, tenant in enumerate(tenants):
                apply(sessions, tenant, synthetic_batches(seed=seed))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in writers]
    for t in threads:
        t.start()
    jump = 2
    while any(t.is_alive() for t in threads):
        # the next runs past every range: they go to the default until ensure moves them
        next_run_id(engine, jump * W + 10)
        jump += 2
        partitions.ensure(engine)
    for t in threads:
        t.join()
    assert not errors, errors
    partitions.ensure(engine)
    assert rows_by_partition(engine)["run_prefixes_default"] == 0
    assert jump > 4  # ranges were made while they wrote
    assert_answers_as_indexed_again(
        sessions, [(tenant, seed) for tenants in writers for seed, tenant in enumerate(tenants)]
    )


def test_the_migration_goes_in_and_out_while_batches_arrive(engine):
    """A rolling upgrade: a collector still ingests while another process migrates. The
    migration takes ``runs`` first, as ingest does, so neither side deadlocks nor fails,
    and every run answers as the same batches indexed afterwards."""
    import threading

    downgrade(engine, "0022")
    sessions = make_sessionmaker(engine)
    stop = threading.Event()
    written: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            seed = 0
            while not stop.is_set():
                tenant = new_tenant()
                apply(sessions, tenant, synthetic_batches(seed=seed))
                written.append((tenant, seed))
                seed += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    try:
        while not written and thread.is_alive():  # ingest under way
            stop.wait(0.01)
        for _ in range(3):
            upgrade(engine)
            downgrade(engine, "0022")
        upgrade(engine)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert_answers_as_indexed_again(sessions, written)
