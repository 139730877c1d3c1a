"""Ingest benchmark: the real collector under gunicorn (2 workers), Postgres and moto's S3
server, driven by concurrent senders for DURATION seconds.

Reports events/s accepted, ack latency p50/p99, bytes at rest per task event, collector
RSS, and - measured in the same run - the single-core decode-and-validate rate of the same
batches with the ratio. Everything runs on one machine: the senders, moto's
server and Postgres share them with the collector.

    .venv/bin/python -m bench.ingest [--duration 30] [--senders 3]
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import msgspec
import requests
import zstandard
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.lib_proc import rss_bytes
from bench.lib_results import report
from bench.lib_workload import task_events
from collector.body import decompress
from hindsight.schema import decode_batch
from hindsight.sender import ZSTD_LEVEL as AGENT_ZSTD_LEVEL
from hindsight.sender import Sender
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token
from storage.ingest.aggregate import aggregate

ROOT = Path(__file__).resolve().parent.parent
EVENTS_PER_BATCH = 5000

TARGETS = {"events_per_s": 300_000, "ack_p99_ms": 100, "bytes_per_event": 25}
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.RequestException:  # not up yet, or too busy to answer
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} not ready after {timeout} s")


def tree_rss(pid: int) -> int:
    """RSS of a process and its children (gunicorn master + workers)."""
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    return rss_bytes(pids)


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def cpu_by_pid(pids: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """CPU seconds of each process, by component."""
    return {k: {p: cpu_seconds([p]) for p in v} for k, v in pids.items()}


def cpu_share(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], seconds: float
) -> dict[str, float]:
    """Cores each component used between two :func:`cpu_by_pid` snapshots. Processes that
    started in between (Postgres backends of connections a pool opened under load) count
    from zero: the pids of the start alone would miss most of Postgres's work."""
    return {
        k: round(sum(t - before.get(k, {}).get(p, 0.0) for p, t in v.items()) / seconds, 2)
        for k, v in after.items()
    }


def component_pids(gunicorn: int, moto: int) -> dict[str, list[int]]:
    def children(pid: int) -> list[int]:
        try:
            return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    postgres = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() in ("postgres", "postmaster"):
                    postgres.append(int(d.name))
            except OSError:
                pass
    return {
        "collector": [gunicorn, *children(gunicorn)],
        "moto_s3": [moto],
        "postgres": postgres,
        "senders": [os.getpid()],
    }


