"""What recording a Ray cluster costs Ray: the same job on two local Ray nodes, one with its
event exporter pointed at Hindsight (gunicorn, Postgres, moto's S3: the full stack, on the
same machine) and one with the exporter off, in interleaved pairs (ON/OFF, OFF/ON, ...).

Reports the job's wall time both ways and their ratio (target <= 1.05), the CPU of the
node's processes both ways — the difference is what exporting costs them, in all and by
long-lived process (GCS, raylet, the dashboard agent whose aggregator turns events into
JSON and POSTs them; the task workers' share shows only in the wall time) — the
collector's CPU, and counts the tasks whose RUNNING or
end never arrived (Ray force-kills a job's workers when the job ends, and what a worker had
not reported yet goes with it).

On a real deployment the collector, Postgres and S3 run elsewhere, so by default they get
the machine's last core and Ray the others, for both arms alike (``--no-pin``: everything
shares every core, and the collector's work counts against Ray's wall time). The job's tasks
burn CPU time (not wall time), so whatever Ray spends on exporting slows them.

    .venv/bin/python -m bench.ray_overhead [--pairs 5] [--tasks 1000] [--task-ms 20]
        [--report-ms MS] [--driver-report-ms MS] [--env NAME=VALUE] [--driver-env NAME=VALUE]
        [--no-pin]

The ratio depends on task size: exporting costs Ray a fixed amount of CPU per task (reported
as ray_export_cpu_ms_per_task), so the finer the tasks, the larger its share. It also
depends on how often Ray's workers report (``--report-ms``: 100 as docs/ray.md asks on
nodes; with Ray's default second, workers that exit with their job lose their last events);
drivers keep Ray's default (``--driver-report-ms``), as docs/ray.md says.
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
from bench.lib_ray import RayHead
from bench.lib_results import report
from bench.lib_stack import DEFAULT_DB, Stack, full_stack

TARGETS = {"wall_ratio": 1.05}
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
    ap.add_argument("--pairs", type=int, default=5)
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
    if not args.no_pin and len(cores) >= 2:
        # On a real deployment the collector, Postgres and S3 run elsewhere: give them the
        # last core and Ray (this process, so the nodes and drivers it starts) the others,
        # the same for both arms.
        stack_pids = [*descendants(gunicorn.pid), *descendants(stack.moto.pid), *named("postgres")]
        pinned = pin(stack_pids, {cores[-1]})
        pinned.update(pin([os.getpid()], set(cores[:-1])))
        print(f"Ray on cores {cores[:-1]}, the stack on core {cores[-1]}", flush=True)
    try:
        return measure(args, stack, heads, ray_cores=len(cores) - 1 if pinned else len(cores))
    finally:
        unpin(pinned)


def measure(args: argparse.Namespace, stack: Stack, heads: list[RayHead], ray_cores: int) -> int:
    engine, gunicorn, port = stack.engine, stack.gunicorn, stack.url.rsplit(":", 1)[1]
    print("starting two Ray nodes (exporter on / off) ...", flush=True)
    on = RayHead(
        f"http://127.0.0.1:{port}/v1/ray/events?cluster=overhead",
        report_ms=args.report_ms or None,
        publish_s=args.publish_s or None,
        env=dict(v.split("=", 1) for v in args.env),
        driver_env={
            "RAY_task_events_report_interval_ms": str(args.driver_report_ms or ""),
            **dict(v.split("=", 1) for v in args.driver_env),
        },
    )
    off = RayHead(None)
    heads += [on, off]
    for h in heads:
        h.start()
    on.driver(JOB, "100", "1")  # warm both: worker processes up, imports cached
    off.driver(JOB, "100", "1")
    collector = [gunicorn.pid, *children(gunicorn.pid)]

    walls: dict[str, list[float]] = {"on": [], "off": []}
    ray_cpu: dict[str, list[float]] = {"on": [], "off": []}
    by_kind: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    collector_cpu: list[float] = []
    jobs: list[tuple[str, int]] = []
    for i in range(args.pairs):
        for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
            head = on if name == "on" else off
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
                f"  pair {i + 1} {name:3s}: {out['wall']:.3f} s wall, {ray_cpu[name][-1]:.2f} s "
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

    ratios = [a / b for a, b in zip(walls["on"], walls["off"], strict=True)]
    tasks = jobs[0][1]
    figures = {
        "wall_on_s": round(statistics.median(walls["on"]), 3),
        "wall_off_s": round(statistics.median(walls["off"]), 3),
        "wall_ratio": round(statistics.median(walls["on"]) / statistics.median(walls["off"]), 3),
        "pair_ratios": [round(r, 3) for r in ratios],
        "ray_cpu_on_s": round(statistics.median(ray_cpu["on"]), 2),
        "ray_cpu_off_s": round(statistics.median(ray_cpu["off"]), 2),
        "ray_export_cpu_ms_per_task": round(
            (statistics.median(ray_cpu["on"]) - statistics.median(ray_cpu["off"])) / tasks * 1000,
            3,
        ),
        # what exporting costs each long-lived Ray process, per task (on minus off, medians)
        "ray_cpu_ms_per_task_by_process": _kinds_delta(by_kind, jobs[0][1]),
        "collector_cpu_ms_per_task": round(statistics.median(collector_cpu) / tasks * 1000, 3),
        "tasks_per_job": tasks,
        "task_ms": args.task_ms,
        "pairs": args.pairs,
        "ray_cores": ray_cores,
        "report_interval_ms": args.report_ms or 1000,
        "driver_report_interval_ms": args.driver_report_ms or 1000,
        "publish_interval_s": args.publish_s or 0.1,
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
    met = complete and not partial and figures["wall_ratio"] <= TARGETS["wall_ratio"]
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
