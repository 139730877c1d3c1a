"""A real embedded Hindsight server (``hindsight serve``) in a subprocess, and a LocalCluster
with worker processes recording into it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Api:
    """The read API at ``url`` (a token if it needs one), as the tests read it."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.http = requests.Session()
        if token:
            self.http.headers["Authorization"] = f"Bearer {token}"

    def get(self, path: str, **params: Any) -> Any:
        resp = self.http.get(f"{self.url}{path}", params=params, timeout=30)
        resp.raise_for_status()
        return resp.json()

    def runs(self, cluster: str) -> list[dict[str, Any]]:
        return self.get("/v1/runs", cluster=cluster, limit=1000)["runs"]

    def run_named(self, cluster: str, name: str) -> dict[str, Any] | None:
        found = [r for r in self.runs(cluster) if r.get("name") == name]
        assert len(found) <= 1, found
        return found[0] if found else None

    def tasks(self, run_id: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 10000}
            if cursor:
                params["cursor"] = cursor
            page = self.get(f"/v1/runs/{run_id}/tasks", **params)
            out.extend(page["tasks"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out


class EmbeddedServer(Api):
    """``hindsight serve`` on a fixed loopback port; can be stopped and started again."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.env = env or {}
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.launch()
        self.wait_up()

    def launch(self) -> None:
        """Start the process without waiting for it to answer (see :meth:`wait_up`)."""
        log = open(self.data_dir.parent / f"serve-{self.port}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hindsight.cli", "serve", "--data-dir", str(self.data_dir),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "HINDSIGHT_AUTH": "disabled", **self.env},
        )  # fmt: skip
        log.close()

    def wait_up(self) -> None:
        def up() -> bool:
            try:
                return self.http.get(f"{self.url}/v1/runs", timeout=1).status_code == 200
            except (requests.ConnectionError, requests.Timeout):  # not listening, or starting
                assert self.proc is not None and self.proc.poll() is None, "server died"
                return False

        wait_until(up, 60, "hindsight serve to answer")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
            self.proc = None
        self.http.close()


@pytest.fixture(scope="session")
def hindsight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("hindsight") / "data")
    server.start()
    yield server
    server.stop()


def stored_events(server: EmbeddedServer, cluster: str) -> list[Any]:
    """Every event the collector durably stored for ``cluster`` (read from its blob store),
    for what the read API does not serve yet (graph edges, metrics, custom streams)."""
    import zstandard

    from hindsight.schema import decode_batch

    root = server.data_dir / "blobs" / "v1" / "default" / cluster
    events: list[Any] = []
    for path in sorted(root.rglob("*.json.zst")):
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
        events.extend(decode_batch(raw).events)
    return events


def compute_record(startstops: list[dict[str, Any]]) -> tuple[float, float] | None:
    for s in startstops:
        if s["action"] == "compute":
            return (s["start"], s["stop"])
    return None


def stream_view(records: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """Dask's task stream as {key: (status, worker, compute start/stop)}."""
    status = {"OK": "memory", "error": "erred"}
    return {
        str(r["key"]): (status[r["status"]], r["worker"], compute_record(list(r["startstops"])))
        for r in records
    }


def recorded_view(tasks: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """Hindsight's task records in the same shape; fails on a key recorded twice."""
    out = {t["key"]: (t["status"], t["worker"], compute_record(t["startstops"])) for t in tasks}
    assert len(out) == len(tasks), "a task was recorded twice"
    return out


def wait_for_run(
    server: Api,
    cluster: str,
    name: str,
    tasks: int,
    status: str = "finished",
    timeout: float = 60,
) -> dict[str, Any]:
    """Poll the read API until run ``name`` has ``tasks`` task records and ``status``."""

    def ready() -> dict[str, Any] | None:
        run = server.run_named(cluster, name)
        if run and run["task_count"] >= tasks and run["status"] == status:
            return run
        return None

    try:
        return wait_until(ready, timeout, f"run {name!r} with {tasks} tasks, {status}")
    except AssertionError:
        raise AssertionError(f"run never got there: {server.runs(cluster)}") from None
