"""Query benchmark: a realistic synthetic history in Postgres, read through the real query
service (Flask app, Postgres index, local blob store).

The generator loads 100,000 runs over 50 clusters (one run per cluster per hour, 20 job
templates of 4-6 prefixes each, every index rollup a real ingest would write: prefixes,
per-action totals, duration histograms of ~10 buckets, workers, hourly cluster rollups) with
COPY, and one run of 1,000,000 Dask-shaped task records through the real ingest path
(zstd batches in the blob store, ``index_batch``). Then it measures:

- ``run_list_p95_ms``: ``GET /v1/runs`` with a mix of filters, cursors and sorts, p95;
- ``run_tasks_cold_s``: the 1M-task run read in full into a DataFrame (what
  ``hindsight.Client.tasks`` does: ``GET /v1/runs/{id}/tasks.parquet``) with empty
  process caches, its compacted copy already written;
- ``run_tasks_page_ms``: one page (1,000 tasks) of it, caches empty;
- ``prefix_history_ms``: ``GET /v1/history/prefixes?bucket=day`` across all clusters over
  a window holding 10,000 runs (median; the ``prefix_days`` rollup), and the same by hour
  (merging the 10,000 runs' histograms) without a target;
- ``profile_ms``: ``GET /v1/profiles?prefix=read-parquet`` merging the stored profiles of
  100 runs (median; each run's tree of that prefix has ~2,000 frames, as deep pandas/pyarrow
  stacks give, out of a shared code base so the merge is realistic);
- ``state_at_ms``: ``GET /v1/runs/{id}/state?at=`` (replay) of the 1M-task run at its
  midpoint (median, caches empty); the run carries a ``state`` sample every second, as
  the scheduler agent sends at the default sampling interval (16 workers, 10 prefixes);
- and, without targets: compacting the 1M-task run from its raw batches, and streaming it
  in full as NDJSON.

    .venv/bin/python -m bench.query [--runs 100000] [--big-tasks 1000000]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd
import zstandard
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.lib_results import report
from bench.lib_workload import NAMES, task_events
from hindsight.schema import decode_batch
from services.query.app import create_app
from storage.analysis import sketch
from storage.core.batches import run_public_id
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token
from storage.ingest.writer import index_batch

TARGETS = {
    "run_list_p95_ms": 50,
    "run_tasks_cold_s": 1.0,
    "run_tasks_page_ms": 300,
    "prefix_history_ms": 200,
    "profile_ms": 500,
    "state_at_ms": 300,
}
T0 = 1_780_000_000.0
TENANT = "bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def copy(conn: Any, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    """COPY rows in (tab-separated; \\N is NULL)."""
    buf = io.StringIO()
    for row in rows:
        buf.write("\t".join("\\N" if v is None else str(v) for v in row))
        buf.write("\n")
    buf.seek(0)
    with conn.cursor() as cur:
        cur.copy_expert(f"COPY {table} ({', '.join(columns)}) FROM STDIN", buf)


def generate_history(
    engine: Any, tenant_id: int, n_runs: int, n_clusters: int, seed: int = 0
) -> None:
    rng = random.Random(seed)
    templates = [["read-parquet", *rng.sample(NAMES[1:], rng.randint(3, 5))] for _ in range(20)]
    clusters = [(i + 1, tenant_id, f"cluster-{i:02d}", T0, T0) for i in range(n_clusters)]
    sessions_per_cluster = 20
    runs_per_cluster = n_runs // n_clusters
    sessions = [
        (c * sessions_per_cluster + s + 1, c + 1, f"Scheduler-{c}-{s}", T0, T0, None)
        for c in range(n_clusters)
        for s in range(sessions_per_cluster)
    ]
    runs, prefixes, actions, hists, workers, ch, statuses = [], [], [], [], [], [], []
    days: dict[tuple[int, str, int], list[Any]] = {}
    for i in range(n_runs):
        rid = i + 1
        c = i % n_clusters
        hour_i = i // n_clusters
        session = c * sessions_per_cluster + hour_i * sessions_per_cluster // runs_per_cluster + 1
        t = T0 + hour_i * 3600 + rng.random() * 600
        tmpl = rng.randrange(len(templates))
        n_tasks = 0
        errors = 1 if rng.random() < 0.03 else 0
        status = "erred" if errors else ("running" if rng.random() < 0.01 else "finished")
        makespan = rng.uniform(5, 600)
        hour = int(t // 3600)
        compute_total = 0.0
        nbytes = 0
        for p in templates[tmpl]:
            count = rng.randint(50, 2000)
            n_tasks += count
            mean = rng.uniform(0.01, 2.0) * (1.2 if i % 97 == 0 else 1.0)
            total = count * mean
            compute_total += total
            nb = count * rng.randint(1000, 10_000_000)
            nbytes += nb
            prefixes.append((rid, p, count, errors if p == "read-parquet" else 0, nb))
            actions.append((rid, p, "compute", count, total, mean / 10, mean * 5))
            center = sketch.bucket(mean)
            # ~10 occupied buckets (a spread of x10 around the mean), as real prefixes show
            weights = [1, 2, 4, 7, 9, 8, 6, 4, 2, 1]
            split = [count * w // sum(weights) for w in weights]
            split[4] += count - sum(split)
            buckets = {str(center + 3 * (k - 4)): n for k, n in enumerate(split) if n}
            hists.append((rid, p, "compute", json.dumps(buckets)))
            day = days.setdefault((c + 1, p, int(t // 86400)), [{}, 0, 0.0, 0.0])
            for b, n in buckets.items():
                day[0][int(b)] = day[0].get(int(b), 0) + n
            day[1] += count
            day[2] += total
            day[3] = max(day[3], mean * 5)
        for w in range(4):
            workers.append(
                (
                    rid,
                    f"tcp://10.{c}.0.{w}:4000",
                    n_tasks // 4,
                    0,
                    compute_total / 4,
                    compute_total / 40,
                    0.0,
                    0.0,
                    0.0,
                    t,
                    t + makespan,
                )
            )
        ch.append((c + 1, hour, n_tasks, errors, compute_total, compute_total / 10, 0.0, nbytes))
        statuses.append((rid, "memory", n_tasks - errors))
        if errors:
            statuses.append((rid, "erred", errors))
        name = f"job-{tmpl:02d}"
        runs.append(
            (
                rid,
                run_public_id(TENANT, f"cluster-{c:02d}", f"Scheduler-{c}", f"run-{i}"),
                tenant_id,
                c + 1,
                session,
                f"run-{i}",
                name,
                None,
                "client-1",
                status,
                t,
                None if status == "running" else t + makespan + 1,
                t + 0.5,
                t + 0.5 + makespan,
                n_tasks,
                errors,
                n_tasks,
                nbytes,
                t,
                t + makespan,
            )
        )
        if (i + 1) % 20_000 == 0:
            log(f"  generated {i + 1:,} runs")
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        log("  COPY clusters, sessions, runs ...")
        copy(conn, "clusters", ["id", "tenant_id", "name", "first_seen", "last_seen"], clusters)
        copy(
            conn,
            "sessions",
            ["id", "cluster_id", "name", "first_seen", "last_seen", "info"],
            sessions,
        )
        copy(
            conn,
            "runs",
            [
                "id",
                "public_id",
                "tenant_id",
                "cluster_id",
                "session_id",
                "run_key",
                "name",
                "span",
                "client",
                "status",
                "started_at",
                "finished_at",
                "task_start",
                "task_stop",
                "task_count",
                "error_count",
                "graph_count",
                "nbytes",
                "first_seen",
                "last_seen",
            ],
            runs,
        )
        log(f"  COPY {len(prefixes):,} prefixes, {len(hists):,} histogram rows, rollups ...")
        copy(conn, "run_status_counts", ["run_id", "status", "count"], statuses)
        copy(conn, "run_prefixes", ["run_id", "prefix", "count", "errors", "nbytes"], prefixes)
        copy(
            conn,
            "run_prefix_actions",
            ["run_id", "prefix", "action", "count", "total", "min", "max"],
            actions,
        )
        copy(conn, "run_prefix_hist", ["run_id", "prefix", "action", "buckets"], hists)
        copy(
            conn,
            "run_workers",
            [
                "run_id",
                "worker",
                "tasks",
                "errors",
                "compute",
                "transfer",
                "disk_read",
                "disk_write",
                "other",
                "first_start",
                "last_stop",
            ],
            workers,
        )
        copy(
            conn,
            "prefix_days",
            ["cluster_id", "prefix", "action", "day", "count", "total", "max", "buckets", "hist"],
            [  # hist as COPY's text form of bytea: \\x and hex
                (c, p, "compute", d, n, t, mx, "{}", "\\\\x" + sketch.pack_hist(h).hex())
                for (c, p, d), (h, n, t, mx) in days.items()
            ],
        )
        copy(
            conn,
            "cluster_hours",
            ["cluster_id", "hour", "tasks", "errors", "compute", "transfer", "disk", "nbytes"],
            ch,
        )
        with conn.cursor() as cur:
            for table in ("clusters", "sessions", "runs"):
                cur.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM "
                    f"{table}))"
                )
            cur.execute("ANALYZE")
        conn.commit()
    finally:
        raw.close()


def synthetic_profiles(n_runs: int, nodes: int, seed: int = 3) -> list[Any]:
    """``n_runs`` profile trees of one prefix: each run samples ~``nodes`` frames of one
    shared random call tree (depth up to 25), with its own counts, as repeated runs of
    one job do."""
    from storage.analysis.profile import Profile, add_flat

    rng = random.Random(seed)
    size = int(nodes * 1.25)
    frames = [
        (
            f"fn_{i}",
            f"/opt/venv/lib/python3.11/site-packages/lib{i % 40}/mod{i % 300}.py",
            10 + i,
            12 + i,
            f"result = fn_{i + 1}(frame, **kwargs)",
        )
        for i in range(size)
    ]
    parents, depth = [-1], [0]
    for i in range(1, size):
        p = rng.randrange(i)
        while depth[p] >= 24:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    out = []
    for _ in range(n_runs):
        dropped = [rng.random() < 0.03 for _ in range(size)]
        counts = [0] * size
        for i in range(size - 1, -1, -1):  # children come after their parents
            if not dropped[i]:
                counts[i] += rng.randint(1, 50)
                if parents[i] >= 0:
                    counts[parents[i]] += counts[i]
        index: dict[int, int] = {}
        flat: list[tuple[int, int, int]] = []
        for i, p in enumerate(parents):
            if dropped[i] or (p >= 0 and p not in index):
                continue
            index[i] = len(flat)
            flat.append((index[p] if p >= 0 else -1, i, counts[i]))
        prof = Profile()
        add_flat(prof, frames, flat)
        out.append(prof)
    return out


def load_profiles(sessions: Any, tenant_id: int, runs: list[int], nodes: int = 2000) -> int:
    """Stored profiles for ``runs`` (their prefix read-parquet, and the whole run's), as
    ``storage.runs.profiles.store`` writes them; returns the bytes stored per run."""
    from storage.analysis.profile import encode
    from storage.core import models as m
    from storage.runs.profiles import frame_ids

    trees = synthetic_profiles(len(runs), nodes)
    stored = 0
    with sessions.begin() as db:
        used = {t.keys[f]: t.lines[f] for t in trees for f in t.keys}
        ids = frame_ids(db, tenant_id, used)
        rows = []
        for rid, tree in zip(runs, trees, strict=True):
            data = encode(tree, {f: ids[k] for f, k in tree.keys.items()})
            stored += 2 * len(data)
            for prefix in ("read-parquet", ""):
                rows.append(
                    {
                        "run_id": rid,
                        "prefix": prefix,
                        "worker": "",
                        "samples": tree.samples,
                        "nodes": tree.size(),
                        "interval": 0.01,
                        "tag": "bench",
                        "data": data,
                    }
                )
        db.execute(m.RunProfile.__table__.insert(), rows)
    return stored // max(len(runs), 1)


#: Seconds between a task's start in the synthetic run (see ``task_events``) and threads.
TASK_SPACING = 0.0004
BIG_WORKERS = [f"tcp://10.0.{i // 8}.{i % 8 + 10}:{40000 + i}" for i in range(16)]
BIG_THREADS = 4


def state_samples(n_tasks: int, t_start: float, lo: float, hi: float) -> list[dict[str, Any]]:
    """The scheduler agent's ``state`` events of the big run over ``[lo, hi)``, one a second:
    tasks start every ``TASK_SPACING`` s in prefix order (as ``task_events`` makes them)
    and each thread holds one, so the tasks started are done but for the last ones."""
    out = []
    t = t_start + math.ceil(max(lo - t_start, 0.0))
    n_prefixes = len(NAMES)
    capacity = len(BIG_WORKERS) * BIG_THREADS
    while t < hi:
        started = min(n_tasks, int((t - t_start) / TASK_SPACING) + 1)
        processing = min(started, capacity) if started < n_tasks else 0
        done = started - processing
        prefixes = []
        for k, name in enumerate(NAMES):
            total = n_tasks // n_prefixes + (k < n_tasks % n_prefixes)
            d = done // n_prefixes + (k < done % n_prefixes)
            s_ = started // n_prefixes + (k < started % n_prefixes)
            # results are released once their dependants ran: all but the last 2% of each
            released = d - min(d, max(total // 50, 1))
            prefixes.append(
                {
                    "prefix": name,
                    "waiting": total - s_,
                    "processing": s_ - d,
                    "memory": d - released,
                    "released": released,
                }
            )
        workers = [
            {
                "worker": w,
                "managed": 2_000_000_000 + 1_000_000 * i,
                "unmanaged": 300_000_000,
                "spilled": 0 if i % 4 else 500_000_000,
                "limit": 8_000_000_000,
                "processing": processing // len(BIG_WORKERS),
            }
            for i, w in enumerate(BIG_WORKERS)
        ]
        out.append(
            {"kind": "state", "run": "big", "time": t, "prefixes": prefixes, "workers": workers}
        )
        t += 1.0
    return out


def load_big_run(
    sessions: Any, blobs: Any, tenant_id: int, n_tasks: int, per_batch: int = 5000
) -> None:
    """One run of ``n_tasks`` Dask-shaped task records through the real ingest path."""
    rng = random.Random(1)
    cctx = zstandard.ZstdCompressor(level=3)
    enc = msgspec.json.Encoder()
    n_batches = (n_tasks + per_batch - 1) // per_batch
    t_big = T0 + 2000 * 3600 + 7200  # after the synthetic history
    t_end = t_big + n_tasks * TASK_SPACING + 60
    for seq in range(n_batches):
        events: list[dict[str, Any]] = task_events(
            min(per_batch, n_tasks - seq * per_batch),
            first=seq * per_batch,
            run="big",
            t0=t_big + seq * per_batch * TASK_SPACING,
            rng=rng,
        )
        # the samples the scheduler agent took while this batch's tasks ran (the last
        # batch: until the run's end, and the final one at its end)
        lo = t_big + seq * per_batch * TASK_SPACING
        last = seq == n_batches - 1
        hi = t_end + 1e-9 if last else lo + per_batch * TASK_SPACING
        events += state_samples(n_tasks, t_big, lo, hi)
        if seq == 0:
            events.insert(
                0,
                {"kind": "run", "event": "started", "id": "big", "name": "big-run", "time": t_big},
            )
        if seq == n_batches - 1:
            events.append(
                {
                    "kind": "run",
                    "event": "finished",
                    "id": "big",
                    "time": t_end,
                }
            )
        raw = enc.encode(
            {
                "schema": 1,
                "cluster": "cluster-big",
                "session": "Scheduler-big",
                "agent": "scheduler-0",
                "seq": seq,
                "events": events,
                "final": seq == n_batches - 1,
            }
        )
        batch = decode_batch(raw)
        key = f"v1/{TENANT}/cluster-big/Scheduler-big/scheduler-0/{seq:012d}.json.zst"
        body = cctx.compress(raw)
        blobs.put(key, body, if_absent=True)
        with sessions.begin() as db:
            index_batch(
                db,
                tenant_id=tenant_id,
                tenant=TENANT,
                batch=batch,
                blob_key=key,
                size=len(body),
                now=time.time(),
            )
        if (seq + 1) % 40 == 0:
            log(f"  big run: {(seq + 1) * per_batch:,} tasks indexed")


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--clusters", type=int, default=50)
    ap.add_argument("--big-tasks", type=int, default=1_000_000)
    ap.add_argument(
        "--database-url",
        default=os.environ.get(
            "TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
        ),
    )
    args = ap.parse_args()

    from storage.core.blobs import open_blob_store
    from storage.runs import runfile

    admin_url = make_url(args.database_url)
    dbname = f"hindsight_bench_query_{secrets.token_hex(3)}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{dbname}"'))
    db_url = admin_url.set(database=dbname).render_as_string(hide_password=False)
    tmp = tempfile.TemporaryDirectory(prefix="hs-bench-query-")
    try:
        engine = make_engine(db_url)
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        with sessions.begin() as db:
            token = create_token(db, TENANT, "read")
            tenant_id = db.execute(
                text("SELECT id FROM tenants WHERE name = :n"), {"n": TENANT}
            ).scalar_one()
        blob_url = (Path(tmp.name) / "blobs").as_uri()
        blobs = open_blob_store(blob_url)
        log(f"generating {args.runs:,} runs over {args.clusters} clusters ...")
        t = time.perf_counter()
        generate_history(engine, tenant_id, args.runs, args.clusters)
        log(f"history loaded in {time.perf_counter() - t:.1f} s")
        log(f"loading one run of {args.big_tasks:,} tasks through ingest ...")
        t = time.perf_counter()
        load_big_run(sessions, blobs, tenant_id, args.big_tasks)
        log(f"big run indexed in {time.perf_counter() - t:.1f} s")
        # 100 runs of two hours (50 clusters, one run each an hour) with stored profiles
        mid = args.runs // args.clusters // 2
        p_since, p_until = T0 + mid * 3600, T0 + (mid + 2) * 3600
        with engine.connect() as conn:
            profiled = list(
                conn.execute(
                    text(
                        "SELECT id FROM runs WHERE started_at >= :a AND started_at < :b ORDER BY id"
                    ),
                    {"a": p_since, "b": p_until},
                ).scalars()
            )
        profile_bytes = load_profiles(sessions, tenant_id, profiled)
        log(f"stored profiles of {len(profiled)} runs ({profile_bytes:,} bytes per run)")

        logging.getLogger("hindsight.access").setLevel(logging.WARNING)
        app = create_app(
            {"database_url": db_url, "blob_url": blob_url, "auth": "required", "data_dir": tmp.name}
        )
        client = app.test_client()
        h = {"Authorization": f"Bearer {token}"}

        def get(url: str) -> Any:
            resp = client.get(url, headers=h)
            assert resp.status_code == 200, (url, resp.data[:300])
            return resp

        # ---- run list
        rng = random.Random(2)
        first = get("/v1/runs?limit=100").json
        queries_ = [
            lambda: "/v1/runs?limit=100",
            lambda: f"/v1/runs?cluster=cluster-{rng.randrange(args.clusters):02d}&limit=100",
            lambda: (
                f"/v1/runs?cluster=cluster-{rng.randrange(args.clusters):02d}&status=finished&limit=50"
            ),
            lambda: "/v1/runs?status=erred&limit=100",
            lambda: f"/v1/runs?name=job-{rng.randrange(20):02d}&limit=100",
            lambda: (
                f"/v1/runs?since={T0 + rng.randrange(1900) * 3600}"
                f"&until={T0 + (rng.randrange(100) + 1900) * 3600}&limit=100"
            ),
            lambda: f"/v1/runs?limit=100&cursor={first['next_cursor']}",
            lambda: "/v1/runs?has_errors=true&limit=100",
        ]
        for q in queries_:
            get(q())  # warm
        times = []
        for i in range(400):
            url = queries_[i % len(queries_)]()
            times.append(timed(lambda url=url: get(url)) * 1000)
        times.sort()
        run_list_p95 = times[int(0.95 * len(times)) - 1]
        sorted_ms = statistics.median(
            timed(lambda: get("/v1/runs?sort=-makespan&limit=100")) * 1000 for _ in range(10)
        )
        log(
            f"run list p95 {run_list_p95:.1f} ms (p50 {times[len(times) // 2]:.1f}); "
            f"sort=-makespan {sorted_ms:.0f} ms"
        )

        # ---- prefix history over 10,000 runs (200 hours x 50 clusters)
        hours = args.runs // args.clusters
        window = min(hours, 10_000 // args.clusters)
        since = T0 + (hours - window) // 2 * 3600
        until = since + window * 3600
        # day buckets read the prefix_days rollup; hour buckets merge the runs' histograms
        url = f"/v1/history/prefixes?prefix=read-parquet&bucket=day&since={since}&until={until}"
        body = get(url).json
        covered = sum(p["count"] for p in body["points"])
        ph_ms = statistics.median(timed(lambda: get(url)) * 1000 for _ in range(20))
        url_h = url.replace("bucket=day", "bucket=hour")
        ph_hour_ms = statistics.median(timed(lambda: get(url_h)) * 1000 for _ in range(10))
        log(
            f"prefix history: {len(body['points'])} days, {covered:,} task durations, {ph_ms:.1f} "
            f"ms; "
            f"by hour {ph_hour_ms:.0f} ms"
        )

        # ---- a prefix's profile merged over 100 runs
        url = f"/v1/profiles?prefix=read-parquet&since={p_since}&until={p_until}"
        merged = get(url).json
        assert merged["runs"] == len(profiled), merged["runs"]
        profile_ms = statistics.median(timed(lambda: get(url)) * 1000 for _ in range(10))
        log(
            f"profile of read-parquet over {merged['runs']} runs ({len(profiled)} trees of ~2,000 "
            f"frames): {profile_ms:.0f} ms"
        )

        # ---- the 1M-task run
        big = get("/v1/runs?name=big-run").json["runs"][0]
        assert big["task_count"] == args.big_tasks, big
        runfile.clear_cache()
        compact_s = timed(lambda: get(f"/v1/runs/{big['id']}/tasks?limit=1"))
        log(f"compacted the {args.big_tasks:,}-task run from raw batches in {compact_s:.2f} s")
        cold = []
        for _ in range(3):
            runfile.clear_cache()
            t = time.perf_counter()
            df = pd.read_parquet(io.BytesIO(get(f"/v1/runs/{big['id']}/tasks.parquet").data))
            cold.append(time.perf_counter() - t)
            assert len(df) == args.big_tasks
        cold_s = statistics.median(cold)
        pages = []
        for url in (f"/v1/runs/{big['id']}/tasks?limit=1000",):
            for _ in range(5):
                runfile.clear_cache()
                pages.append(timed(lambda url=url: get(url)) * 1000)
        page_ms = statistics.median(pages)
        runfile.clear_cache()
        t = time.perf_counter()
        resp = client.get(f"/v1/runs/{big['id']}/tasks/stream", headers=h)
        n_lines = resp.data.count(b"\n")
        ndjson_s = time.perf_counter() - t
        assert n_lines == args.big_tasks
        log(
            f"tasks: parquet cold {cold_s:.2f} s, page {page_ms:.0f} ms, NDJSON in full "
            f"{ndjson_s:.1f} s"
        )

        # ---- replay of the 1M-task run at its midpoint
        mid = (big["started_at"] + big["finished_at"]) / 2
        url = f"/v1/runs/{big['id']}/state?at={mid}"
        body = get(url).json
        assert (
            sum(
                sum(p[k] for k in ("waiting", "processing", "memory", "released", "erred"))
                for p in body["prefixes"]
            )
            == args.big_tasks
        ), body
        assert body["sampled_at"] <= mid < body["sampled_at"] + 1 and len(body["workers"]) == 16
        with engine.connect() as conn:
            n_samples = conn.execute(text("SELECT count(*) FROM run_states")).scalar_one()
        state_ms = []
        for _ in range(20):
            runfile.clear_cache()
            state_ms.append(timed(lambda: get(url)) * 1000)
        state_at_ms = statistics.median(state_ms)
        log(f"replay at the midpoint ({n_samples} samples of the run): {state_at_ms:.1f} ms")

        figures = {
            "run_list_p95_ms": round(run_list_p95, 1),
            "run_tasks_cold_s": round(cold_s, 3),
            "run_tasks_page_ms": round(page_ms, 1),
            "prefix_history_ms": round(ph_ms, 1),
            "prefix_history_hourly_ms": round(ph_hour_ms, 1),
            "profile_ms": round(profile_ms, 1),
            "profile_stored_bytes_per_run": profile_bytes,
            "state_at_ms": round(state_at_ms, 1),
            "state_samples": n_samples,
            "run_list_sorted_by_makespan_ms": round(sorted_ms, 1),
            "run_compact_s": round(compact_s, 2),
            "run_tasks_ndjson_s": round(ndjson_s, 2),
            "runs": args.runs,
            "big_run_tasks": args.big_tasks,
        }
        met = all(figures[k] <= v for k, v in TARGETS.items())
        report("query", figures, TARGETS, met)
        engine.dispose()
        return 0
    finally:
        tmp.cleanup()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    sys.exit(main())
