"""Alembic owns the schema: head applies cleanly on SQLite and Postgres and matches the models."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from storage.core import models as m
from storage.core.db import (
    alembic_owns,
    current_revision,
    downgrade,
    head_revisions,
    make_engine,
    upgrade,
)
from storage.core.models import Base


def test_migrations_have_one_head():
    assert len(head_revisions()) == 1, head_revisions()


def test_head_matches_models(index_url):
    (head,) = head_revisions()
    engine = make_engine(index_url)
    upgrade(engine)
    upgrade(engine)  # idempotent
    assert current_revision(engine) == head
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(
                conn, opts={"compare_type": True, "include_object": alembic_owns}
            ),
            Base.metadata,
        )
    engine.dispose()
    assert diff == []


def test_a_populated_index_of_the_previous_schema_migrates_and_its_detail_moves(tmp_path, request):
    """An index of revision 0016 (every run's replay samples and profile in the index)
    upgrades to head and ``hindsight reindex --detail`` (``move_detail``) moves each
    finished run's rows into its detail object: nothing lost, every answer the same, and a
    second pass moves nothing. On SQLite and on a Postgres database of its own (it
    downgrades)."""
    _on_sqlite_and_postgres(tmp_path, _migrate_and_move)


def _on_sqlite_and_postgres(tmp_path: Any, check: Any) -> None:
    """``check(urls, tmp_path)`` on a SQLite index and, where the server answers, on a
    Postgres database of its own (dropped after: a migration test downgrades it)."""
    from tests.conftest import fresh_pg_database

    urls = [f"sqlite:///{tmp_path / 'old.db'}"]
    pg = fresh_pg_database()
    try:
        urls.append(next(pg))
    except pytest.skip.Exception:
        pg = None
    try:
        check(urls, tmp_path)
    finally:
        if pg is not None:
            next(pg, None)  # the database dropped


def _migrate_and_move(urls: list[str], tmp_path: Any) -> None:
    from storage.analysis.profile import Profile, add_flat
    from storage.core.blobs import open_blob_store
    from storage.core.db import make_sessionmaker
    from storage.jobs.reindex import move_detail
    from storage.query.replay import sample_times, state_at
    from storage.runs import detail, profiles
    from tests.conftest import new_tenant
    from tests.storage.ingest.test_index import NOW, apply
    from tests.storage.query.test_replay import batches

    blobs = open_blob_store((tmp_path / "blobs").as_uri())
    tree = Profile()
    add_flat(
        tree, [("main", "a.py", 1, 2, "x()"), ("x", "a.py", 5, 6, "y")], [(-1, 0, 3), (0, 1, 2)]
    )
    for url in urls:
        engine = make_engine(url)
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        tenant = new_tenant()
        apply(sessions, tenant, batches())
        with sessions.begin() as db:
            run = db.execute(
                select(m.Run).join(m.Tenant).where(m.Tenant.name == tenant)
            ).scalar_one()
            tag = profiles.inputs_tag(db, run, profiles._worker_batches(db, run))
            rows = [
                profiles.Row("load", "tcp://w0", tree),
                profiles.Row("load", "", tree),
                profiles.Row("", "", tree),
            ]
            profiles.store(db, run, rows, tag)
        downgrade(engine, "0016")
        assert current_revision(engine) == "0016"
        with engine.connect() as conn:  # the previous schema, populated
            assert "detail_digest" not in {c["name"] for c in inspect(conn).get_columns("runs")}
            assert conn.execute(text("SELECT count(*) FROM run_states")).scalar_one() == 22

        upgrade(engine)
        assert current_revision(engine) == head_revisions()[0]

        def answers(sessions: Any = sessions, tenant: str = tenant) -> dict[str, Any]:
            with sessions() as db:
                run = db.execute(
                    select(m.Run).join(m.Tenant).where(m.Tenant.name == tenant)
                ).scalar_one()
                return {
                    "samples": sample_times(db, run, blobs),
                    "states": [state_at(db, run, NOW + s, blobs=blobs) for s in (-1, 0, 3.5, 20, 30, 99)],
                    "profile": profiles.load(db, blobs, run).samples,
                    "prefix": profiles.load(db, blobs, run, prefix="load").samples,
                    "worker": profiles.load(db, blobs, run, worker="tcp://w0").samples,
                    "by_prefix": {p: t.samples for p, t in profiles.load_prefixes(db, blobs, run).items()},
                }  # fmt: skip

        before = answers()
        assert move_detail(blobs, sessions)["runs"] == 1
        detail.clear_cache()
        with engine.connect() as conn:
            for table in ("run_states", "run_profiles"):
                assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 0
        assert answers() == before and before["samples"]["samples"] == 22
        assert before["profile"] == 3 and before["worker"] == 3
        assert move_detail(blobs, sessions)["runs"] == 0
        engine.dispose()


def test_a_populated_index_of_revision_0017_migrates_and_its_rows_pack(tmp_path):
    """An index of revision 0017 (every run's histograms and fine metrics as rows, every
    batch's blob key stored, prefix_days' histograms as JSON) upgrades to head: the keys
    the names give are cleared and read the same, the JSON histograms read as the packed
    ones did, and ``hindsight reindex --detail`` (``move_detail``) packs each finished
    run's rows into ``run_prefix_actions.hist``, ``run_metrics``, ``run_batch_lists`` and
    ``run_worker_lists``: none left, every answer the same, a second pass packs nothing,
    its manifest collapsed into chunks and written back as rows by 0022's downgrade reads
    the same, and after 0021's downgrade (worker rows written back) and the upgrade, the
    answers are the same again. On SQLite and on a Postgres database of its own."""
    _on_sqlite_and_postgres(tmp_path, _migrate_and_pack)


def _batch_keys(sessions: Any) -> dict[int, str]:
    from storage.runs import packed

    with sessions() as db:
        return dict(packed.keyed(db))


def _migrate_and_pack(urls: list[str], tmp_path: Any) -> None:
    from storage.core.blobs import open_blob_store
    from storage.core.db import make_sessionmaker
    from storage.core.manifest import collapse_due
    from storage.jobs.reindex import move_detail
    from tests.conftest import new_tenant
    from tests.storage.ingest.test_index import NOW, apply, synthetic_batches
    from tests.storage.runs.test_packed import answers, with_activity

    blobs = open_blob_store((tmp_path / "blobs").as_uri())
    for url in urls:
        engine = make_engine(url)
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        tenant = new_tenant()
        apply(sessions, tenant, with_activity(synthetic_batches(seed=2)))
        keys, at_head = _batch_keys(sessions), answers(sessions, tenant)
        downgrade(engine, "0017")
        with engine.connect() as conn:  # the previous schema, populated
            assert "run_metrics" not in inspect(conn).get_table_names()
            for table in ("run_activity", "run_prefix_hist", "run_batches"):
                assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() > 0
            stored = dict(conn.execute(text("SELECT id, blob_key FROM batches")).all())
        assert stored == keys and len(keys) > 2  # every key written back

        upgrade(engine)
        assert current_revision(engine) == head_revisions()[0]
        with engine.connect() as conn:  # the keys the names give are no longer stored
            n = "SELECT count(*) FROM batches WHERE blob_key <> ''"
            assert conn.execute(text(n)).scalar_one() == 0
        assert _batch_keys(sessions) == keys
        before = answers(sessions, tenant)
        assert before == at_head  # prefix_days' histograms as JSON again (0020's downgrade)
        counts = move_detail(blobs, sessions)
        assert counts["runs"] == 2 and counts["packed_rows"] > 0
        with engine.connect() as conn:
            for table in ("run_activity", "run_prefix_hist", "run_batches", "run_workers"):
                assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 0
            for table in ("run_metrics", "run_batch_lists", "run_worker_lists"):
                assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 2
        assert answers(sessions, tenant) == before
        assert before["activity"]["run-1"]["activity"] and before["hists"]["run-1"]
        assert move_detail(blobs, sessions)["runs"] == 0
        # a collapsed manifest (0022) goes back to rows on a downgrade, and reads the same
        collapsed = collapse_due(sessions, age=60.0, now=NOW + 61)
        # all of them; on SQLite the newest row stays (its ids are never handed out twice)
        assert collapsed == len(keys) - (engine.dialect.name == "sqlite")
        assert answers(sessions, tenant) == before
        downgrade(engine, "0021")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM batches")).scalar_one() == len(keys)
        assert _batch_keys(sessions) == keys
        upgrade(engine)
        assert answers(sessions, tenant) == before
        # the packed workers go back to rows on a downgrade, and read the same after
        downgrade(engine, "0020")
        upgrade(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM run_workers")).scalar_one() > 0
        assert answers(sessions, tenant) == before
        engine.dispose()
