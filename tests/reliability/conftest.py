"""Fixtures for the reliability tests: an embedded stack (SQLite + local blobs) for the fast
operational checks, and a live threaded HTTP server for the ones that need real sockets."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from hypothesis import settings
from werkzeug.serving import BaseWSGIServer, make_server

from tests.conftest import new_tenant

# No example database in the tree: a failure prints the seed and the shrunk example.
settings.register_profile("hindsight", database=None)
settings.load_profile("hindsight")


@pytest.fixture
def embedded(tmp_path: Any) -> dict[str, Any]:
    """Settings of the embedded way to run, with auth required."""
    return {
        "data_dir": str(tmp_path),
        "database_url": f"sqlite:///{tmp_path / 'index.db'}",
        "blob_url": (tmp_path / "blobs").as_uri(),
        "auth": "required",
    }


def token_for(
    settings: dict[str, Any], tenant: str | None = None, scopes: str = "ingest,read"
) -> str:
    """A real token, stored hashed in the index the settings name."""
    from storage.core.db import make_engine, make_sessionmaker, upgrade
    from storage.core.tokens import create_token

    engine = make_engine(settings["database_url"])
    try:
        upgrade(engine)
        with make_sessionmaker(engine).begin() as db:
            return create_token(db, tenant or new_tenant(), scopes)
    finally:
        engine.dispose()


@pytest.fixture
def serve() -> Iterator[Callable[[Flask], str]]:
    """``serve(app)`` -> base URL of a threaded werkzeug server on loopback (stopped after)."""
    servers: list[tuple[BaseWSGIServer, threading.Thread]] = []

    def _serve(app: Flask) -> str:
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True, name="test-server")
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.port}"

    yield _serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(10)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The runs marked slow here take minutes each (1,000,000-event faults, a 10-minute
    outage, a 5-minute flood, 10,000 fuzz requests): they run only when selected with
    ``-m slow`` (``make test-slow``), never by a plain ``pytest tests/reliability``."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="slow: run with -m slow (make test-slow)")
    for item in items:
        if item.get_closest_marker("slow") and here in Path(str(item.fspath)).parents:
            item.add_marker(skip)
