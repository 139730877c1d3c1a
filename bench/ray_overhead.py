"""What recording a Ray cluster costs Ray, and Hindsight's own share of it: the same job on
three local Ray nodes — export off, the exporter posting to a null sink (a loopback HTTP
server that answers 200 and keeps nothing), and the exporter posting to Hindsight (gunicorn,
Postgres, moto's S3: the full stack, on the same machine) — in interleaved rounds, each
round the three arms in another order.

Figures: ``wall_ratio``, the job's wall time exporting to Hindsight over export off (target
<= 1.03); ``hindsight_share``, exporting to Hindsight over exporting to the null sink (target
<= 1.01: what Hindsight adds to Ray's cost); ``ray_floor``, the null sink over export off
(what Ray's exporter costs with a receiver that costs nothing). Also the CPU of the nodes'
processes per arm (the difference to export off is what exporting costs them, by
long-lived process: GCS, raylet, the dashboard agent whose aggregator turns events into
JSON and POSTs them), the collector's CPU, and the tasks whose RUNNING or end never
arrived (Ray force-kills a job's workers when the job ends, and what a worker had not
reported yet goes with it).

On a real deployment the collector, Postgres and S3 run elsewhere, so by default they (and
the null sink) get the machine's last core and Ray the others, for every arm alike
(``--no-pin``: everything shares every core, and the collector's work counts against Ray's
wall time). The job's tasks burn CPU time (not wall time), so whatever Ray spends on
exporting slows them.

    .venv/bin/python -m bench.ray_overhead [--rounds 6] [--tasks 1000] [--task-ms 20]
        [--report-ms MS] [--publish-s S] [--camel-case] [--driver-report-ms MS]
        [--env NAME=VALUE] [--driver-env NAME=VALUE] [--no-pin]

The exporting nodes run docs/ray.md's recommended configuration unless told otherwise:
workers report every 100 ms (``--report-ms``; with Ray's default second, workers that exit
with their job lose their last events), the agent POSTs every second (``--publish-s``) with
the field names as in the .proto (``--camel-case``: Ray's default camelCase, whose
conversion is most of the agent's JSON work). Drivers keep Ray's default
(``--driver-report-ms``), as docs/ray.md says. The ratios depend on task size: exporting
costs Ray a fixed amount of CPU per task, so the finer the tasks, the larger its share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import text

from bench.ingest import cpu_seconds
from bench.lib_proc import descendants, named, pin, unpin
from bench.lib_ray import NullSink, RayHead
from bench.lib_results import report
from bench.lib_stack import DEFAULT_DB, Stack, full_stack

TARGETS = {"wall_ratio": 1.03, "hindsight_share": 1.01}
#: A Ray driver run by path in the node's own directory: it imports nothing of ours.
JOB = str(Path(__file__).resolve().parent / "jobs" / "ray_overhead_job.py")


def _kind(pid: int) -> str:
    """What a Ray node's process is, by its command line."""
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return "gone"
    for needle, kind in (
        ("gcs_server", "gcs"),
        ("raylet/raylet", "raylet"),
        ("ray::DashboardAgent", "dashboard_agent"),
        ("ray::RuntimeEnvAgent", "runtime_env_agent"),
        ("log_monitor", "log_monitor"),
        ("dashboard.py", "dashboard_head"),
        ("ray::", "workers"),
        ("default_worker", "workers"),
    ):
        if needle in cmd:
            return kind
    return "other"


def cpu_by_kind(pids: list[int]) -> dict[str, float]:
    """CPU seconds of a node's long-lived processes by kind (not its workers: a job's
    workers exit with it, and their CPU is mostly the tasks' own)."""
    out: dict[str, float] = {}
    for p in pids:
        kind = _kind(p)
        if kind not in ("workers", "gone"):
            out[kind] = out.get(kind, 0.0) + cpu_seconds([p])
    return out


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--rounds", type=int, default=6, help="rounds of the three arms, each order in turn"
    )
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--task-ms", type=float, default=20.0, help="CPU milliseconds per task")
    ap.add_argument("--database-url", default=DEFAULT_DB)
    ap.add_argument(
        "--report-ms",
        type=int,
        default=100,
        help="RAY_task_events_report_interval_ms on the exporting node, as docs/ray.md asks"
        " (0: Ray's default, 1,000)",
    )
    ap.add_argument(
        "--publish-s",
        type=float,
        default=1.0,
        help="how often the exporting node's agent POSTs (docs/ray.md: 1; 0: Ray's default, 0.1)",
    )
    ap.add_argument(
        "--driver-report-ms",
        type=int,
        default=0,
        help="the drivers' RAY_task_events_report_interval_ms (0: Ray's default, 1,000: a driver"
        " that connects to a running cluster flushes its events when it disconnects, so"
        " docs/ray.md leaves it alone)",
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another variable for the exporting node and its drivers (repeatable)",
    )
    ap.add_argument(
        "--driver-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for the exporting node's drivers only; NAME= unsets it (repeatable)",
    )
    ap.add_argument(
        "--camel-case",
        action="store_true",
        help="Ray's default camelCase field names (default: as in the .proto, docs/ray.md)",
    )
    ap.add_argument(
        "--no-pin",
        action="store_true",
        help="let Ray and the stack share every core (default: the stack gets the last core)",
    )
    args = ap.parse_args()
    heads: list[RayHead] = []
    # Auth disabled: the collector listens on loopback only, for this bench.
    with full_stack(
        database_url=args.database_url,
        env={"HINDSIGHT_AUTH": "disabled", "HINDSIGHT_RAY_SETTLE_SECONDS": "2"},
    ) as stack:
        try:
            return run(args, stack, heads)
        finally:
            for h in heads:
                h.stop()