class Frames:
    """Batches as three zstd frames: a small header (cluster/session/agent/seq), a shared
    pre-compressed events array, and the closing brace. Concatenated zstd frames are one
    valid zstd stream, so each body is exactly what an agent would send, but building a
    batch costs microseconds instead of the ~40 ms it takes to generate and compress."""

    def __init__(self, pool: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        enc = msgspec.json.Encoder()
        self.cctx = zstandard.ZstdCompressor(level=AGENT_ZSTD_LEVEL)
        self.events = [
            self.cctx.compress(
                enc.encode(
                    task_events(
                        EVENTS_PER_BATCH,
                        first=i * EVENTS_PER_BATCH,
                        run=f"run-{i % 6}",
                        t0=1.8e9 + i * 2,
                        rng=rng,
                    )
                )
            )
            for i in range(pool)
        ]
        self.tail = self.cctx.compress(b"}")
        self.local = threading.local()

    def body(self, agent: str, seq: int) -> bytes:
        head = (
            f'{{"schema":1,"cluster":"bench","session":"Scheduler-bench","agent":"{agent}","seq":{seq},'
            f'"dropped":{{"buffer_full":0}},"events":'
        ).encode()
        return self.compressor().compress(head) + self.events[seq % len(self.events)] + self.tail

    def compressor(self) -> zstandard.ZstdCompressor:
        """This thread's compressor: a ZstdCompressor is not thread-safe, and one shared by
        the senders' threads writes a rare corrupt header frame (answered 400)."""
        cctx = getattr(self.local, "cctx", None)
        if cctx is None:
            cctx = self.local.cctx = zstandard.ZstdCompressor(level=AGENT_ZSTD_LEVEL)
        return cctx


def decode_limit(frames: Frames, rounds: int = 3) -> tuple[float, float, dict[str, float]]:
    """Single-core events/s of decompress + decode-and-validate, and with the index summary;
    and the single-core CPU milliseconds per batch of each step (best of ``rounds``)."""
    bodies = [frames.body("probe", i) for i in range(len(frames.events))]
    best = best_sum = 0.0
    steps = {"decompress": 1e9, "decode": 1e9, "aggregate": 1e9}
    for _ in range(rounds):
        t0 = time.process_time()
        for b in bodies:
            decode_batch(decompress(b, "zstd", 1 << 26))
        t1 = time.process_time()
        for b in bodies:
            aggregate(decode_batch(decompress(b, "zstd", 1 << 26)))
        t2 = time.process_time()
        n = len(bodies) * EVENTS_PER_BATCH
        best, best_sum = max(best, n / (t1 - t0)), max(best_sum, n / (t2 - t1))
        # each step alone, on what the step before it made
        ta = time.process_time()
        plain = [decompress(b, "zstd", 1 << 26) for b in bodies]
        tb = time.process_time()
        decoded = [decode_batch(p) for p in plain]
        tc = time.process_time()
        for d in decoded:
            aggregate(d)
        td = time.process_time()
        del plain, decoded
        for k, dt in (("decompress", tb - ta), ("decode", tc - tb), ("aggregate", td - tc)):
            steps[k] = min(steps[k], dt / len(bodies) * 1000)
    return best, best_sum, {k: round(v, 2) for k, v in steps.items()}


def collector_stages(url: str) -> dict[str, float]:
    """Wall milliseconds per batch inside the collector, from its own /metrics (all gunicorn
    workers: multiprocess mode): the request, the blob put, and aggregation + index
    transaction. Waits (the GIL, Postgres, S3) included, so they add up to more than CPU."""
    sums: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        for name, metric in (
            ("request", 'hindsight_http_request_seconds_{}{{route="/v1/batches"'),
            ("blob_put", 'hindsight_blob_seconds_{}{{op="put"'),
            ("aggregate_and_index", "hindsight_index_seconds_{} "),
        ):
            for part in ("sum", "count"):
                prefix = metric.format(part)
                if line.startswith(prefix):
                    key = f"{name}_{part}"
                    sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    out = {}
    for name in ("request", "blob_put", "aggregate_and_index"):
        if sums.get(f"{name}_count"):
            out[f"{name}_ms"] = round(sums[f"{name}_sum"] / sums[f"{name}_count"] * 1000, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--senders", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--worker-class", default="gthread")
    ap.add_argument(
        "--database-url",
        default=os.environ.get(
            "TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
        ),
    )
    args = ap.parse_args()

    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    procs: list[subprocess.Popen] = []
    admin_url = make_url(args.database_url)
    dbname = f"hindsight_bench_{secrets.token_hex(4)}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    metrics_dir = tempfile.mkdtemp(prefix="hindsight-bench-metrics-")
    try:
        print("preparing batches ...", flush=True)
        frames = Frames(pool=24)
        limit, limit_with_summary, steps = decode_limit(frames)
        print(
            f"single-core decode+validate: {limit:,.0f} events/s ({limit_with_summary:,.0f} with "
            f"the index summary); ms per batch: {steps}"
        )

        moto_port = free_port()
        procs.append(
            subprocess.Popen(
                [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(moto_port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        s3_url = f"http://127.0.0.1:{moto_port}"
        wait_ready(s3_url + "/moto-api/", procs[-1])
        boto3.client(
            "s3",
            endpoint_url=s3_url,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        ).create_bucket(Bucket="bench")

        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{dbname}"'))
        db_url = admin_url.set(database=dbname).render_as_string(hide_password=False)
        engine = make_engine(db_url)
        upgrade(engine)
        with make_sessionmaker(engine).begin() as s:
            token = create_token(s, "bench", "ingest,read")

        port = free_port()
        genv = {
            **env,
            "HINDSIGHT_DATABASE_URL": db_url,
            "HINDSIGHT_BLOB_URL": "s3://bench/hindsight",
            "HINDSIGHT_S3_ENDPOINT_URL": s3_url,
            "HINDSIGHT_AUTH": "required",
            "HINDSIGHT_AUTO_UPGRADE": "false",
            "HINDSIGHT_LOG_LEVEL": "WARNING",
            # every worker's metrics in one /metrics (the per-stage figures)
            "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
        }
        gunicorn = subprocess.Popen(
            [
                str(BIN / "gunicorn"),
                "--config",
                "python:services.gunicorn_conf",
                "--workers",
                str(args.workers),
                "--worker-class",
                args.worker_class,
                "--threads",
                str(args.threads),
                "--bind",
                f"127.0.0.1:{port}",
                "--log-level",
                "warning",
                "collector.app:create_app()",
            ],
            env=genv,
            cwd=ROOT,
        )
        procs.append(gunicorn)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readyz", gunicorn)

        # warm up: every sender's connection, every gunicorn worker's engine and S3 client
        seqs = {f"agent-{i}": 0 for i in range(args.senders)}
        with Sender(url, token) as warm:
            for agent in seqs:
                for _ in range(2):
                    assert warm.send(frames.body(agent, seqs[agent]), compressed=True).status == 202
                    seqs[agent] += 1

        latencies: list[float] = []
        accepted = [0]
        failures: dict[int | str, int] = {}
        lock = threading.Lock()
        stop_at = time.monotonic() + args.duration
        peak_rss = [tree_rss(gunicorn.pid)]

        def sender(agent: str) -> None:
            with Sender(url, token) as s:
                while time.monotonic() < stop_at:
                    body = frames.body(agent, seqs[agent])
                    t0 = time.perf_counter()
                    try:
                        resp = s.send(body, compressed=True)
                    except OSError as exc:  # counted, and the sender goes on
                        with lock:
                            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                        continue
                    dt = time.perf_counter() - t0
                    with lock:
                        if resp.status == 202:
                            latencies.append(dt)
                            accepted[0] += resp.body["accepted"]
                            seqs[agent] += 1
                        else:
                            failures[resp.status] = failures.get(resp.status, 0) + 1
                            print(f"  {agent} seq {seqs[agent]}: HTTP {resp.status} {resp.body}")

        def sample_rss() -> None:
            while time.monotonic() < stop_at:
                peak_rss[0] = max(peak_rss[0], tree_rss(gunicorn.pid))
                time.sleep(0.5)

        cpu_before = cpu_by_pid(component_pids(gunicorn.pid, procs[0].pid))
        print(f"sending for {args.duration:.0f} s with {args.senders} senders ...", flush=True)
        threads = [threading.Thread(target=sender, args=(a,)) for a in seqs] + [
            threading.Thread(target=sample_rss)
        ]
        t_start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t_start
        cores = cpu_share(
            cpu_before, cpu_by_pid(component_pids(gunicorn.pid, procs[0].pid)), elapsed
        )

        stages = collector_stages(url)

        # bytes at rest: every stored object over every event stored
        s3 = boto3.client(
            "s3",
            endpoint_url=s3_url,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        stored_bytes = stored_objects = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench"):
            for obj in page.get("Contents", []):
                stored_bytes += obj["Size"]
                stored_objects += 1
        with engine.connect() as conn:
            indexed = conn.execute(
                text("SELECT coalesce(sum(events), 0), count(*) FROM batches")
            ).one()
        engine.dispose()
        total_events = int(indexed[0])

        lat = sorted(latencies)
        ncpu = len(os.sched_getaffinity(0))
        other_cpu_per_batch = (
            sum(v for k, v in cores.items() if k != "collector") * elapsed / max(len(lat), 1)
        )
        figures = {
            "events_per_s": round(accepted[0] / elapsed),
            "ack_p50_ms": round(statistics.median(lat) * 1000, 1),
            "ack_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1),
            "bytes_per_event": round(stored_bytes / total_events, 2),
            "collector_rss_mb": round(peak_rss[0] / 2**20, 1),
            "decode_limit_events_per_s": round(limit),
            "decode_summary_events_per_s": round(limit_with_summary),
            "ratio_to_decode_limit": round(accepted[0] / elapsed / limit, 3),
            # The collector's CPU per event over one core's decode CPU per event: the work
            # per event, which the ratio above also reflects but mixed with how many cores
            # the collector got on a shared machine.
            "collector_cpu_vs_decode": round(
                cores["collector"] * elapsed / max(accepted[0], 1) * limit, 2
            ),
            # The ratio this host allows a collector that only decoded: its cores shared
            # with what moto, Postgres and the senders spend a batch (as measured here),
            # each batch then costing one core's decode on top. Past it, no collector can go.
            "ratio_ceiling_decode_only": round(
                ncpu
                * (EVENTS_PER_BATCH / limit)
                / (other_cpu_per_batch + EVENTS_PER_BATCH / limit),
                3,
            ),
            "single_core_ms_per_batch": steps,
            "collector_ms_per_batch": stages,
            "batches": len(lat),
            "failures": failures,
            "cores_used": cores,
            # the host's 1-minute load: other work on a shared machine takes the collector's cores
            "load_average": round(os.getloadavg()[0], 2),
        }
        assert stored_objects == indexed[1], (
            stored_objects,
            indexed[1],
        )  # every stored batch indexed once
        print(
            f"accepted {accepted[0]:,} events in {elapsed:.1f} s over {len(lat)} batches; "
            f"{stored_objects} objects, {stored_bytes:,} bytes stored"
        )
        for k, v in figures.items():
            print(f"  {k:30s} {v}")
        met = (
            figures["events_per_s"] >= TARGETS["events_per_s"]
            and figures["ack_p99_ms"] <= TARGETS["ack_p99_ms"]
            and figures["bytes_per_event"] <= TARGETS["bytes_per_event"]
        )
        report("ingest", figures, TARGETS, met, gauge=limit)
        return 0
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
        admin.dispose()
        shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
