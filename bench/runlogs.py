"""A run with 100,000 log records and 100,000 emitted values, read back through the real
query service (Flask app, SQLite index, local blob store): what building its stored tables
costs once the run has finished, and what bounded answers cost afterwards.

The run's scheduler batches hold 20,000 task records (what a finisher must skip without
decoding), its worker batches the log records (4 levels, 50 workers, a task key on half)
and values on 10 streams. Measured:

- ``build_s``: the run's first read of its logs (storage.runs.runlogs decodes the batches that
  hold log, custom or worker events and writes three Parquet tables), as the finisher does;
- ``logs_page_ms``: median of filtered pages (level, worker, time range, text) with the
  tables read from the blob store each time (process cache cleared), 100 records a page;
- ``stream_ms``: median of one stream's first page and its aggregate per interval, cold;
- ``lifecycle_ms``: median of the lifecycle route, cold;
- without targets: bytes at rest of the three tables, and per log record.

    .venv/bin/python -m bench.runlogs [--logs 100000] [--values 100000]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import zstandard

from bench.lib_results import report
from collector.app import create_app as collector_app
from services.query.app import create_app as query_app
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token
from storage.runs import runlogs

TARGETS = {"build_s": 10.0, "logs_page_ms": 200, "stream_ms": 200, "lifecycle_ms": 200}
T0 = 1_780_000_000.0
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def batch(agent: str, seq: int, events: list[dict[str, Any]]) -> bytes:
    body = {
        "schema": 1,
        "cluster": "bench",
        "session": "s1",
        "agent": agent,
        "seq": seq,
        "events": events,
    }
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(body).encode())


def batches(n_logs: int, n_values: int, n_tasks: int = 20_000) -> list[bytes]:
    span = 600.0
    out = []
    tasks = [
        {
            "kind": "task",
            "key": f"work-{i}",
            "prefix": "work",
            "status": "memory",
            "run": "r",
            "worker": f"tcp://10.0.0.{i % 50}:4000",
            "thread": 1,
            "nbytes": 80,
            "startstops": [
                {
                    "action": "compute",
                    "start": T0 + i * span / n_tasks,
                    "stop": T0 + i * span / n_tasks + 0.01,
                }
            ],
        }
        for i in range(n_tasks)
    ]
    head = [{"kind": "run", "event": "started", "id": "r", "name": "logs", "time": T0}]
    head += [
        {
            "kind": "worker",
            "event": "joined",
            "address": f"tcp://10.0.0.{w}:4000",
            "time": T0 - 1,
            "name": str(w),
        }
        for w in range(50)
    ]
    tail = [{"kind": "run", "event": "finished", "id": "r", "time": T0 + span}]
    for j in range(0, n_tasks, 5000):
        events = (head if j == 0 else []) + tasks[j : j + 5000]
        events += tail if j + 5000 >= n_tasks else []
        out.append(batch("scheduler-1", j // 5000, events))
    side = []
    for i in range(n_logs):
        rec = {
            "kind": "log",
            "time": T0 + i * span / n_logs,
            "level": LEVELS[i % 4],
            "worker": f"tcp://10.0.0.{i % 50}:4000",
            "logger": "user.etl",
            "message": f"row group {i} of part-{i % 977}.parquet read, {i * 7 % 10007} rows",
        }
        if i % 2:
            rec.update(key=f"work-{i % n_tasks}", run="r")
        side.append(rec)
    for i in range(n_values):
        side.append(
            {
                "kind": "custom",
                "stream": f"metric-{i % 10}",
                "time": T0 + i * span / n_values,
                "value": (i % 1000) / 10,
                "worker": f"tcp://10.0.0.{i % 50}:4000",
                "run": "r",
                "key": f"work-{i % n_tasks}",
            }
        )
    side.sort(key=lambda e: e["time"])
    for j in range(0, len(side), 5000):
        out.append(batch(f"worker-{j // 5000 % 50}-x", j // 250_000, side[j : j + 5000]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", type=int, default=100_000)
    ap.add_argument("--values", type=int, default=100_000)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-runlogs-"))
    atexit.register(shutil.rmtree, tmp, True)  # gone however the bench ends
    config = {
        "data_dir": str(tmp),
        "database_url": f"sqlite:///{tmp / 'index.db'}",
        "blob_url": (tmp / "blobs").as_uri(),
        "auth": "required",
        "finish_worker": False,
    }
    engine = make_engine(config["database_url"])
    upgrade(engine)
    with make_sessionmaker(engine).begin() as db:
        token = create_token(db, "bench", "ingest,read")
    engine.dispose()
    h = {"Authorization": f"Bearer {token}"}
    collector = collector_app(config).test_client()
    bodies = batches(args.logs, args.values)
    for body in bodies:
        resp = collector.post(
            "/v1/batches",
            data=body,
            headers={**h, "Content-Type": "application/json", "Content-Encoding": "zstd"},
        )
        assert resp.status_code == 202, resp.json
    query = query_app(config).test_client()
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    base = f"/v1/runs/{run['id']}"

    def get(path: str) -> Any:
        resp = query.get(base + path, headers=h)
        assert resp.status_code == 200, (path, resp.json)
        return resp.json

    t = time.perf_counter()
    first = get("/logs?limit=100")
    build_s = time.perf_counter() - t
    assert first["total"] == args.logs, first["total"]
    at_rest = sum(p.stat().st_size for p in (tmp / "blobs").rglob("extras/*/*.parquet"))

    def cold(path: str) -> float:
        runlogs.clear_cache()
        t = time.perf_counter()
        get(path)
        return (time.perf_counter() - t) * 1000

    pages = [
        "/logs?level=error&limit=100",
        "/logs?worker=tcp://10.0.0.7:4000&limit=100",
        f"/logs?since={T0 + 100}&until={T0 + 200}&limit=100",
        "/logs?q=PART-42.parquet&limit=100",
        "/logs?limit=100&cursor=" + first["next_cursor"],
    ]
    logs_ms = [cold(p) for p in pages for _ in range(3)]
    stream_ms = [cold("/streams/metric-3?limit=100&buckets=100") for _ in range(5)]
    streams = get("/streams")["streams"]
    assert sum(s["count"] for s in streams) == args.values
    life_ms = [cold("/lifecycle") for _ in range(5)]
    figures = {
        "logs": args.logs,
        "values": args.values,
        "build_s": round(build_s, 2),
        "logs_page_ms": round(statistics.median(logs_ms), 1),
        "logs_page_max_ms": round(max(logs_ms), 1),
        "stream_ms": round(statistics.median(stream_ms), 1),
        "lifecycle_ms": round(statistics.median(life_ms), 1),
        "bytes_at_rest": at_rest,
        "bytes_per_record": round(at_rest / (args.logs + args.values), 1),
        "load_average": os.getloadavg()[0],
    }
    for k, v in figures.items():
        print(f"{k:>20}: {v}")
    met = all(figures[k] <= v for k, v in TARGETS.items())
    report("runlogs", figures, TARGETS, met)


if __name__ == "__main__":
    main()
