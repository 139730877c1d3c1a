"""Fixtures for the SDK tests: a scriptable collector stand-in (see fake_collector.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sdk.fake_collector import FakeCollector


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    c = FakeCollector()
    yield c
    c.stop()
