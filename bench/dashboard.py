"""Dashboard benchmark: how long until the page of a big run is interactive, at several
sizes in one run, and how its cost grows with the run.

For each size in ``--tasks`` (default 100,000 and 1,000,000), a fresh embedded server
(`hindsight serve`) is sent a synthetic run shaped like a Dask one (task records over 16
workers x 4 threads, 5,000 a batch two seconds apart, run started/finished events, a metric
sample per worker per second); the bench waits for the server's finished-run work (the
compacted copy, rollups, profiles, the task stream's tiles, the lake: ``finish_work_s_*``,
from the last batch; ``finish_peak_rss_mb_*`` the server process's peak RSS, ingest and
finish together), then opens the run page in Debian's headless Chromium and times
navigation start -> the first view interactive (``body[data-rendered]``: the facts drawn,
the task stream painted, sent whole or its first window fetched from the task-stream
route, and its hover answering), twice, and when the hover's task keys are in and when
every figure below the first view is drawn (``run_page_*_complete_s_*``, not a target).
``load_avg_*``: the machine's 1-minute load average as the page was opened.
``whole_run_stream_ms_*``: the task-stream route's whole-run answer at 1,000 px (median of
5, warm). ``growth_*``: the largest size's first view over the smallest's.

    .venv/bin/python -m bench.dashboard [--tasks 100000,1000000,10000000]
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import requests
from playwright.sync_api import sync_playwright

from bench.lib_results import report
from bench.lib_workload import batch, task_events
from hindsight.sender import Sender

#: Per size: seconds to interactive; and the growth, peak RSS and whole-run answer targets.
PAGE_TARGETS = {100_000: 1.5, 1_000_000: 1.5, 10_000_000: 2.0}
GROWTH_TARGET = 1.5
RSS_TARGET_MB = 2048
STREAM_TARGET_MS = 300
WINDOW_TARGET_MS = 100
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def label(n: int) -> str:
    """1e5 for 100,000."""
    exp = len(str(n)) - 1
    return f"1e{exp}" if n == 10**exp else str(n)


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident set (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def post_run(url: str, tasks: int) -> None:
    rng = random.Random(7)
    t0 = 1.8e9
    per = 5000
    n_batches = (tasks + per - 1) // per
    duration = n_batches * 2.0
    print(f"posting {tasks:,} task records in {n_batches} batches ...", flush=True)
    enc = msgspec.json.Encoder()
    with Sender(url) as s:
        for seq in range(n_batches):
            n = min(per, tasks - seq * per)
            events = task_events(n, first=seq * per, run="run-big", t0=t0 + seq * 2.0, rng=rng)
            if seq == 0:
                events.insert(
                    0,
                    {
                        "kind": "run",
                        "event": "started",
                        "id": "run-big",
                        "name": "dashboard-bench",
                        "time": t0,
                    },
                )
            if seq == n_batches - 1:
                events.append(
                    {"kind": "run", "event": "finished", "id": "run-big", "time": t0 + duration}
                )
            for w in range(16):
                for k in range(2):
                    events.append(
                        {
                            "kind": "metric",
                            "worker": f"tcp://10.0.{w // 8}.{w % 8 + 10}:{40000 + w}",
                            "time": t0 + seq * 2.0 + k,
                            "values": {
                                "memory.managed": rng.random() * 4e9,
                                "memory.unmanaged": 3e8 + rng.random() * 1e8,
                                "memory.spilled": 0.0,
                                "cpu": rng.random() * 100,
                                "tasks.processing": rng.randrange(8),
                            },
                        }
                    )
            body = enc.encode(batch("bench", "Scheduler-dash", "scheduler-0", seq, events))
            resp = s.send(body, encoding="zstd")
            assert resp.status == 202, resp.body


def measure(tasks: int) -> dict[str, float]:
    """One size on a fresh server: its figures, suffixed by the size."""
    data_dir = tempfile.mkdtemp(prefix="hindsight-dash-bench-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hindsight.cli",
            "serve",
            "--data-dir",
            data_dir,
            "--port",
            str(port),
        ],
        env={**os.environ, "HINDSIGHT_AUTH": "disabled", "HINDSIGHT_LOG_LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tag = label(tasks)
    figures: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.1)

        post_run(url, tasks)
        (run,) = requests.get(url + "/v1/runs", timeout=30).json()["runs"]
        assert run["task_count"] == tasks, run
        posted = time.perf_counter()
        while True:  # the finish worker: due a settle interval after the run's last batch
            work = requests.get(f"{url}/v1/runs/{run['id']}", timeout=30).json()["finished_work"]
            if work["done_at"] is not None and not work["pending"]:
                break
            if time.perf_counter() - posted > 3600:
                raise SystemExit(f"finished-run work not done after 3600 s: {work}")
            time.sleep(0.2)
        finish_s = time.perf_counter() - posted
        rss = peak_rss_mb(server.pid)
        print(
            f"  finished-run work done {finish_s:.1f} s after the last batch; peak RSS {rss:.0f} MB"
        )

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            for which in ("first", "second"):
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                figures[f"load_avg_{which}_{tag}"] = round(os.getloadavg()[0], 2)
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                start = time.perf_counter()
                page.goto(f"{url}/runs/{run['id']}", timeout=300_000)
                page.wait_for_selector("body[data-rendered='1']", timeout=300_000)
                elapsed = time.perf_counter() - start
                # the hover's task keys, set once the stream is painted
                page.wait_for_selector("body[data-keys='1']", timeout=300_000)
                keys_s = time.perf_counter() - start
                # the figures below the first view (their requests must not overlap the
                # next view's)
                page.wait_for_selector("body[data-complete='1']", timeout=300_000)
                complete_s = time.perf_counter() - start
                glyphs = page.evaluate(
                    "() => Bokeh.documents[0].get_model_by_name('task-stream-source').data.x.length"
                )
                mode = page.evaluate("() => document.body.dataset.streamMode || 'whole'")
                # Where the time went: the page's own marks (ms from navigation start).
                marks = page.evaluate(
                    """() => Object.fromEntries(performance.getEntriesByType('mark')
                        .map(m => [m.name, Math.round(m.startTime)]))"""
                )
                nav = page.evaluate(
                    "() => { const n = performance.getEntriesByType('navigation')[0];"
                    " return {response: Math.round(n.responseEnd),"
                    " dom: Math.round(n.domContentLoadedEventEnd)}; }"
                )
                assert not errors, errors
                print(
                    f"  {which}: interactive after {elapsed:.2f} s, the hover's keys after "
                    f"{keys_s:.2f} s, every figure after {complete_s:.2f} s ({glyphs:,} "
                    f"task-stream glyphs, stream {mode}; load {os.getloadavg()[0]:.1f});"
                    f" page ms: {nav | marks}"
                )
                figures[f"run_page_{which}_s_{tag}"] = round(elapsed, 2)
                figures[f"run_page_{which}_keys_s_{tag}"] = round(keys_s, 2)
                figures[f"run_page_{which}_complete_s_{tag}"] = round(complete_s, 2)
                figures[f"glyphs_{tag}"] = glyphs
                page.close()
            browser.close()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            body = requests.get(f"{url}/v1/runs/{run['id']}/task-stream?width=1000", timeout=60)
            times.append(time.perf_counter() - t)
            assert body.status_code == 200, body.text[:200]
        figures[f"whole_run_stream_ms_{tag}"] = round(statistics.median(times) * 1000, 1)
        figures[f"run_page_interactive_s_{tag}"] = figures[f"run_page_first_s_{tag}"]
        figures[f"finish_work_s_{tag}"] = round(finish_s, 1)
        figures[f"finish_peak_rss_mb_{tag}"] = round(rss)
        return figures
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(data_dir, ignore_errors=True)


def synthetic_tasks(n: int, chunk: int = 1_000_000) -> Any:
    """:func:`synthetic_chunk` for ``n`` tasks, a million at a time (one string column of
    ten million start/stops is past Arrow's 2 GB a chunk)."""
    import pyarrow as pa

    return pa.concat_tables(
        synthetic_chunk(min(chunk, n - lo), lo, seed) for seed, lo in enumerate(range(0, n, chunk))
    )


def synthetic_chunk(n: int, first: int, seed: int) -> Any:
    """A compacted tasks table of ``n`` tasks shaped as ``post_run``'s (16 workers x 4
    threads, 0.4 ms apart, ~50 ms each, a third with a transfer first), built with Arrow's
    vectorised kernels: the tiles' own cost at sizes whose ingest would take an hour."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rng = np.random.default_rng(seed)
    names = pa.array(["read_parquet", "getitem", "add", "sum", "to_pandas", "shuffle", "join"])
    i = np.arange(first, first + n)
    start = 1.8e9 + i * 0.0004 + rng.random(n) * 0.01
    stop = start + rng.exponential(0.05, n)
    moved = rng.random(n) < 0.3
    t_stop = start - rng.random(n) * 0.02
    t_start = t_stop - rng.random(n) * 0.05
    prefix = pc.take(names, pa.array(i % len(names)))
    text = pc.cast(pa.array(i), pa.string())

    def num(x: Any) -> Any:
        return pc.cast(pa.array(x), pa.string())

    compute = pc.binary_join_element_wise(
        '{"action":"compute","start":', num(start), ',"stop":', num(stop), "}", ""
    )
    transfer = pc.binary_join_element_wise(
        '[{"action":"transfer","start":', num(t_start), ',"stop":', num(t_stop), "},", ""
    )
    startstops = pc.if_else(
        pa.array(moved),
        pc.binary_join_element_wise(transfer, compute, "]", ""),
        pc.binary_join_element_wise("[", compute, "]", ""),
    )
    workers = pa.array([f"tcp://10.0.{w // 8}.{w % 8 + 10}:{40000 + w}" for w in range(16)])
    return pa.table(
        {
            "key": pc.binary_join_element_wise(prefix, text, "-"),
            "prefix": prefix,
            "worker": pc.take(workers, pa.array(rng.integers(0, 16, n))),
            "thread": pa.array(140270328174272 + 4096 * rng.integers(0, 4, n)),
            "status": pa.array(["memory"] * 1).take(pa.array(np.zeros(n, dtype="i8"))),
            "compute_start": start,
            "compute_stop": stop,
            "transfer": np.where(moved, t_stop - t_start, 0.0),
            "disk_read": np.zeros(n),
            "disk_write": np.zeros(n),
            "startstops": startstops,
        }
    )


def _tiles_child(n: int, out: Any) -> None:
    """In a process of its own (its peak RSS is the tiles' own): build a synthetic run's
    tiles, then time windows of it through the route's reader."""
    import resource

    import numpy as np

    from storage.core.blobs import LocalBlobStore
    from storage.query import task_stream
    from storage.runs import streamtiles

    table = synthetic_tasks(n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    root = tempfile.mkdtemp(prefix="hindsight-tiles-bench-")
    try:
        blobs = LocalBlobStore(root)
        t = time.perf_counter()
        index = streamtiles.build(blobs, "run", table)
        build_s = time.perf_counter() - t
        del table
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rng = random.Random(11)
        origin, span = index["origin"], index["span"]

        def timed(a: float | None, b: float | None, width: int, cold: bool) -> tuple[float, str]:
            if cold:
                task_stream._chunks.clear()
                task_stream._levels.clear()
            t = time.perf_counter()
            answer = task_stream.answer(blobs, "run", index, a, b, width)
            msgspec.json.encode(answer)
            return (time.perf_counter() - t) * 1000, answer["mode"]

        whole = statistics.median(timed(None, None, 1000, False)[0] for _ in range(5))
        cold, warm, modes = [], [], set()
        for _ in range(40):
            frac = 10 ** rng.uniform(-5, 0)
            a = origin + rng.uniform(0, 1 - frac) * span
            ms, mode = timed(a, a + frac * span, 1400, True)
            cold.append(ms)
            warm.append(timed(a, a + frac * span, 1400, False)[0])
            modes.add(mode)
        out.put(
            {
                "start_stops": index["count"],
                "build_s": round(build_s, 1),
                "build_rss_mb": round(peak - before),
                "whole_ms": round(whole, 1),
                "window_cold_p95_ms": round(float(np.percentile(cold, 95)), 1),
                "window_warm_p95_ms": round(float(np.percentile(warm, 95)), 1),
                "modes": sorted(modes),
            }
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tile_figures(n: int) -> dict[str, Any]:
    """The task-stream tiles of a synthetic ``n``-task run: build time and memory, and the
    route's answers (the whole run at 1,000 px warm; 40 random windows from 1e-5 of the run
    to all of it at 1,400 px, cold and warm, p95)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_tiles_child, args=(n, out))
    child.start()
    while True:
        try:
            got = out.get(timeout=5)
            break
        except queue.Empty:
            if not child.is_alive():
                raise SystemExit(f"the tiles' process ended ({child.exitcode})") from None
    child.join()
    print(f"  tiles of a synthetic {n:,}-task run: {got}")
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--tasks",
        default="100000,1000000",
        help="comma-separated run sizes, smallest first (e.g. 100000,1000000,10000000)",
    )
    ap.add_argument(
        "--tiles",
        default="",
        help="comma-separated sizes whose task-stream tiles alone are measured on a "
        "synthetic table (no ingest, no page), e.g. 10000000",
    )
    args = ap.parse_args()
    sizes = sorted(int(float(x)) for x in args.tasks.split(","))
    figures: dict[str, Any] = {"tasks": sizes}
    targets: dict[str, Any] = {}
    met = True
    for n in sizes:
        got = measure(n)
        figures |= got
        tag = label(n)
        page_target = PAGE_TARGETS.get(n, max(PAGE_TARGETS.values()))
        targets |= {
            f"run_page_interactive_s_{tag}": page_target,
            f"finish_peak_rss_mb_{tag}": RSS_TARGET_MB,
            f"whole_run_stream_ms_{tag}": STREAM_TARGET_MS,
        }
        met &= got[f"run_page_interactive_s_{tag}"] <= page_target
        met &= got[f"finish_peak_rss_mb_{tag}"] <= RSS_TARGET_MB
        met &= got[f"whole_run_stream_ms_{tag}"] <= STREAM_TARGET_MS
    for n in sorted(int(float(x)) for x in args.tiles.split(",") if x):
        got = tile_figures(n)
        tag = label(n)
        figures |= {
            f"tiles_build_s_{tag}": got["build_s"],
            f"tiles_build_rss_mb_{tag}": got["build_rss_mb"],
            f"tiles_whole_run_ms_{tag}": got["whole_ms"],
            f"tiles_window_cold_p95_ms_{tag}": got["window_cold_p95_ms"],
            f"tiles_window_warm_p95_ms_{tag}": got["window_warm_p95_ms"],
        }
        targets[f"tiles_window_cold_p95_ms_{tag}"] = WINDOW_TARGET_MS
        met &= got["window_cold_p95_ms"] <= WINDOW_TARGET_MS
    if len(sizes) > 1:
        lo, hi = label(sizes[0]), label(sizes[-1])
        growth = figures[f"run_page_interactive_s_{hi}"] / figures[f"run_page_interactive_s_{lo}"]
        figures[f"growth_{hi}_vs_{lo}"] = round(growth, 2)
        targets[f"growth_{hi}_vs_{lo}"] = GROWTH_TARGET
        met &= growth <= GROWTH_TARGET
    report("dashboard", figures, targets, bool(met))
    return 0


if __name__ == "__main__":
    sys.exit(main())
