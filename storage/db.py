"""Engines, sessions and the portable SQL pieces the index needs (Postgres and SQLite)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.elements import ColumnElement

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Any fixed 64-bit number: serialises concurrent `upgrade` calls on Postgres.
_UPGRADE_LOCK = 0x68696E6473676874


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL, foreign keys and a busy timeout."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` (serialised on Postgres by an advisory lock)."""
    from alembic import command
    from alembic.config import Config

    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _UPGRADE_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def insert_for(session: Session | Any, model: Any) -> Any:
    """A dialect-specific INSERT (with ``on_conflict_do_*``) for ``model``."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    # The Core table, not the ORM entity: the ORM's bulk path costs ~0.5 ms a statement.
    return insert(getattr(model, "__table__", model))


def least(session: Session, a: Any, b: Any) -> ColumnElement[Any]:
    """The smaller of two values, ignoring NULLs (LEAST on Postgres, min() on SQLite)."""
    a2, b2 = func.coalesce(a, b), func.coalesce(b, a)
    if session.get_bind().dialect.name == "postgresql":
        return func.least(a2, b2)
    return func.min(a2, b2)


def greatest(session: Session, a: Any, b: Any) -> ColumnElement[Any]:
    """The larger of two values, ignoring NULLs."""
    a2, b2 = func.coalesce(a, b), func.coalesce(b, a)
    if session.get_bind().dialect.name == "postgresql":
        return func.greatest(a2, b2)
    return func.max(a2, b2)
