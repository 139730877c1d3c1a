"""The real embedded server fixture of the Dask tests, for the query tests on real runs, and
the collector and query apps in process."""

from __future__ import annotations

import pytest

from tests.dask.conftest import hindsight_server  # noqa: F401


@pytest.fixture
def clients(stack):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    return collector_app(stack).test_client(), query_app(stack).test_client()
