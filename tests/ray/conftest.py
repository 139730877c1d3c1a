"""A real local Ray cluster on loopback whose event exporter posts to a real Hindsight
server (``hindsight serve``), one of each per test run (the module that uses them).

The cluster is heavy (~0.6 GB with the dashboard, which Ray's State API needs to compare
against), so it starts once, lives in a throwaway HOME and temp dir, and is stopped by
killing its process group (``ray stop`` would stop every Ray on the machine).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.lib_ray import RayHead
from tests.dashboard.conftest import browser, page  # noqa: F401 (fixtures for the run page test)
from tests.dask.conftest import EmbeddedServer, wait_until

JOBS = Path(__file__).parent / "jobs"
BIN = Path(sys.executable).parent
RAY_CLUSTER = "ray-test"
# HINDSIGHT_RAY_SETTLE_SECONDS of the test server: the agent POSTs every second, so the
# workers' deaths a job's end causes arrive up to a second after it.
SETTLE = 2.0
#: The two spellings of field names Ray's exporter writes; every test of the module using
#: the cluster runs with each (the recommended first).
FIELD_NAMES = ["snake_case", "camelCase"]


def ray_missing() -> str | None:
    if importlib.util.find_spec("ray") is None or not (BIN / "ray").exists():
        return 'Ray is not installed: `make install` installs "ray[default]" (the test extra)'
    return None


class RayCluster(RayHead):
    """The test cluster: a head with the dashboard (Ray's State API needs it), exporting
    as docs/ray.md recommends (workers report every 100 ms, the agent POSTs every second)
    with the field names it writes as the test asks: as in the .proto (snake_case, the
    recommended) or Ray's default camelCase."""

    def __init__(self, export_url: str, proto_names: bool = True) -> None:
        super().__init__(export_url, dashboard=True, proto_names=proto_names)

    def run(self, script: str) -> dict[str, Any]:
        return self.driver(str(JOBS / script))

    def state_tasks(self, job: str) -> list[dict[str, Any]]:
        """Ray's State API (``ray.util.state.list_tasks``) for one job, without the driver."""
        assert self.dashboard is not None
        tasks = self.driver(str(JOBS / "state_tasks.py"), self.dashboard, job, timeout=120)
        return [t for t in tasks if t["type"] != "DRIVER_TASK"]


# Module scope: one module uses them, and the cluster should not idle through the rest of
# the suite once that module is done.
@pytest.fixture(scope="module", params=FIELD_NAMES)
def field_names(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def ray_server(
    tmp_path_factory: pytest.TempPathFactory, field_names: str
) -> Iterator[EmbeddedServer]:
    """The Hindsight server Ray exports to (embedded: SQLite and local blobs)."""
    missing = ray_missing()
    if missing:
        pytest.skip(missing)
    server = EmbeddedServer(
        tmp_path_factory.mktemp("hindsight-ray") / "data",
        env={"HINDSIGHT_RAY_SETTLE_SECONDS": str(SETTLE)},
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ray_cluster(ray_server: EmbeddedServer, field_names: str) -> Iterator[RayCluster]:
    cluster = RayCluster(
        f"{ray_server.url}/v1/ray/events?cluster={RAY_CLUSTER}",
        proto_names=field_names == "snake_case",
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def ray_run(server: EmbeddedServer, job: str, timeout: float = 90) -> dict[str, Any]:
    """The run of Ray job ``job`` once it is closed (finished), from the runs list."""

    def closed() -> dict[str, Any] | None:
        for r in server.runs(RAY_CLUSTER):
            if r["run_key"] == job and r["status"] != "running":
                return r
        return None

    return wait_until(closed, timeout, f"Ray job {job} to close")


def wait_quiet(server: EmbeddedServer, run_id: str) -> dict[str, Any]:
    """The run's detail once every task it knows of is written."""

    def done() -> dict[str, Any] | None:
        d = server.get(f"/v1/runs/{run_id}")
        return d if d["completeness"]["tasks"]["not_yet_written"] == 0 else None

    return wait_until(done, 60, "every task of the run to be written")
