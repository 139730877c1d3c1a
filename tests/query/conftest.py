"""The real embedded server fixture of the Dask tests, for the query tests on real runs."""

from __future__ import annotations

from tests.dask.conftest import hindsight_server  # noqa: F401
