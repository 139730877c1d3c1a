"""Alembic environment: run migrations on the connection handed in by storage.core.db.upgrade,
or on HINDSIGHT_DATABASE_URL when invoked through the alembic command line."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from storage.core.models import Base

config = context.config
target_metadata = Base.metadata


def not_the_lake_catalogs(obj, name, type_, reflected, compare_to) -> bool:  # noqa: ANN001
    """The history lake's Iceberg catalog keeps its tables (``iceberg_*``) in the index
    database; they are pyiceberg's, not Alembic's."""
    return not (
        type_ == "table" and reflected and compare_to is None and name.startswith("iceberg_")
    )


def _configure_and_run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=not_the_lake_catalogs,
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
