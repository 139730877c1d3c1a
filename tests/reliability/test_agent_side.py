"""Agent-side reliability: the close budget is used for retries, corrupted or truncated spool
files met mid-run are skipped and counted without disturbing the agent, and (slow) a live
Dask run outlives a ten-minute collector outage with the spool inside its bound."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from hindsight.agent import Agent
from hindsight.config import Settings
from tests.sdk.fake_collector import FakeCollector


@pytest.fixture
def collector() -> Any:
    fake = FakeCollector()
    yield fake
    fake.stop()


def test_close_keeps_retrying_until_its_budget_is_spent(collector, tmp_path):
    """Regression: close() gave up after one failed attempt, leaving the last batches in the
    spool of an agent that would never run again."""
    collector.script.extend([(503, {"Retry-After": "1"})] * 3)
    agent = Agent(Settings(url=collector.url, spool_dir=str(tmp_path), flush_interval=60),
                  session="s", name="closer")  # fmt: skip
    for i in range(10):
        agent.add({"kind": "custom", "stream": "x", "time": float(i), "value": i})
    agent.close(timeout=20)
    assert agent.pending() == 0
    assert [e.value for e in collector.events()] == list(range(10))
    assert collector.accepted[-1].final
    assert [status for status, _ in collector.requests].count(503) == 3


def _spooled(spool: Path) -> list[Path]:
    # os.walk, not rglob: the agent creates its spool directory under a temporary name and
    # renames it into place, and rglob fails on an entry that vanishes while it walks.
    return sorted(Path(d, f) for d, _, names in os.walk(spool) for f in names if f.endswith(".hsb"))


def test_corrupted_and_truncated_spool_files_are_skipped_and_counted(collector, tmp_path):
    collector.rule = lambda batch: (503, {"Retry-After": "1"})  # down
    agent = Agent(Settings(url=collector.url, spool_dir=str(tmp_path), flush_events=10,
                           flush_interval=0.05), session="s", name="spooler")  # fmt: skip
    for i in range(80):
        agent.add({"kind": "custom", "stream": "x", "time": float(i), "value": i})
    collector.wait_for(lambda: len(_spooled(tmp_path)) >= 8, timeout=30)
    files = _spooled(tmp_path)
    flipped, cut = files[-2], files[-3]
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the body: the checksum no longer matches
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:20])  # truncated inside the header
    lost = sum(int(p.name.split("-")[1].split(".")[0]) for p in (flipped, cut))
    collector.rule = None  # back
    agent.close(timeout=30)

    values = [e.value for e in collector.events()]
    assert len(values) == 80 - lost and len(set(values)) == len(values)  # nothing twice
    assert collector.accepted[-1].final
    assert collector.accepted[-1].dropped.get("spool_corrupt") == lost
    assert agent.pending() == 0


def all_runs(server: Any, cluster: str) -> dict[str, dict[str, Any]]:
    """Every run of ``cluster`` by name, following the cursor (more than one page here)."""
    out: dict[str, dict[str, Any]] = {}
    cursor = None
    while True:
        params: dict[str, Any] = {"cluster": cluster, "limit": 1000}
        if cursor:
            params["cursor"] = cursor
        page = server.get("/v1/runs", **params)
        out.update({r["name"]: r for r in page["runs"]})
        cursor = page.get("next_cursor")
        if not cursor:
            return out


@pytest.mark.slow
def test_collector_down_ten_minutes_during_a_live_dask_run(tmp_path):
    """Issue 6: the collector away for 10 minutes of a live run; the spool stays within its
    bound, everything is delivered after recovery, nothing twice."""
    import dask
    from distributed import Client, LocalCluster

    from tests.dask.conftest import EmbeddedServer, recorded_view, stream_view, wait_until
    from tests.dask.test_faults import CLUSTER_KW, run_map

    server = EmbeddedServer(tmp_path / "data")
    server.start()
    cluster = f"outage10-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    bound = 64 * 2**20
    config = {"hindsight.url": server.url, "hindsight.cluster": cluster,
              "hindsight.spool-dir": str(spool), "hindsight.spool-max-bytes": bound}  # fmt: skip
    streams: dict[str, Any] = {}
    peak = 0
    try:
        with dask.config.set(config), LocalCluster(**CLUSTER_KW) as lc, Client(lc) as client:
            streams["before"] = run_map(client, "before", 200)
            wait_until(lambda: "before" in all_runs(server, cluster), 60, "first run recorded")
            server.stop()
            down_until = time.monotonic() + 600
            i = 0
            while time.monotonic() < down_until:  # the run goes on, one map after another
                streams[f"during-{i}"] = run_map(client, f"during-{i}", 1000, offset=i * 1000)
                for d in spool.glob("*"):  # each agent's spool within the bound
                    size = sum(f.stat().st_size for f in d.glob("*.hsb"))
                    peak = max(peak, size)
                    assert size <= bound
                i += 1
            server.start()
            streams["after"] = run_map(client, "after", 200)

            def delivered() -> bool:
                runs = all_runs(server, cluster)
                return all(
                    name in runs and runs[name]["task_count"] == len(stream)
                    and runs[name]["status"] == "finished"
                    for name, stream in streams.items()
                )  # fmt: skip

            wait_until(delivered, 600, "every run delivered after the outage")
        runs = all_runs(server, cluster)
        # Records equal Dask's own task stream (nothing lost, nothing twice), for a sample
        # of runs across the outage: first, every 25th, last.
        names = list(streams)
        for name in names[:2] + names[2:-1:25] + names[-2:]:
            assert recorded_view(server.tasks(runs[name]["id"])) == stream_view(streams[name])
        detail = server.get(f"/v1/runs/{runs['after']['id']}")["completeness"]
        assert detail["ratio"] == 1.0 and detail["closed"], detail
        assert detail["events_dropped_at_agents"] == 0
        assert not list(spool.rglob("*.hsb"))
        print(f"outage: {i} maps ({i * 1000} tasks) during 600 s, "
              f"peak spool {peak / 2**20:.1f} MiB of {bound / 2**20:.0f} MiB")  # fmt: skip
    finally:
        server.stop()
