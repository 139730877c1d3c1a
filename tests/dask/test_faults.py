"""The collector misbehaving never disturbs the run: down and back, 400, 413, 500."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
import uuid
from typing import Any

import dask
import pytest
from distributed import Client, Event, LocalCluster, get_task_stream, span

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


def wait_for_gate(gate: str, i: int) -> int:
    Event(gate).wait(60)
    return i


def test_a_run_whose_collector_died_mid_run_is_never_shown_complete(tmp_path):
    # Nothing heard from a run's agents for 1 s reads as silent (60 s by default).
    server = EmbeddedServer(tmp_path / "data", env={"HINDSIGHT_SILENT_AGENTS_SECONDS": "1"})
    server.start()
    cluster = f"died-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    config = {
        "hindsight.url": server.url,
        "hindsight.cluster": cluster,
        "hindsight.spool-dir": str(spool),
        "hindsight.close-timeout": 1.0,
    }
    quick, gated = 20, 2
    try:
        with dask.config.set(config), LocalCluster(**{**CLUSTER_KW, "threads_per_worker": 2}) as lc:
            with Client(lc) as client:
                gate = Event(f"gate-{cluster}", client=client)
                with span("outage"):
                    # Submitted at once, so the run cannot end between them; the gated two
                    # hold two of the four threads at most.
                    first = client.map(inc, range(quick), key=[f"q-{i}" for i in range(quick)])
                    last = client.map(
                        wait_for_gate, [gate.name] * gated, range(gated),
                        key=[f"g-{i}" for i in range(gated)],
                    )  # fmt: skip
                client.gather(first)
                wait_for_run(server, cluster, "outage", quick, status="running")
                server.proc.kill()  # kill -9: the collector dies mid-run
                server.proc.wait(30)
                server.proc = None
                gate.set()
                assert client.gather(last) == list(range(gated))
        # The cluster closed with the run's end and last tasks in its agents' spool.
        assert list(spool.rglob("*.hsb"))

        server.start()  # the collector is back; those batches are not
        run = server.run_named(cluster, "outage")
        assert run is not None

        def silent() -> dict[str, Any] | None:
            detail = server.get(f"/v1/runs/{run['id']}")
            return detail if detail["completeness"]["silent_since"] else None

        detail = wait_until(silent, 30, "the run's agents to read as silent")
        assert detail["status"] == "running" and detail["task_count"] == quick
        page = server.http.get(f"{server.url}/runs/{run['id']}", timeout=30).text
        line = re.search(r"<span>completeness</span>(.*?)</div>", page, re.S)
        assert line, "the run page has a completeness line"
        assert "incomplete: agents silent since" in line[1] and "hindsight spool push" in line[1]
        assert "% of batches" not in line[1]

        # What the page tells the user to do makes the run whole.
        pushed = subprocess.run(
            [sys.executable, "-m", "hindsight.cli", "spool", "push", str(spool),
             "--url", server.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        run = wait_for_run(server, cluster, "outage", quick + gated)
        whole = server.get(f"/v1/runs/{run['id']}")["completeness"]
        assert whole["silent_since"] is None and whole["ratio"] == 1.0, whole
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
