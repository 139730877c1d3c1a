"""The collector misbehaving never disturbs the run: down and back, 400, 413, 500."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster, get_task_stream, span

from hindsight.schema import TaskEvent
from tests.dask.conftest import (
    EmbeddedServer,
    free_port,
    recorded_view,
    stream_view,
    wait_for_run,
    wait_until,
)
from tests.sdk.fake_collector import FakeCollector

CLUSTER_KW: dict[str, Any] = dict(
    n_workers=2,
    threads_per_worker=1,
    processes=True,
    dashboard_address=":0",
    worker_dashboard_address=":0",
    scheduler_kwargs={"preload": ["hindsight.dask"]},
)


def inc(i: int) -> int:
    return i + 1


def run_map(client: Client, name: str, n: int, offset: int = 0) -> list[dict[str, Any]]:
    with span(name), get_task_stream(client) as ts:
        futures = client.map(inc, range(offset, offset + n), key=[f"{name}-{i}" for i in range(n)])
        assert client.gather(futures) == [i + 1 for i in range(offset, offset + n)]
    del futures
    return ts.data


def test_collector_down_then_back_everything_arrives_once(tmp_path):
    server = EmbeddedServer(tmp_path / "data")
    server.start()
    cluster = f"outage-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": server.url,
        "hindsight.cluster": cluster,
        "hindsight.spool-dir": str(tmp_path / "spool"),
    }
    try:
        with dask.config.set(config), LocalCluster(**CLUSTER_KW) as lc, Client(lc) as client:
            before = run_map(client, "before", 100)
            wait_for_run(server, cluster, "before", len(before))
            server.stop()
            during = run_map(
                client, "during", 300
            )  # completes normally while the collector is away
            spool = tmp_path / "spool"
            wait_until(lambda: list(spool.rglob("*.hsb")), 30, "batches in the spool")
            server.start()
            after = run_map(client, "after", 100)
            for name, stream in (("before", before), ("during", during), ("after", after)):
                run = wait_for_run(server, cluster, name, len(stream))
                assert recorded_view(server.tasks(run["id"])) == stream_view(stream)
        # After a clean close every agent's sequence is complete and nothing was dropped.
        detail = server.get(f"/v1/runs/{run['id']}")["completeness"]
        assert detail["ratio"] == 1.0 and detail["closed"], detail
        assert detail["events_dropped_at_agents"] == 0
        assert not list((tmp_path / "spool").rglob("*.hsb"))
    finally:
        server.stop()


@pytest.mark.parametrize("status", [400, 500])
def test_collector_rejecting_batches_does_not_disturb_the_run(tmp_path, caplog, status):
    fake = FakeCollector()
    # Reject every batch that carries task records; accept the rest (so counts arrive).
    fake.rule = lambda b: (status, {}) if any(type(e) is TaskEvent for e in b.events) else None
    config = {"hindsight.url": fake.url, "hindsight.cluster": "rejecting"}
    try:
        with dask.config.set(config), LocalCluster(**CLUSTER_KW) as lc, Client(lc) as client:
            start = time.monotonic()
            stream = run_map(client, "rejected", 200)
            assert time.monotonic() - start < 30
        scheduler_batches = [b for b in fake.accepted if b.agent.startswith("scheduler-")]
        final = max(scheduler_batches, key=lambda b: b.seq)
        assert final.final
        assert final.dropped.get(f"http_{status}", 0) >= len(stream)
        assert f"HTTP {status}" in caplog.text
        rejected = [b for s, b in fake.requests if s == status]
        assert len({b.batch_id for b in rejected}) == len(rejected), "a rejected batch was retried"
    finally:
        fake.stop()


def test_too_large_batches_are_split_and_all_arrive(tmp_path):
    fake = FakeCollector()
    fake.rule = lambda b: (413, {}) if len(b.events) > 25 else None
    config = {"hindsight.url": fake.url, "hindsight.cluster": "small-limit"}
    try:
        with dask.config.set(config), LocalCluster(**CLUSTER_KW) as lc, Client(lc) as client:
            stream = run_map(client, "split", 200)
        keys = [e.key for b in fake.accepted for e in b.events if type(e) is TaskEvent]
        assert sorted(keys) == sorted(str(r["key"]) for r in stream)
        assert any(s == 413 for s, _ in fake.requests)
        for agent in {b.agent for b in fake.accepted}:
            seqs = sorted(b.seq for b in fake.accepted if b.agent == agent)
            assert seqs == list(range(len(seqs))), agent
    finally:
        fake.stop()


def test_unreachable_collector_costs_nothing_but_the_close_budget(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hindsight")
    config = {
        "hindsight.url": f"http://127.0.0.1:{free_port()}",
        "hindsight.cluster": "nowhere",
        "hindsight.close-timeout": 1.0,
        "hindsight.spool-dir": str(tmp_path / "spool"),
    }
    with dask.config.set(config), LocalCluster(**CLUSTER_KW) as lc, Client(lc) as client:
        run_map(client, "unsent", 100)
        start = time.monotonic()
    assert time.monotonic() - start < 15
    assert "collector unavailable" in caplog.text