def run(args: argparse.Namespace, stack: Stack, heads: list[RayHead]) -> int:
    gunicorn = stack.gunicorn
    cores = sorted(os.sched_getaffinity(0))
    pinned: dict[int, set[int]] = {}
    sink = NullSink()
    if not args.no_pin and len(cores) >= 2:
        # On a real deployment the collector, Postgres and S3 (or any receiver) run
        # elsewhere: give them and the null sink the last core and Ray (this process, so the
        # nodes and drivers it starts) the others, the same for every arm.
        stack_pids = [
            *descendants(gunicorn.pid),
            *descendants(stack.moto.pid),
            *named("postgres"),
            sink.proc.pid,
        ]
        pinned = pin(stack_pids, {cores[-1]})
        pinned.update(pin([os.getpid()], set(cores[:-1])))
        print(f"Ray on cores {cores[:-1]}, the stack on core {cores[-1]}", flush=True)
    try:
        return measure(args, stack, heads, sink, ray_cores=len(cores) - 1 if pinned else len(cores))
    finally:
        sink.stop()
        unpin(pinned)


ARMS = ("off", "null", "on")


def measure(
    args: argparse.Namespace, stack: Stack, heads: list[RayHead], sink: NullSink, ray_cores: int
) -> int:
    engine, gunicorn, port = stack.engine, stack.gunicorn, stack.url.rsplit(":", 1)[1]
    print("starting three Ray nodes (export off / to a null sink / to Hindsight) ...", flush=True)
    exporting = {
        "report_ms": args.report_ms or None,
        "publish_s": args.publish_s or None,
        "proto_names": not args.camel_case,
        "env": dict(v.split("=", 1) for v in args.env),
        "driver_env": {
            "RAY_task_events_report_interval_ms": str(args.driver_report_ms or ""),
            **dict(v.split("=", 1) for v in args.driver_env),
        },
    }
    nodes = {
        "off": RayHead(None),
        "null": RayHead(sink.url, **exporting),  # type: ignore[arg-type]
        "on": RayHead(
            f"http://127.0.0.1:{port}/v1/ray/events?cluster=overhead",
            **exporting,  # type: ignore[arg-type]
        ),
    }
    heads += nodes.values()
    for h in heads:
        h.start()
    for h in heads:  # warm each: worker processes up, imports cached
        h.driver(JOB, "100", "1")
    collector = [gunicorn.pid, *children(gunicorn.pid)]

    walls: dict[str, list[float]] = {a: [] for a in ARMS}
    ray_cpu: dict[str, list[float]] = {a: [] for a in ARMS}
    by_kind: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    collector_cpu: list[float] = []
    jobs: list[tuple[str, int]] = []
    for i in range(args.rounds):
        # Every order of the three arms in turn, so drift and neighbours' load fall on each.
        order = ARMS[i % 3 :] + ARMS[: i % 3]
        for name in order if (i // 3) % 2 == 0 else order[::-1]:
            head = nodes[name]
            c0 = cpu_seconds(head.pids())
            b0 = cpu_by_kind(head.pids())
            k0 = cpu_seconds(collector)
            out = head.driver(JOB, str(args.tasks), str(args.task_ms))
            # Ray's CPU for the job (every process of the node; the driver is ours).
            ray_cpu[name].append(cpu_seconds(head.pids()) - c0)
            b1 = cpu_by_kind(head.pids())
            by_kind[name].append({k: b1.get(k, 0.0) - b0.get(k, 0.0) for k in b1})
            if name == "on":
                collector_cpu.append(cpu_seconds(collector) - k0)
                jobs.append((out["job"], out["tasks"]))
            walls[name].append(out["wall"])
            print(
                f"  round {i + 1} {name:4s}: {out['wall']:.3f} s wall, {ray_cpu[name][-1]:.2f} s "
                f"Ray CPU",
                flush=True,
            )

    # Every exported job recorded, every task once (the collector settles, then closes).
    deadline = time.monotonic() + 300
    recorded: dict[str, int] = {}
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            recorded = dict(
                conn.execute(
                    text("SELECT run_key, task_count FROM runs WHERE status = 'finished'")
                ).all()
            )
            if all(recorded.get(j, 0) >= n for j, n in jobs):
                break
            time.sleep(0.5)
    complete = all(recorded.get(j) == n for j, n in jobs)
    with engine.connect() as conn:  # every task's RUNNING and end arrived (not just its row)
        missing = conn.execute(
            text(
                "SELECT coalesce(task_type, '?'), running_at IS NULL, finished_at IS NULL AND "
                "failed_at IS NULL,"
                " count(*) FROM ray_tasks WHERE running_at IS NULL"
                " OR (finished_at IS NULL AND failed_at IS NULL) GROUP BY 1, 2, 3"
            )
        ).all()
        received = dict(
            conn.execute(
                text(
                    "SELECT event_type, sum(count) FROM ray_event_counts WHERE kind = 'received'"
                    " GROUP BY 1"
                )
            ).all()
        )
        all_tasks = conn.scalar(text("SELECT count(*) FROM ray_tasks"))
    partial = sum(n for *_, n in missing)
    missing_detail = {
        f"{kind} without {' and '.join(w for w, m in (('RUNNING', run), ('end', end)) if m)}": n
        for kind, run, end, n in missing
    }

    med = {a: statistics.median(walls[a]) for a in ARMS}
    tasks = jobs[0][1]
    figures = {
        "wall_off_s": round(med["off"], 3),
        "wall_null_sink_s": round(med["null"], 3),
        "wall_hindsight_s": round(med["on"], 3),
        # Hindsight over export off: what recording costs the job, Ray's exporter included
        "wall_ratio": round(med["on"] / med["off"], 3),
        # Hindsight over the null sink: Hindsight's own share, Ray's exporter the same
        "hindsight_share": round(med["on"] / med["null"], 3),
        # the null sink over export off: Ray's exporter to a receiver that costs nothing
        "ray_floor": round(med["null"] / med["off"], 3),
        "round_wall_ratios": [
            round(a / b, 3) for a, b in zip(walls["on"], walls["off"], strict=True)
        ],
        "round_hindsight_shares": [
            round(a / b, 3) for a, b in zip(walls["on"], walls["null"], strict=True)
        ],
        "ray_cpu_s": {a: round(statistics.median(ray_cpu[a]), 2) for a in ARMS},
        # Ray's CPU exporting costs a task (null sink / Hindsight, each minus export off)
        "ray_export_cpu_ms_per_task": {
            a: round(
                (statistics.median(ray_cpu[a]) - statistics.median(ray_cpu["off"])) / tasks * 1000,
                3,
            )
            for a in ("null", "on")
        },
        # what exporting to Hindsight costs each long-lived Ray process, per task
        "ray_cpu_ms_per_task_by_process": _kinds_delta(by_kind, tasks),
        "collector_cpu_ms_per_task": round(statistics.median(collector_cpu) / tasks * 1000, 3),
        "tasks_per_job": tasks,
        "task_ms": args.task_ms,
        "rounds": args.rounds,
        "ray_cores": ray_cores,
        "report_interval_ms": args.report_ms or 1000,
        "driver_report_interval_ms": args.driver_report_ms or 1000,
        "publish_interval_s": args.publish_s or 0.1,
        "field_names": "camelCase" if args.camel_case else "snake_case",
        "env": args.env,
        "driver_env": args.driver_env,
        "every_job_recorded": complete,
        # what the agent exported per task, by event type (every job, the warm-up's included)
        "events_per_task": {
            k: round(int(v) / max(1, all_tasks), 2) for k, v in sorted(received.items()) if v
        },
        "tasks_missing_running_or_end": partial,
        "tasks_missing_detail": missing_detail,
        "load_average": os.getloadavg()[0],
    }
    for k, v in figures.items():
        print(f"  {k:30s} {v}")
    met = (
        complete and not partial and all(figures[k] <= v for k, v in TARGETS.items())  # type: ignore[operator]
    )
    report("ray_overhead", figures, TARGETS, met)
    return 0


def _kinds_delta(by_kind: dict[str, list[dict[str, float]]], tasks: int) -> dict[str, float]:
    on, off = by_kind["on"], by_kind["off"]
    kinds = sorted({k for d in on + off for k in d})
    return {
        k: round(
            (
                statistics.median(d.get(k, 0.0) for d in on)
                - statistics.median(d.get(k, 0.0) for d in off)
            )
            / tasks
            * 1000,
            3,
        )
        for k in kinds
    }


if __name__ == "__main__":
    sys.exit(main())
