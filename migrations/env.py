"""Alembic environment: run migrations on the connection handed in by storage.core.db.upgrade,
or on HINDSIGHT_DATABASE_URL when invoked through the alembic command line."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from storage.core.db import alembic_owns
from storage.core.models import Base

config = context.config
target_metadata = Base.metadata


def _configure_and_run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=alembic_owns,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _configure_and_run(connection)
else:
    from storage.core.config import load_settings

    engine = create_engine(load_settings().database_url)
    with engine.begin() as conn:
        _configure_and_run(conn)
