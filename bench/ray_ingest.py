"""Ray-format ingest benchmark: exporter bodies (``bench/lib_ray.py``, shaped like Ray 2.60's)
POSTed to the real collector under gunicorn (2 workers), Postgres and moto's S3 server, by
concurrent senders (one per simulated node aggregator) for DURATION seconds.

Each body is what an aggregator sends: ~1,000 events, JSON, uncompressed. Like Ray, a task's
events are split over two bodies: its definition and RUNNING in one, its end (from the
submitter) in the next, so every task row is merged twice. Bodies are cut from a template
with fresh task ids (generating and serialising 1,000 events costs ~20 ms of the senders'
CPU, which shares the machine's cores with everything else).

Reports events/s acknowledged while sending, and events/s indexed end to end (until every
task of the job is written and counted in its run), ack latency, bytes on the wire and at
rest per event, and checks every task was written exactly once. The run is finished
SETTLE seconds after Ray's end of the job (the collector's wait for late events), at the
sweeper's next pass after that (up to 0.5 s): ``seconds_until_closed`` reports it apart,
as a wait for late events is not work. The job's end (2 events) is counted in the indexed
events, its closing is not timed.

    .venv/bin/python -m bench.ray_ingest [--duration 30] [--senders 6]

Six senders by default, a six-node cluster: each sender waits for its ack before the next
body (as Ray's agent does), so with three the collector's 2 workers x 4 threads idle
between bodies (~0.64 of a core busy) and the figure is the round trip's, not the stack's;
six keep it busy.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import threading
import time

import requests
from sqlalchemy import text

from bench.ingest import component_pids, cpu_by_pid, cpu_share, tree_rss
from bench.lib_ray import RaySim, b64, job_bytes
from bench.lib_results import report
from bench.lib_stack import DEFAULT_DB, Stack, full_stack
from storage.core.db import make_sessionmaker
from storage.core.tokens import create_token

TARGETS = {"events_per_s": 50_000}
SETTLE = 2  # seconds the collector waits after a job's end before closing its run
TASKS_PER_BODY = 333  # x3 events: ~1,000 events a body, Ray's largest
T0 = 1795383780.0
# Task ids of the template start with these 3 bytes (4 base64 characters); each body
# swaps them for its own, so every body carries new tasks.
NEW, ENDING = b"\xa1\xb2\xc3", b"\xd4\xe5\xf6"


class Template:
    """Bodies of one long job: body k defines and runs group k's tasks and ends group
    k-1's (the submitter reports the end after the worker reported RUNNING)."""

    def __init__(self, node: int) -> None:
        self.sim = RaySim(seed=node, workers=2, ip=f"10.0.0.{node + 1}", session_id=0)
        sim = self.sim
        news, ends = [], []
        for i in range(TASKS_PER_BODY):
            suffix = i.to_bytes(5, "big") + b"\xff" * 12 + job_bytes(1)
            start = T0 + 1 + i * 0.001
            new = sim.task(1, f"work-{i}", start, 0.05, func="work", task_id=NEW + suffix)
            old = sim.task(
                1,
                f"work-{i}",
                start,
                0.05,
                func="work",
                task_id=ENDING + suffix,
                failed=i % 50 == 49,
            )
            news += [sim.definition(new), sim.running(new)]
            ends.append(sim.submitter(old))
        self.body = json.dumps(news + ends).encode()
        self.first = json.dumps(news).encode()  # group 0: nothing to end yet
        self.ends = json.dumps(ends).encode()
        self.new_tag, self.end_tag = b64(NEW).encode(), b64(ENDING).encode()
        assert self.body.count(self.new_tag) == 2 * TASKS_PER_BODY

    @staticmethod
    def tag(node: int, group: int) -> bytes:
        return base64.b64encode(bytes([node]) + group.to_bytes(2, "big"))

    def make(self, node: int, group: int) -> bytes:
        if group == 0:
            return self.first.replace(self.new_tag, self.tag(node, 0))
        return self.body.replace(self.new_tag, self.tag(node, group)).replace(
            self.end_tag, self.tag(node, group - 1)
        )

    def last(self, node: int, group: int) -> bytes:
        """The ends of the last group (closes every task the node sent)."""
        return self.ends.replace(self.end_tag, self.tag(node, group))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--senders", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--database-url", default=DEFAULT_DB)
    args = ap.parse_args()
    templates = [Template(n) for n in range(args.senders)]  # one Ray session, a node each
    with full_stack(
        workers=args.workers,
        threads=args.threads,
        database_url=args.database_url,
        env={"HINDSIGHT_RAY_SETTLE_SECONDS": str(SETTLE)},
    ) as stack:
        return run(args, stack, templates)


