"""A run recorded while the collector is down, whose cluster closes before it comes back.

The reproduction from issue 10: collector down, a 500-task run on a LocalCluster, the
cluster closes (its close budget passes), the collector comes back, the next cluster
starts on the same host with the same spool directory: the first run must arrive whole,
and be the same run it would have been on time. The same spool, kept aside (as a volume
would keep it), is also delivered by hand with ``hindsight spool push``.

"On time" is measured, not assumed: while the collector is down, every batch the agents
write to the spool is copied the moment it appears to a twin server, which so holds the
same run recorded live; the late copies are compared with it through the API.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster

from hindsight.agent.spool import SUFFIX, read_file
from hindsight.sender import Sender
from tests.dask.conftest import (
    EmbeddedServer,
    recorded_view,
    stream_view,
    wait_for_run,
    wait_until,
)
from tests.dask.test_faults import CLUSTER_KW, run_map

TASKS = 500
#: Differ by arrival time alone: when the index first and last heard of the run.
# when the server saw and finished it, not facts of the run
ARRIVAL_FIELDS = ("first_seen", "last_seen", "finished_work")


class SpoolMirror:
    """Sends every batch file that appears under a spool root to ``url`` as it appears, in
    each agent's sequence order (the agents' own spool, read, never changed)."""

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.sender = Sender(url)
        self.sent: set[str] = set()
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="spool-mirror")
        self._thread.start()

    def sweep(self) -> None:
        for directory in sorted(self.root.glob("[!.]*")):
            for name in sorted(os.listdir(directory)):
                path = str(directory / name)
                if name.endswith(SUFFIX) and path not in self.sent:
                    batch = read_file(path)
                    assert batch is not None, path
                    answer = self.sender.send(batch.body, encoding=batch.encoding, compressed=True)
                    self.statuses.append(answer.status)
                    self.sent.add(path)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.sweep()

    def stop(self) -> None:
        """Stop watching, then send what the last look missed."""
        self._stop.set()
        self._thread.join(30)
        self.sweep()
        self.sender.close()


def complete(server: EmbeddedServer, run_id: str) -> dict[str, Any]:
    """The run detail once every agent's sequence arrived whole, closed by its final batch."""

    def ready() -> dict[str, Any] | None:
        detail = server.get(f"/v1/runs/{run_id}")
        c = detail["completeness"]
        return detail if c["ratio"] == 1.0 and c["closed"] and len(c["agents"]) == 3 else None

    return wait_until(ready, 60, f"run {run_id} complete")


def views(server: EmbeddedServer, cluster: str, run_id: str) -> dict[str, Any]:
    """What a user reads about the run: detail, per-prefix quantiles, cluster history."""
    detail = server.get(f"/v1/runs/{run_id}")
    for field in ARRIVAL_FIELDS:
        detail.pop(field)
    return {
        "detail": detail,
        "summary": server.get(f"/v1/runs/{run_id}/summary"),
        "prefix_history": server.get("/v1/history/prefixes", prefix="inc", cluster=cluster),
        "cluster_history": server.get("/v1/history/clusters", cluster=cluster, bucket="day"),
    }


def test_a_run_spooled_by_a_closed_cluster_arrives_whole_and_as_if_on_time(tmp_path):
    late = EmbeddedServer(tmp_path / "late")
    twin = EmbeddedServer(tmp_path / "twin")
    pushed = EmbeddedServer(tmp_path / "pushed")
    cluster = f"orphans-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    spool.mkdir()
    config = {
        "hindsight.url": late.url,  # not started yet: the collector is down
        "hindsight.cluster": cluster,
        "hindsight.spool-dir": str(spool),
        "hindsight.close-timeout": 1.0,
    }
    try:
        pushed.launch()  # up while the cluster runs; it first hears of the run by hand
        twin.start()
        mirror = SpoolMirror(spool, twin.url)
        with dask.config.set(config):
            with LocalCluster(**CLUSTER_KW) as lc, Client(lc) as client:
                stream = run_map(client, "late", TASKS)
            mirror.stop()
            assert mirror.statuses and set(mirror.statuses) == {202}
            # The cluster is gone; its three agents' batches are in the spool.
            orphans = sorted(spool.iterdir())
            assert len(orphans) == 3 and all(list(p.glob("*.hsb")) for p in orphans)
            shutil.copytree(spool, tmp_path / "kept")  # what a kept volume would hold

            late.start()  # the collector is back; the next cluster starts on this host
            with LocalCluster(**{**CLUSTER_KW, "n_workers": 1}):
                run = wait_for_run(late, cluster, "late", TASKS)
                complete(late, run["id"])
                wait_until(lambda: not list(spool.iterdir()), 30, "the spool to empty")

        pushed.wait_up()
        result = subprocess.run(
            [sys.executable, "-m", "hindsight.cli", "spool", "push", str(tmp_path / "kept"),
             "--url", pushed.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "3 agent directories" in result.stdout
        assert "0 corrupted files skipped, 0 refused, 0 left on disk" in result.stdout

        # Arrived whole, by either way: every task of Dask's own task stream, once.
        for server in (late, pushed):
            run = wait_for_run(server, cluster, "late", TASKS)
            detail = complete(server, run["id"])
            assert detail["status"] == "finished" and detail["task_count"] == TASKS
            assert recorded_view(server.tasks(run["id"])) == stream_view(stream)
        # And the same run as the one recorded on time.
        assert wait_for_run(twin, cluster, "late", TASKS)["id"] == run["id"]
        on_time = views(twin, cluster, run["id"])
        assert on_time["detail"]["completeness"]["ratio"] == 1.0
        assert on_time["summary"] and on_time["cluster_history"]["points"]
        assert views(late, cluster, run["id"]) == on_time
        assert views(pushed, cluster, run["id"]) == on_time
    finally:
        for server in (late, twin, pushed):
            server.stop()
