"""Faults during sustained ingest from several real agents, checked end to end: every
batch an agent had acknowledged is in the blob store and in the index exactly once, every
sequence is complete, nothing is pending or dropped.

Fast versions (seconds) run in the normal suite; bench/faults_run.py runs them at
1,000,000+ events (``make test-slow`` runs it through test_faults_at_scale).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from bench.lib_faults import (
    FlakyS3Proxy,
    Gunicorn,
    Load,
    audit,
    collector_env,
    make_token,
    wait_until,
)
from storage.core.blobs import open_blob_store
from tests.conftest import make_bucket, new_tenant
from tests.helpers import TcpProxy


def in_process_collector(serve: Any, **settings: Any) -> str:
    from collector.app import create_app

    return serve(create_app({"auth": "required", "retry_after": 1, "access_log": False,
                             "finish_worker": False,
                             **settings}))  # fmt: skip


def test_blob_store_failing_70_percent_sent_equals_stored(pg_url, moto_endpoint, serve, tmp_path):
    """An S3 endpoint that answers 500/503, resets, or loses the answer to a write it made,
    on ~70% of requests: the agents' retries deliver everything, stored once."""
    proxy = FlakyS3Proxy(moto_endpoint, fail_rate=0.7, seed=6)
    try:
        blob_url = f"s3://{make_bucket(moto_endpoint)}/h"
        tenant = new_tenant()
        url = in_process_collector(serve, database_url=pg_url, blob_url=blob_url,
                                   s3_endpoint_url=proxy.url, data_dir=str(tmp_path))  # fmt: skip
        load = Load(url, make_token(pg_url, tenant), agents=3, events_each=4_000,
                    spool_dir=str(tmp_path / "spool"), flush_events=1000)  # fmt: skip
        sent = load.run(timeout=120)
    finally:
        proxy.close()
    result = audit(pg_url, open_blob_store(blob_url, endpoint_url=moto_endpoint), tenant, sent)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["events"] == 12_000
    assert proxy.counts["lost"] > 0 and proxy.counts["500"] > 0  # the faults really happened
    assert result["retries"] > 0


def test_index_connection_cut_mid_ingest_then_restored(pg_url, moto_endpoint, serve, tmp_path):
    """Postgres unreachable mid-ingest (every connection broken, new ones refused) until the
    agents have been turned away several times, then back: everything arrives once."""
    from sqlalchemy.engine import make_url

    pg = make_url(pg_url)
    tcp = TcpProxy(pg.host or "127.0.0.1", pg.port or 5432)
    try:
        via_proxy = pg.set(host="127.0.0.1", port=tcp.port).render_as_string(hide_password=False)
        blob_url = f"s3://{make_bucket(moto_endpoint)}/h"
        tenant = new_tenant()
        token = make_token(pg_url, tenant)
        url = in_process_collector(serve, database_url=via_proxy, blob_url=blob_url,
                                   s3_endpoint_url=moto_endpoint, data_dir=str(tmp_path))  # fmt: skip
        load = Load(url, token, agents=3, events_each=20_000,
                    spool_dir=str(tmp_path / "spool"), flush_events=1000)  # fmt: skip
        outcome: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: outcome.update(load.run(timeout=120)))
        runner.start()
        wait_until(lambda: sum(a.stats["sent_batches"] for a in load.made) >= 6, 60, "ingest going")
        tcp.cut()
        wait_until(
            lambda: sum(a.stats["retries"] for a in load.made) >= 6, 60, "agents turned away"
        )
        tcp.restore()
        runner.join(150)
        assert not runner.is_alive()
    finally:
        tcp.close()
    result = audit(pg_url, open_blob_store(blob_url, endpoint_url=moto_endpoint), tenant, outcome)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["events"] == 60_000 and result["retries"] >= 6


def test_kill_9_gunicorn_workers_during_ingest(pg_url, moto_endpoint, tmp_path):
    """kill -9 a gunicorn worker every few hundred milliseconds while three agents send:
    requests die mid-body, mid-PUT and between the PUT and the index commit."""
    bucket = make_bucket(moto_endpoint)
    blob_url = f"s3://{bucket}/h"
    tenant = new_tenant()
    token = make_token(pg_url, tenant)
    server = Gunicorn(collector_env(pg_url, blob_url, moto_endpoint), workers=2, threads=4)
    kills: list[int] = []
    try:
        load = Load(server.url, token, agents=3, events_each=60_000,
                    spool_dir=str(tmp_path / "spool"), flush_events=2000)  # fmt: skip
        outcome: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: outcome.update(load.run(timeout=180)))
        runner.start()
        rng = random.Random(9)
        stop = threading.Event()
        while runner.is_alive() and len(kills) < 12:
            # Poll for the master's replacement worker rather than sleeping a fixed time.
            wait_until(lambda: len(server.workers()) == 2 or not runner.is_alive(), 30,
                       "gunicorn replaced its worker")  # fmt: skip
            if stop.wait(rng.uniform(0.2, 0.6)) or not runner.is_alive():
                break
            pid = server.kill_worker(rng)
            if pid:
                kills.append(pid)
        runner.join(200)
        assert not runner.is_alive()
    finally:
        server.stop()
    assert len(kills) >= 3, kills
    result = audit(pg_url, open_blob_store(blob_url, endpoint_url=moto_endpoint), tenant, outcome)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["events"] == 180_000


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["kill", "s3", "pg-restart"])
def test_faults_at_scale(scenario):
    """The full runs: ≥1,000,000 events per scenario (bench/faults_run.py prints figures)."""
    from bench.faults_run import run_scenario

    result = run_scenario(scenario, agents=4, events_each=250_000)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["events"] >= 1_000_000
