"""Fault runs at scale: the real collector under gunicorn, Postgres (a fresh database),
moto's S3 server, and several real agents sending ≥1,000,000 events while a fault is
injected, then the exactly-once audit (bench/lib_faults.py).

Scenarios:
- ``kill``: kill -9 a random gunicorn worker every 1-3 s for the whole run;
- ``s3``: the blob store behind a proxy failing ~70% of requests (500, 503, reset, answer lost);
- ``pg-restart``: ``pg_ctlcluster ... restart`` of the local Postgres once a third of the
  events are in (disturbs anything else using that server: run it alone).

    .venv/bin/python -m bench.faults_run [kill|s3|pg-restart ...] [--agents 4] [--events 250000]

Prints one figure line per scenario, then one JSON line with every scenario's audit (its
``problems`` must be empty); exits non-zero if an audit fails.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.lib_faults import (
    FlakyS3Proxy,
    Gunicorn,
    Load,
    audit,
    collector_env,
    fresh_database,
    http_ok,
    make_bucket,
    make_token,
    moto_server,
    wait_until,
)
from bench.lib_results import report

TARGETS = {"problems": 0}
ADMIN_URL = os.environ.get(
    "TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def restart_postgres() -> None:
    versions = sorted(os.listdir("/etc/postgresql"))
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart"],
        check=True,
        timeout=120,
    )


def run_scenario(scenario: str, agents: int = 4, events_each: int = 250_000) -> dict[str, Any]:
    """Run one scenario end to end; the audit's result with the run's figures."""
    from storage.core.blobs import open_blob_store

    tenant = f"faults-{scenario}"
    with (
        moto_server() as s3,
        fresh_database(ADMIN_URL) as db_url,
        tempfile.TemporaryDirectory() as tmp,
    ):
        blob_url = f"s3://{make_bucket(s3)}/h"
        proxy = FlakyS3Proxy(s3, fail_rate=0.7, seed=1) if scenario == "s3" else None
        server = Gunicorn(collector_env(db_url, blob_url, proxy.url if proxy else s3))
        token = make_token(db_url, tenant)
        load = Load(
            server.url,
            token,
            agents=agents,
            events_each=events_each,
            spool_dir=str(Path(tmp) / "spool"),
        )
        sent: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: sent.update(load.run(timeout=1800)))
        faults: dict[str, Any] = {}
        peak_rss = 0
        t0 = time.monotonic()
        runner.start()
        try:
            wait_until(lambda: len(load.made) == agents, 60, "agents started")
            total = agents * events_each
            acked = lambda: sum(a.stats["sent_events"] for a in load.made)  # noqa: E731
            if scenario == "kill":
                rng, kills = random.Random(6), []
                while runner.is_alive():
                    runner.join(rng.uniform(1.0, 3.0))
                    wait_until(
                        lambda: len(server.workers()) >= 2 or not runner.is_alive(),
                        60,
                        "gunicorn replaced its worker",
                    )
                    peak_rss = max(peak_rss, server.rss())
                    if runner.is_alive() and (pid := server.kill_worker(rng)):
                        kills.append(pid)
                faults["workers_killed"] = len(kills)
            elif scenario == "pg-restart":
                wait_until(lambda: acked() >= total // 3, 900, "a third of the events in")
                t_restart = time.monotonic()
                restart_postgres()
                wait_until(lambda: http_ok(server.url + "/readyz"), 120, "index back")
                faults["postgres_restarts"] = 1
                faults["restart_to_ready_s"] = round(time.monotonic() - t_restart, 1)
            while runner.is_alive():
                peak_rss = max(peak_rss, server.rss())
                runner.join(0.5)
        finally:
            runner.join(1900)
            elapsed = time.monotonic() - t0
            server.stop()
            if proxy:
                proxy.close()
                faults["s3_requests"] = dict(proxy.counts)
        result = audit(db_url, open_blob_store(blob_url, endpoint_url=s3), tenant, sent)
    result.update(
        scenario=scenario,
        seconds=round(elapsed, 1),
        events_per_s=round(result["events"] / elapsed),
        collector_peak_rss_mb=round(peak_rss / 2**20, 1),
        **faults,
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenarios", nargs="*", default=["kill", "s3"])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--events", type=int, default=250_000, help="events per agent")
    args = ap.parse_args()
    results = {}
    for scenario in args.scenarios:
        print(f"== {scenario}: {args.agents} agents x {args.events:,} events", flush=True)
        result = run_scenario(scenario, args.agents, args.events)
        status = "OK" if not result["problems"] else "FAILED"
        print(
            f"{status}: {result['events']:,} events in {result['batches']} batches, "
            f"{result['seconds']} s ({result['events_per_s']:,} events/s), "
            f"{result['retries']} agent retries; every acknowledged batch stored and "
            f"indexed exactly once: {not result['problems']}"
        )
        for p in result["problems"][:20]:
            print("  ", p)
        results[scenario] = result
    met = not any(r["problems"] for r in results.values())
    report("faults_run", results, TARGETS, met)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