def run(args: argparse.Namespace, stack: Stack, templates: list[Template]) -> int:
    engine, gunicorn, url = stack.engine, stack.gunicorn, stack.url
    with make_sessionmaker(engine).begin() as s:
        token = create_token(s, "bench", "ray")
    post_url = f"{url}/v1/ray/events?cluster=bench-ray&token={token}"
    hdr = {"Content-Type": "application/json"}
    start_events = templates[0].sim.node_events(T0) + templates[0].sim.worker_events(T0)
    start_events += templates[0].sim.job_start(1, T0 + 0.5, "python bench.py")
    for t in templates[1:]:
        start_events += t.sim.node_events(T0) + t.sim.worker_events(T0)
    assert requests.post(post_url, data=json.dumps(start_events), headers=hdr, timeout=60).ok

    latencies: list[float] = []
    counts = {"events": 0, "bytes": 0, "tasks": 0}
    failures: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + args.duration
    peak_rss = [tree_rss(gunicorn.pid)]
    groups = [0] * args.senders

    def send(http: requests.Session, data: bytes, events: int) -> bool:
        t0 = time.perf_counter()
        try:
            resp = http.post(post_url, data=data, headers=hdr, timeout=120)
        except requests.RequestException as exc:
            with lock:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            return False
        dt = time.perf_counter() - t0
        with lock:
            if resp.status_code == 200:
                latencies.append(dt)
                counts["events"] += events
                counts["bytes"] += len(data)
                return True
            failures[str(resp.status_code)] = failures.get(str(resp.status_code), 0) + 1
        return False

    def sender(node: int) -> None:
        tpl = templates[node]
        with requests.Session() as http:
            while time.monotonic() < stop_at:
                g = groups[node]
                events = 2 * TASKS_PER_BODY + (TASKS_PER_BODY if g else 0)
                if send(http, tpl.make(node, g), events):  # a refused body is sent again
                    groups[node] = g + 1
            while not send(http, tpl.last(node, groups[node] - 1), TASKS_PER_BODY):
                pass

    def sample_rss() -> None:
        while time.monotonic() < stop_at:
            peak_rss[0] = max(peak_rss[0], tree_rss(gunicorn.pid))
            time.sleep(0.5)

    cpu_before = cpu_by_pid(component_pids(gunicorn.pid, stack.moto.pid))
    print(f"sending for {args.duration:.0f} s from {args.senders} simulated nodes ...", flush=True)
    threads = [threading.Thread(target=sender, args=(n,)) for n in range(args.senders)]
    threads.append(threading.Thread(target=sample_rss))
    t_start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = time.monotonic() - t_start
    tasks = sum(groups) * TASKS_PER_BODY
    end = json.dumps(templates[0].sim.job_end(1, T0 + 100))
    assert requests.post(post_url, data=end, headers=hdr, timeout=60).ok

    # End to end: until every task is written and counted in the job's run (read from the
    # index: the collector serves no query routes), and then until the run is finished,
    # which the collector does SETTLE seconds after Ray's end of the job (a wait for late
    # events, not work: it is reported, not counted against the rate).
    run, written, cpu_after = None, None, None
    deadline = time.monotonic() + 600
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            run = conn.execute(text("SELECT status, task_count, error_count FROM runs")).first()
            if written is None and run is not None and run[1] >= tasks:
                written = time.monotonic() - t_start
                cpu_after = cpu_by_pid(component_pids(gunicorn.pid, stack.moto.pid))
            if run is not None and run[0] == "finished" and run[1] >= tasks:
                break
            time.sleep(0.05)
        closed = time.monotonic() - t_start
        done = written if written is not None else closed
        distinct = conn.execute(
            text("SELECT count(*), count(*) FILTER (WHERE emitted) FROM ray_tasks")
        ).one()
    if cpu_after is None:
        cpu_after = cpu_by_pid(component_pids(gunicorn.pid, stack.moto.pid))
    cores = cpu_share(cpu_before, cpu_after, done)  # over the same span as the rate
    s3 = stack.s3()
    stored = {"raw": 0, "derived": 0}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench"):
        for obj in page.get("Contents", []):
            stored["derived" if "/derived/" in obj["Key"] else "raw"] += obj["Size"]
    lat = sorted(latencies)
    total_events = counts["events"] + len(start_events) + 2
    figures = {
        "events_per_s": round(counts["events"] / sent),
        "indexed_events_per_s": round(total_events / done),
        "ack_p50_ms": round(statistics.median(lat) * 1000, 1),
        "ack_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1),
        "wire_bytes_per_event": round(counts["bytes"] / counts["events"], 1),
        "raw_bytes_at_rest_per_event": round(stored["raw"] / total_events, 1),
        "derived_bytes_per_task": round(stored["derived"] / max(1, tasks), 1),
        "tasks": tasks,
        "bodies": len(lat),
        "seconds_sending": round(sent, 1),
        "seconds_until_indexed": round(done, 1),
        "seconds_until_closed": round(closed, 1),
        "collector_rss_mb": round(peak_rss[0] / 2**20, 1),
        "failures": failures,
        "cores_used": cores,
        "load_average": os.getloadavg()[0],
    }
    ok = run is not None and run[0] == "finished" and run[1] == tasks and distinct == (tasks, tasks)
    figures["every_task_once"] = ok
    print(
        f"{counts['events']:,} events in {len(lat)} bodies over {sent:.1f} s; "
        f"{tasks:,} tasks indexed after {done:.1f} s; run {run}"
    )
    for k, v in figures.items():
        print(f"  {k:30s} {v}")
    met = (
        ok
        and figures["events_per_s"] >= TARGETS["events_per_s"]
        and (figures["indexed_events_per_s"] >= TARGETS["events_per_s"])
    )
    report("ray_ingest", figures, TARGETS, met)
    return 0


if __name__ == "__main__":
    sys.exit(main())
