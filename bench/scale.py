"""The cost curve: what ingest and queries cost as the index grows from 10^3 to 10^6 runs.

History (``bench/lib_history.py``): units of 100 runs (one day of a group of four
clusters, Dask-shaped batches as the agents send them: tasks, metrics, profiles, code,
fine performance metrics) over 40 groups (160 clusters) of four tenants (50/25/12.5/12.5%)
and as many days as the level needs (250 at 10^6). The first unit goes through the real
path: every batch stored (local blob store) and indexed by ``storage.ingest.writer.index_batch``,
then the finished-run work (``storage.jobs.finish``: rollups folded, compacted copies, profiles,
the lake). Every other unit is a copy of its rows in SQL (``lib_history.copy_units``: fresh
ids, the unit's names, times shifted by whole days). The bench checks the bulk path
against the real one: a second unit, of another tenant, group and day, is ingested for
real into a reference index and copied in bulk into the measured one, and every table's
rows must be equal with ids replaced by what they name (``bulk_equals_real``).

At each level, with N runs indexed (VACUUM ANALYZE done, as autovacuum would):

- ``ingest_events_per_s``: Dask-shaped 5,000-event batches of new runs sent for
  ``--ingest-seconds`` by 3 senders to the real collector (gunicorn, 2 gthread workers)
  storing to moto's S3 server over HTTP and indexing into this database, as
  ``bench/ingest.py`` does;
- ``run_list_p95_ms``: ``GET /v1/runs`` with a mix of filters, sorts and cursors, and
  ``run_detail_p95_ms``: ``GET /v1/runs/{id}`` of random runs, through the query service's
  Flask app (test client) as the largest tenant (half of the runs);
- ``prefix_history_ms``: ``GET /v1/history/prefixes?bucket=day`` over a window holding
  10,000 of the tenant's runs (median of 20);
- ``index_bytes_per_run``: every table and index of the database over the runs (target
  8,000: the index a catalog, each finished run's detail in one object, decision 0034);
  ``detail_object_bytes_per_run``: those objects, as the real path's unit wrote them (the
  bulk copies write none).

At the end the ingest rate is measured side by side against a reference index of 10^3
runs, by two fresh stacks (collector and moto each) in alternating rounds (AB BA AB ...):
``ingest_ratio_1e6_vs_1e3`` is the median of the rounds' ratios, and the collectors' own
index step (ms a batch, from ``/metrics``) is reported for both. Both databases are dropped.

    .venv/bin/python -m bench.scale [--levels 1e3,1e4,1e5,1e6] [--ingest-seconds 10]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg2
import requests
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from bench import lib_history as h
from bench.ingest import EVENTS_PER_BATCH, Frames
from bench.lib_results import report
from bench.lib_stack import DEFAULT_DB, full_stack
from hindsight.sender import Sender
from services.query.app import create_app
from storage.core import partitions
from storage.core.blobs import open_blob_store
from storage.core.db import downgrade, make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token

TARGETS = {
    "run_list_p95_ms_at_1e6": 50,
    "prefix_history_ms_at_1e6": 200,
    "ingest_ratio_1e6_vs_1e3": 0.85,
    # the index a catalog (issue 34, decision 0034): per-run detail in the blob store
    "index_bytes_per_run": 8000,
}
CHUNK_UNITS = 200
TENANT = h.TENANTS[0]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


class SessionFrames(Frames):
    """bench/ingest.py's batches, for a cluster and session of our choosing (new runs)."""

    def __init__(self, pool: int) -> None:
        super().__init__(pool)
        self.cluster = self.session = "bench"

    def body(self, agent: str, seq: int) -> bytes:
        head = (
            f'{{"schema":1,"cluster":"{self.cluster}","session":"{self.session}","agent":"{agent}",'
            f'"seq":{seq},"dropped":{{"buffer_full":0}},"events":'
        ).encode()
        return self.compressor().compress(head) + self.events[seq % len(self.events)] + self.tail


