"""Shared fixtures: real S3 (moto's server over HTTP), real Postgres, real services.

- Postgres: one fresh database per test run on the server at TEST_DATABASE_URL
  (default: the local server, trust auth), schema by ``alembic upgrade head``, dropped at
  the end. Without a reachable server the Postgres variants are skipped, with the reason.
- Isolation: every test gets its own tenant (and bucket), so tests never see each
  other's rows or blobs while sharing one database.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

DEFAULT_PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
TEST_DATABASE_URL = os.environ.get("TEST_DATABASE_URL", DEFAULT_PG)

_pg_skip_reason: str | None = None


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"postgres: {TEST_DATABASE_URL}"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _pg_skip_reason:
        terminalreporter.write_line(
            f"NOTE: Postgres tests were SKIPPED: {_pg_skip_reason}", yellow=True, bold=True
        )


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 endpoint over HTTP on loopback (moto's threaded server)."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"hs-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(moto_endpoint: str) -> str:
    return f"s3://{make_bucket(moto_endpoint)}/hindsight"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test run, migrated to head."""
    yield from fresh_pg_database()


def fresh_pg_database() -> Iterator[str]:
    """Create a Postgres database migrated to head, yield its URL, drop it (skip the test
    if the server cannot be reached)."""
    global _pg_skip_reason
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin_url = make_url(TEST_DATABASE_URL)
    name = f"hindsight_test_{os.getpid()}_{secrets.token_hex(3)}"
    try:
        admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # no server, no permission: skip, and say so at the end
        _pg_skip_reason = (
            f"cannot create a database at {TEST_DATABASE_URL}: {type(exc).__name__}: {exc}"
        )
        pytest.skip(_pg_skip_reason)
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    from storage.core.db import upgrade

    upgrade(url)
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path / 'index.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def index_url(request: pytest.FixtureRequest) -> str:
    """Every index test runs on SQLite and on Postgres."""
    if request.param == "postgres":
        return request.getfixturevalue("pg_url")
    return request.getfixturevalue("sqlite_url")


@pytest.fixture(params=["file", "s3"])
def blob_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """Every blob-store test runs on the local directory and on S3."""
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    return (tmp_path / "blobs").as_uri()


STACKS = {
    # the embedded default and the full stack (Postgres + S3)
    "embedded": ("sqlite_url", "file"),
    "full": ("pg_url", "s3_url"),
}


@pytest.fixture(params=list(STACKS))
def stack(request: pytest.FixtureRequest, tmp_path: Any, moto_endpoint: str) -> dict[str, Any]:
    """Settings for one of the two ways to run: embedded (SQLite + files) or full (Postgres + S3)."""
    db_fixture, blob = STACKS[request.param]
    blob_url = (tmp_path / "blobs").as_uri() if blob == "file" else request.getfixturevalue(blob)
    return {
        "data_dir": str(tmp_path),
        "database_url": request.getfixturevalue(db_fixture),
        "blob_url": blob_url,
        "s3_endpoint_url": moto_endpoint,
        "auth": "required",
        # Tests share one Postgres database (isolated by tenant) but not one bucket: a
        # finish thread would take other tests' jobs. Tests of finished-run work turn it on.
        "finish_worker": False,
    }


def new_tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_token(stack: dict[str, Any]):
    """``make_token(tenant, scopes)`` -> a real token stored (hashed) in the stack's index."""
    from storage.core.db import make_engine, make_sessionmaker, upgrade
    from storage.core.tokens import create_token

    engine = make_engine(stack["database_url"])
    upgrade(engine)
    sessions = make_sessionmaker(engine)

    def _make(tenant: str | None = None, scopes: str = "ingest,read") -> str:
        with sessions.begin() as db:
            return create_token(db, tenant or new_tenant(), scopes)

    yield _make
    engine.dispose()
