"""Alembic owns the schema: head applies cleanly on SQLite and Postgres and matches the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from storage.core.db import current_revision, head_revisions, make_engine, upgrade
from storage.core.models import Base

ICEBERG_CATALOG = "iceberg_"  # the lake's catalog tables (pyiceberg's), in the same database


def alembics(obj, name, type_, reflected, compare_to) -> bool:
    return not (type_ == "table" and compare_to is None and name.startswith(ICEBERG_CATALOG))


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
                conn, opts={"compare_type": True, "include_object": alembics}
            ),
            Base.metadata,
        )
    engine.dispose()
    assert diff == []