def measure_ingest(
    url: str, token: str, frames: SessionFrames, session: str, seconds: float, senders: int = 3
) -> float:
    """Task events/s accepted by the collector at ``url`` for new runs of a new session."""
    frames.cluster, frames.session = "ingest-probe", session
    seqs = {f"agent-{i}": 0 for i in range(senders)}
    with Sender(url, token) as warm:  # connections, engines and S3 clients warm
        for agent in seqs:
            assert warm.send(frames.body(agent, 0), compressed=True).status == 202
            seqs[agent] = 1
    accepted = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def send(agent: str) -> None:
        with Sender(url, token) as s:
            while time.monotonic() < stop_at:
                resp = s.send(frames.body(agent, seqs[agent]), compressed=True)
                if resp.status != 202:  # overloaded (503): the sender retries the same batch
                    continue
                seqs[agent] += 1
                with lock:
                    accepted[0] += EVENTS_PER_BATCH

    t0 = time.monotonic()
    threads = [threading.Thread(target=send, args=(a,)) for a in seqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return accepted[0] / (time.monotonic() - t0)


def index_seconds(url: str) -> tuple[float, float]:
    """The collector's index transactions so far: (seconds, batches), from ``/metrics``
    (every gunicorn worker's, in prometheus-client's multiprocess mode)."""
    total = count = 0.0
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("hindsight_index_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("hindsight_index_seconds_count"):
            count += float(line.split()[-1])
    return total, count


#: A user table's name in pg_stat_user_tables, a partition named as its table's
#: (``storage.core.partitions``).
TABLE_OF = "coalesce(pg_partition_root(relid), relid)::regclass::text"


def index_bytes(engine: Any) -> tuple[int, int, dict[str, int]]:
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT count(*) FROM runs")).scalar_one()
        sizes = dict(
            conn.execute(
                text(
                    f"SELECT {TABLE_OF}, sum(pg_total_relation_size(relid)) FROM "
                    "pg_stat_user_tables WHERE schemaname = 'public' GROUP BY 1 ORDER BY 2 DESC"
                )
            ).all()
        )
    return runs, sum(sizes.values()), sizes


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[max(0, int(0.95 * len(xs)) - 1)]


def measure_queries(
    client: Any, token: str, engine: Any, tenant_id: int, days: int
) -> dict[str, Any]:
    hdr = {"Authorization": f"Bearer {token}"}

    def get(url: str) -> Any:
        resp = client.get(url, headers=hdr)
        assert resp.status_code == 200, (url, resp.data[:300])
        return resp

    def timed(url: str) -> float:
        t = time.perf_counter()
        get(url)
        return (time.perf_counter() - t) * 1000

    rng = random.Random(2)
    groups = sorted({g for g in range(h.GROUPS) if h.tenant_of(g) == TENANT})
    first = get("/v1/runs?limit=100").json
    clusters = [h.cluster_name(g, k) for g in groups for k in range(h.CLUSTERS)]
    mix = [
        lambda: "/v1/runs?limit=100",
        lambda: f"/v1/runs?cluster={rng.choice(clusters)}&limit=100",
        lambda: f"/v1/runs?cluster={rng.choice(clusters)}&status=finished&limit=50",
        lambda: "/v1/runs?status=erred&limit=100",
        lambda: f"/v1/runs?name=job-{rng.randrange(h.JOBS):02d}&limit=100",
        lambda: (
            f"/v1/runs?since={h.T0 + rng.randrange(days) * h.DAY}"
            f"&until={h.T0 + rng.randrange(days) * h.DAY + h.DAY}&limit=100"
        ),
        lambda: f"/v1/runs?limit=100&cursor={first['next_cursor']}",
        lambda: "/v1/runs?has_errors=true&limit=100",
    ]
    for q in mix:
        get(q())
    run_list = [timed(mix[i % len(mix)]()) for i in range(400)]
    by_kind = [p95(run_list[i :: len(mix)]) for i in range(len(mix))]
    with engine.connect() as conn:
        hi = conn.execute(text("SELECT max(id) FROM runs")).scalar_one()
        picks = [rng.randrange(1, hi + 1) for _ in range(2000)]
        ids = (
            conn.execute(
                text(
                    "SELECT public_id FROM runs WHERE id = ANY(:ids) AND tenant_id = :t LIMIT 200"
                ),
                {"ids": picks, "t": tenant_id},
            )
            .scalars()
            .all()
        )
    for pid in ids[:5]:
        get(f"/v1/runs/{pid}")
    detail = [timed(f"/v1/runs/{pid}") for pid in ids]
    # a window of the tenant's runs around the middle of the history: 10,000 runs at
    # 2,000 a day, or all there are
    width = min(days, 5)
    since = h.T0 + (days - width) // 2 * h.DAY
    until = since + width * h.DAY
    with engine.connect() as conn:
        covered = conn.execute(
            text(
                "SELECT count(*) FROM runs WHERE tenant_id = :t AND started_at >= :a AND "
                "started_at < :b"
            ),
            {"t": tenant_id, "a": since, "b": until},
        ).scalar_one()
    url = f"/v1/history/prefixes?prefix=read-parquet&bucket=day&since={since}&until={until}"
    points = get(url).json["points"]
    history = [timed(url) for _ in range(20)]
    return {
        "run_list_p95_ms": round(p95(run_list), 1),
        "run_list_p50_ms": round(statistics.median(run_list), 1),
        "run_list_p95_ms_by_query": [round(x, 1) for x in by_kind],
        "run_detail_p95_ms": round(p95(detail), 1),
        "run_detail_p50_ms": round(statistics.median(detail), 1),
        "prefix_history_ms": round(statistics.median(history), 1),
        "prefix_history_p95_ms": round(p95(history), 1),
        "prefix_history_runs": covered,
        "prefix_history_points": len(points),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--levels",
        default="1e3,1e4,1e5,1e6",
        help="run counts to measure at, comma-separated (multiples of 100)",
    )
    ap.add_argument("--ingest-seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=6, help="side-by-side ingest rounds at the end")
    ap.add_argument("--database-url", default=DEFAULT_DB)
    ap.add_argument(
        "--keep", action="store_true", help="leave both databases (for EXPLAIN); drop them by hand"
    )
    args = ap.parse_args()
    levels = sorted(int(float(x)) for x in args.levels.split(","))
    if levels[0] < 2 * h.UNIT_RUNS or any(n % h.UNIT_RUNS for n in levels):
        ap.error(f"levels are multiples of {h.UNIT_RUNS}, at least {2 * h.UNIT_RUNS}")
    logging.getLogger("hindsight.access").setLevel(logging.WARNING)
    # SIGTERM unwinds like an error: servers stopped, databases dropped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{sys.argv[0]}: terminated"))

    admin_url = make_url(args.database_url)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    tag = secrets.token_hex(3)
    ref_name, main_name = f"hindsight_scale_ref_{tag}", f"hindsight_scale_{tag}"
    url_of = {
        n: admin_url.set(database=n).render_as_string(hide_password=False)
        for n in (ref_name, main_name)
    }
    tmp = tempfile.TemporaryDirectory(prefix="hs-scale-")
    figures: dict[str, Any] = {"levels": {}}
    engines: list[Any] = []
    try:
        with ExitStack() as stack:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{ref_name}"'))
            ref = make_engine(url_of[ref_name])
            engines.append(ref)
            upgrade(ref)
            with ref.begin() as conn:  # uuid_generate_v5 for the bulk path's public ids
                conn.execute(text('CREATE EXTENSION IF NOT EXISTS "uuid-ossp"'))
            ref_sessions = make_sessionmaker(ref)
            with ref_sessions.begin() as db:
                tokens = {t: create_token(db, t, "ingest,read") for t in h.TENANTS}
            with ref.connect() as conn:
                tenant_ids = dict(conn.execute(text("SELECT name, id FROM tenants")).all())
            blob_url = (Path(tmp.name) / "blobs").as_uri()
            blobs = open_blob_store(blob_url)
            log("generating the template unit's batches ...")
            tmpl = h.template()
            order = h.unit_order(levels[-1] // h.UNIT_RUNS)
            log(f"unit {order[0]} through the real path (index_batch + finished-run work) ...")
            t = time.perf_counter()
            h.ingest_units(ref_sessions, blobs, tenant_ids, [order[0]], tmpl, log)
            real_s = time.perf_counter() - t
            raw = ref.raw_connection()
            tm = h.Template.read(raw.driver_connection, tenant_ids[TENANT])
            raw.close()
            log(f"  {h.UNIT_RUNS} runs in {real_s:.0f} s; template ranges {tm.ranges}")
            # what the index no longer holds: each finished run's detail object
            sizes = [p.stat().st_size for p in Path(tmp.name, "blobs").rglob("detail/*")]
            figures["detail_objects_per_run"] = round(len(sizes) / h.UNIT_RUNS, 2)
            figures["detail_object_bytes_per_run"] = round(sum(sizes) / h.UNIT_RUNS)
            log(f"  detail objects: {len(sizes)}, {sum(sizes) / h.UNIT_RUNS:,.0f} B a run")
            ref.dispose()
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{main_name}" TEMPLATE "{ref_name}"'))
            main_db = make_engine(url_of[main_name])
            engines.append(main_db)

            # ---- the bulk path against the real one
            log(
                f"unit {order[1]} (tenant {h.tenant_of(h.place(order[1])[0])}, group/day "
                f"{h.place(order[1])}) for real into the reference, in bulk into the measured "
                f"index ..."
            )
            h.ingest_units(ref_sessions, blobs, tenant_ids, [order[1]], tmpl, log)
            raw = main_db.raw_connection()
            h.copy_units(raw.driver_connection, tm, tenant_ids, [order[1]])
            raw.close()
            diffs = h.differences(h.snapshot(ref), h.snapshot(main_db))
            for d in diffs:
                log(f"  DIFFERS {d[:1500]}")
            with main_db.connect() as conn:
                tables = conn.execute(
                    text(
                        f"SELECT DISTINCT {TABLE_OF} FROM pg_stat_user_tables "
                        "WHERE schemaname = 'public'"
                    )
                ).scalars()
                filled = {
                    t
                    for t in tables
                    if conn.execute(text(f"SELECT EXISTS (SELECT 1 FROM {t})")).scalar()
                }
            uncopied = sorted(filled - h.COPIED - h.NOT_PER_UNIT)
            figures["bulk_equals_real"] = not diffs and not uncopied
            figures["bulk_uncopied_tables"] = uncopied
            log(
                f"  bulk rows equal real rows: {not diffs}; tables with rows the bulk path does "
                f"not copy: {uncopied}"
            )
            raw = ref.raw_connection()
            h.copy_units(raw.driver_connection, tm, tenant_ids, order[2:10])
            raw.close()
            with ref.begin() as conn:
                conn.execute(text("ANALYZE"))

            frames = SessionFrames(pool=24)
            levels_stack = stack.enter_context(ExitStack())
            main_stack = levels_stack.enter_context(
                full_stack(existing_db=url_of[main_name], env=NO_SILENT_CLOSE)
            )
            main_app = _query_app(url_of[main_name], blob_url, tmp.name)
            have = 2
            probe = 0
            for level in levels:
                want = level // h.UNIT_RUNS
                t = time.perf_counter()
                for i in range(have, want, CHUNK_UNITS):
                    copy_chunk(main_db, tm, tenant_ids, order[i : min(want, i + CHUNK_UNITS)])
                    # ranges kept ahead as the collectors' finish workers do (a chunk is far
                    # fewer runs than a range): no run's rows wait in a default partition
                    partitions.ensure(main_db)
                    if (i // CHUNK_UNITS) % 5 == 4:
                        log(f"  {min(want, i + CHUNK_UNITS) * h.UNIT_RUNS:,} runs")
                have = want
                build_s = time.perf_counter() - t
                t = time.perf_counter()
                with main_db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    conn.execute(text("VACUUM ANALYZE"))
                vacuum_s = time.perf_counter() - t
                runs, total, sizes = index_bytes(main_db)
                log(
                    f"{runs:,} runs indexed (built in {build_s:.0f} s, vacuum {vacuum_s:.0f} s); "
                    f"{total / 2**20:,.0f} MiB, {total / runs:,.0f} B/run; load {load()}"
                )
                q = measure_queries(
                    main_app.test_client(),
                    tokens[TENANT],
                    main_db,
                    tenant_ids[TENANT],
                    max(h.place(u)[1] for u in order[:want]) + 1,
                )
                log(f"  queries: {q}; load {load()}")
                probe += 1
                rate = measure_ingest(
                    main_stack.url, tokens[TENANT], frames, f"probe-{probe}", args.ingest_seconds
                )
                log(f"  ingest: {rate:,.0f} task events/s; load {load()}")
                figures["levels"][f"{level:.0e}".replace("+0", "")] = {
                    "runs": runs,
                    "index_bytes_per_run": round(total / runs),
                    "db_mib": round(total / 2**20),
                    "build_s": round(build_s, 1),
                    "vacuum_s": round(vacuum_s, 1),
                    "ingest_events_per_s": round(rate),
                    **q,
                    "load": load(),
                }
            top = f"{levels[-1]:.0e}".replace("+0", "")
            figures["index_bytes_per_run"] = round(total / runs)
            figures["index_bytes_by_table"] = {
                k: round(v / runs) for k, v in sizes.items() if v > 200_000
            }
            figures[f"run_list_p95_ms_at_{top}"] = figures["levels"][top]["run_list_p95_ms"]
            figures[f"run_detail_p95_ms_at_{top}"] = figures["levels"][top]["run_detail_p95_ms"]
            figures[f"prefix_history_ms_at_{top}"] = figures["levels"][top]["prefix_history_ms"]

            # ---- ingest side by side: 10^3 runs indexed against the top level. The stack
            # that served the levels is stopped first: its moto server holds every probe's
            # batches in memory by now, and the comparison must differ only in the index.
            # Two fresh stacks (collector and moto each) run at once, their rounds
            # alternate in the order AB BA AB ..., and the ratio is the median of each
            # round's pair (the machine's speed drifts between minutes, not within one pair).
            levels_stack.close()
            side = {}
            for name, db_name in (("1e3", ref_name), (top, main_name)):
                prom = stack.enter_context(tempfile.TemporaryDirectory(prefix="hs-scale-prom-"))
                side[name] = stack.enter_context(
                    full_stack(
                        existing_db=url_of[db_name],
                        env={"PROMETHEUS_MULTIPROC_DIR": prom, **NO_SILENT_CLOSE},
                    )
                )
            rates: dict[str, list[float]] = {"1e3": [], top: []}
            index_ms: dict[str, list[float]] = {"1e3": [], top: []}
            pairs: list[float] = []
            for r in range(args.rounds):
                order_r = ("1e3", top) if r % 2 == 0 else (top, "1e3")
                for name in order_r:
                    probe += 1
                    before = index_seconds(side[name].url)
                    rates[name].append(
                        measure_ingest(
                            side[name].url,
                            tokens[TENANT],
                            frames,
                            f"probe-{probe}",
                            args.ingest_seconds,
                        )
                    )
                    after = index_seconds(side[name].url)
                    index_ms[name].append(
                        1000 * (after[0] - before[0]) / max(1, after[1] - before[1])
                    )
                pairs.append(rates[top][-1] / rates["1e3"][-1])
                log(
                    f"  round {r + 1}: 1e3 {rates['1e3'][-1]:,.0f}, {top} {rates[top][-1]:,.0f} "
                    f"events/s"
                    f" (ratio {pairs[-1]:.3f}); index step {index_ms['1e3'][-1]:.1f} / "
                    f"{index_ms[top][-1]:.1f} ms a batch; load {load()}"
                )
            figures[f"ingest_events_per_s_at_{top}"] = round(statistics.median(rates[top]))
            figures["ingest_events_per_s_at_1e3"] = round(statistics.median(rates["1e3"]))
            figures[f"ingest_ratio_{top}_vs_1e3"] = round(statistics.median(pairs), 3)
            figures[f"ingest_ratio_{top}_vs_1e3_rounds"] = [round(x, 3) for x in pairs]
            figures[f"index_ms_per_batch_at_{top}"] = round(statistics.median(index_ms[top]), 1)
            figures["index_ms_per_batch_at_1e3"] = round(statistics.median(index_ms["1e3"]), 1)
            figures["real_path_unit_s"] = round(real_s, 1)

            # ---- migration 0023 at the top level (the per-run tables partitioned,
            # decision 0038): back to plain tables (rows copied) and in again (attached)
            t = time.perf_counter()
            downgrade(main_db, "0022")
            figures[f"unpartition_s_at_{top}"] = round(time.perf_counter() - t, 1)
            t = time.perf_counter()
            upgrade(main_db)
            figures[f"partition_migration_s_at_{top}"] = round(time.perf_counter() - t, 1)
            log(
                f"  migration 0023 at {top}: down {figures[f'unpartition_s_at_{top}']} s, "
                f"up {figures[f'partition_migration_s_at_{top}']} s"
            )
            figures["load_at_end"] = load()
        met = figures["bulk_equals_real"] and all(
            k in figures and (figures[k] >= v if k.startswith("ingest_ratio") else figures[k] <= v)
            for k, v in TARGETS.items()
        )
        report("scale", figures, TARGETS, met)
        return 0
    finally:
        for e in engines:
            e.dispose()
        with admin.connect() as conn:
            for n in (main_name, ref_name):
                if args.keep:
                    log(f"kept database {n}")
                else:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)'))
        admin.dispose()
        tmp.cleanup()


def copy_chunk(engine: Any, tm: h.Template, tenant_ids: dict[str, int], units: list[int]) -> None:
    """``lib_history.copy_units`` in one transaction, tried again if the server went away
    (the fault tests restart the Postgres server they share)."""
    for _attempt in range(6):
        raw = None
        try:
            raw = engine.raw_connection()
            h.copy_units(raw.driver_connection, tm, tenant_ids, units)
            return
        except (OperationalError, psycopg2.OperationalError) as exc:
            log(f"  copy failed ({str(exc).strip()[:120]}); again in 10 s")
            tm.trees.clear()  # the frames it cached were rolled back
            engine.dispose()
            time.sleep(10)
        finally:
            if raw is not None:
                try:
                    raw.close()
                except Exception:  # the connection is gone already
                    pass
    raise SystemExit("the database stayed away")


#: The collectors here do not close silent runs (only a collector does: the query service
#: runs no finish worker of its own): the one stack serving every level outlives
#: HINDSIGHT_SILENT_CLOSE_SECONDS (30 min), and closing the history's open runs mid-build
#: would write lake partitions the bulk copies then collide with.
NO_SILENT_CLOSE = {"HINDSIGHT_SILENT_CLOSE_SECONDS": "0"}


def _query_app(db_url: str, blob_url: str, data_dir: str) -> Any:
    return create_app(
        {"database_url": db_url, "blob_url": blob_url, "auth": "required", "data_dir": data_dir}
    )


if __name__ == "__main__":
    sys.exit(main())
