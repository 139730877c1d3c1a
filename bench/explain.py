"""The explanation of a run whose job has 1,000 runs of history: how long
``storage.query.explain.compute`` takes on Postgres (target: 200 ms).

The job's runs are written as the index holds them after ingest (runs, their prefixes,
compute durations and histograms, fine performance metrics, the session's versions and
workers): one job of 4 prefixes x 200 tasks a run, with +-15% noise in its makespans, and
its last run 1.8x slower in one prefix. The explanation reads the last 80 runs' makespans
and the facts of up to 20 baseline runs; profiles are not written here (a run without a
stored profile has no profile findings), so their read is not in the figure.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
import uuid

import numpy as np
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from bench.lib_results import report
from storage.analysis import sketch
from storage.core import models as m
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.query import explain

DEFAULT_DB = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
TARGET_MS = 200.0
PREFIXES = ("load", "clean", "enrich", "write")
ACTIVITIES = ("thread-cpu", "thread-noncpu", "deserialize", "transfer")


def populate(sessions: object, runs: int, seed: int = 0) -> int:
    """``runs`` runs of one job; returns the last run's id."""
    rng = np.random.default_rng(seed)
    with sessions() as db:  # type: ignore[operator]
        now = time.time() - runs * 3600
        tenant = m.Tenant(name="bench", created_at=now)
        db.add(tenant)
        db.flush()
        cluster = m.Cluster(tenant_id=tenant.id, name="nightly", first_seen=now, last_seen=now)
        db.add(cluster)
        db.flush()
        rows: dict[type, list[dict]] = {
            m.RunPrefix: [],
            m.RunPrefixAction: [],
            m.RunPrefixHist: [],
            m.RunActivity: [],
            m.Worker: [],
        }
        last = 0
        for i in range(runs):
            t0 = now + i * 3600
            sess = m.Session(
                cluster_id=cluster.id,
                name=f"Scheduler-{i}",
                first_seen=t0,
                last_seen=t0,
                info={"versions": {"python": "3.11.9", "dask": "2025.1.0"}},
            )
            db.add(sess)
            db.flush()
            slow = 1.8 if i == runs - 1 else 1.0
            span = 60.0 * (1 + rng.uniform(-0.15, 0.15)) * slow
            run = m.Run(
                public_id=str(uuid.uuid4()),
                tenant_id=tenant.id,
                cluster_id=cluster.id,
                session_id=sess.id,
                run_key=f"k{i}",
                name="etl",
                status="finished",
                started_at=t0,
                finished_at=t0 + span,
                task_start=t0,
                task_stop=t0 + span,
                task_count=800,
                first_seen=t0,
                last_seen=t0 + span,
            )
            db.add(run)
            db.flush()
            last = run.id
            for w in range(4):
                rows[m.Worker].append(
                    {
                        "session_id": sess.id,
                        "address": f"tcp://10.0.0.{w}:1",
                        "nthreads": 2,
                        "memory_limit": 8 << 30,
                        "joined_at": t0 - 1,
                    }
                )
            for p in PREFIXES:
                factor = slow if p == "enrich" else 1.0
                d = rng.lognormal(np.log(0.3 * factor), 0.2, 200)
                rows[m.RunPrefix].append(
                    {"run_id": run.id, "prefix": p, "count": 200, "errors": 0, "nbytes": 1 << 20}
                )
                rows[m.RunPrefixAction].append(
                    {
                        "run_id": run.id,
                        "prefix": p,
                        "action": "compute",
                        "count": 200,
                        "total": float(d.sum()),
                        "min": float(d.min()),
                        "max": float(d.max()),
                    }
                )
                hist: dict[str, int] = {}
                for b in sketch.buckets(d):
                    hist[str(int(b))] = hist.get(str(int(b)), 0) + 1
                rows[m.RunPrefixHist].append(
                    {
                        "run_id": run.id,
                        "prefix": p,
                        "action": "compute",
                        "batch_id": 0,
                        "buckets": hist,
                    }
                )
                for a in ACTIVITIES:
                    share = {"thread-cpu": 0.7, "thread-noncpu": 0.2}.get(a, 0.05)
                    rows[m.RunActivity].append(
                        {
                            "run_id": run.id,
                            "context": "execute",
                            "prefix": p,
                            "activity": a,
                            "unit": "seconds",
                            "value": float(d.sum()) * share,
                            "time": t0 + span,
                        }
                    )
        for model, values in rows.items():
            db.execute(insert(model), values)
        db.commit()
        return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="runs in the job's history")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--database-url", default=DEFAULT_DB)
    args = ap.parse_args()
    admin_url = make_url(args.database_url)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"hindsight_explain_{secrets.token_hex(3)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = None
    try:
        engine = make_engine(admin_url.set(database=name).render_as_string(hide_password=False))
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        t = time.perf_counter()
        last = populate(sessions, args.runs)
        print(f"wrote {args.runs} runs in {time.perf_counter() - t:.1f} s", flush=True)
        took, out = [], None
        for _ in range(args.rounds):
            with sessions() as db:
                run = db.get(m.Run, last)
                assert run is not None
                t = time.perf_counter()
                out = explain.compute(db, None, run)
                took.append((time.perf_counter() - t) * 1000)
        assert out is not None
        ms = statistics.median(took)
        print(f"explain: median {ms:.1f} ms over {args.rounds} rounds ({min(took):.1f} best)")
        print(out["text"])
        named = [f["prefix"] for f in out["findings"] if f["kind"] == "step"]
        figures = {
            "runs": args.runs,
            "explain_ms_median": round(ms, 1),
            "explain_ms_best": round(min(took), 1),
            "verdict": out["verdict"],
            "baseline_n": out["baseline"]["n"],
            "top_step": named[0] if named else None,
        }
        met = ms <= TARGET_MS and out["verdict"] == "slower" and figures["top_step"] == "enrich"
        report("explain", figures, {"explain_ms_median": f"<= {TARGET_MS:g}"}, met)
        return 0 if met else 1
    finally:
        if engine is not None:
            engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))


if __name__ == "__main__":
    sys.exit(main())
