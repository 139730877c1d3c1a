"""Fixtures of the storage tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def sessions(index_url: str) -> Any:
    """A session maker of the parametrised index (SQLite or Postgres), upgraded to head."""
    from storage.core.db import make_engine, make_sessionmaker, upgrade

    engine = make_engine(index_url)
    upgrade(engine)
    yield make_sessionmaker(engine)
    engine.dispose()
