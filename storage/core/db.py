"""Engines, sessions and migrations for the index (Postgres and SQLite)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from storage.core import locks

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL, foreign keys and a busy timeout."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, hide_parameters=True
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            # LIKE as Postgres has it: name=ETL* matched "etl-nightly" here only
            cur.execute("PRAGMA case_sensitive_like=ON")
            cur.close()

        return engine
    # values_plus_batch: the rollup upserts' executemany go in pages, not a round trip a row
    # (a 20-row upsert: 2.7 -> 1.9 ms).
    # hide_parameters: an error's message (logged) shows no values, such as a token's digest
    # connect_timeout: a database host that accepts and never answers held requests (and
    # /readyz) with no answer at all; now they fail over to a 503 (unless the URL says).
    connect = {} if "connect_timeout" in parsed.query else {"connect_timeout": 10}
    engine = create_engine(
        url,
        pool_pre_ping=True,
        pool_size=8,
        max_overflow=8,
        hide_parameters=True,
        executemany_mode="values_plus_batch",
        connect_args=connect,
    )

    @event.listens_for(engine, "connect")
    def _notice_a_dead_client(dbapi_conn: Any, _record: Any) -> None:
        # A process killed mid-statement (kill -9, the OOM killer) left its backend running
        # the statement to its end, its row locks held: a killed collector's sweeper held
        # the Ray queue's rows for 20-33 s. Postgres 14+ checks the client every 2 s
        # instead; older servers refuse the setting, and go on as before.
        cur = dbapi_conn.cursor()
        try:
            cur.execute("SET client_connection_check_interval = 2000")
            dbapi_conn.commit()
        except Exception:
            dbapi_conn.rollback()
        finally:
            cur.close()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` (serialised on Postgres by an advisory lock)."""
    _migrate(url_or_engine, "upgrade", revision)


def downgrade(url_or_engine: str | Engine, revision: str) -> None:
    """Undo Alembic migrations down to ``revision`` (what ``hindsight db`` does not offer:
    for the migration tests and benches)."""
    _migrate(url_or_engine, "downgrade", revision)


def _migrate(url_or_engine: str | Engine, direction: str, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": locks.UPGRADE})
        cfg.attributes["connection"] = conn
        getattr(command, direction)(cfg, revision)


def alembic_owns(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic's ``include_object``: the tables of the models, not the lake's Iceberg
    catalog (``iceberg_*``: pyiceberg's, in the index database) nor the per-run tables'
    partitions (``storage.core.partitions``: the parents match the models)."""
    from storage.core.partitions import is_partition

    return not (
        type_ == "table"
        and reflected
        and compare_to is None
        and name is not None
        and (name.startswith("iceberg_") or is_partition(name))
    )


def head_revisions() -> list[str]:
    """The head revision(s) of the migrations shipped with this code (one, unless two
    branches of migrations were merged without a merge revision)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return list(ScriptDirectory.from_config(cfg).get_heads())


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
