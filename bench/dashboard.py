"""Dashboard benchmark: how long until the page of a 100,000-task run is interactive.

Posts a synthetic run shaped like a Dask one (100,000 task records over 16 workers x 4
threads, run started/finished events, a metric sample per worker per second) through a real
embedded server (`hindsight serve`), then opens the run page in Debian's headless Chromium
and times navigation start -> every plot rendered (BokehJS has embedded every item). The
server's finished-run work (the run's compacted copy, rollups, profiles, lake) runs when the
run finishes, not on a view: the bench waits for it (``finished_work.done_at`` in the run
detail, timed as ``finish_work_s``), then times the first view and a second one, and when
the hover's task keys are in (``run_page_first_keys_s``: the page requests them while it
builds its figures and sets them once the stream is painted).

    .venv/bin/python -m bench.dashboard [--tasks 100000]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import msgspec
import requests
from playwright.sync_api import sync_playwright

from bench.lib_results import report
from bench.lib_workload import batch, task_events
from hindsight.sender import Sender

TARGETS = {"run_page_interactive_s": 2.0}
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=100_000)
    args = ap.parse_args()
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

        rng = random.Random(7)
        t0 = 1.8e9
        per = 5000
        n_batches = (args.tasks + per - 1) // per
        duration = n_batches * 2.0
        print(f"posting {args.tasks:,} task records in {n_batches} batches ...", flush=True)
        enc = msgspec.json.Encoder()
        with Sender(url) as s:
            for seq in range(n_batches):
                n = min(per, args.tasks - seq * per)
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
        (run,) = requests.get(url + "/v1/runs", timeout=30).json()["runs"]
        assert run["task_count"] == args.tasks, run
        posted = time.perf_counter()
        while True:  # the finish worker: due a settle interval after the run's last batch
            work = requests.get(f"{url}/v1/runs/{run['id']}", timeout=30).json()["finished_work"]
            if work["done_at"] is not None and not work["pending"]:
                break
            if time.perf_counter() - posted > 600:
                raise SystemExit(f"finished-run work not done after 600 s: {work}")
            time.sleep(0.2)
        finish_s = time.perf_counter() - posted
        print(f"  finished-run work done {finish_s:.1f} s after the last batch")

        figures: dict[str, float] = {}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            for label in ("first", "second"):
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                start = time.perf_counter()
                page.goto(f"{url}/runs/{run['id']}", timeout=120_000)
                page.wait_for_selector("body[data-rendered='1']", timeout=120_000)
                elapsed = time.perf_counter() - start
                # the hover's task keys, set once the stream is painted
                page.wait_for_selector("body[data-keys='1']", timeout=120_000)
                keys_s = time.perf_counter() - start
                glyphs = page.evaluate(
                    "() => Bokeh.documents[0].get_model_by_name('task-stream-source').data.x.length"
                )
                # Where the time went: the page's own marks (ms from navigation start).
                marks = page.evaluate(
                    """() => Object.fromEntries(performance.getEntriesByType('mark')
                        .map(m => [m.name, Math.round(m.startTime)]))"""
                )
                nav = page.evaluate(
                    "() => { const n = performance.getEntriesByType('navigation')[0];"
                    " return {response: Math.round(n.responseEnd),"
                    " domi: Math.round(n.domInteractive),"
                    " dcls: Math.round(n.domContentLoadedEventStart),"
                    " dom: Math.round(n.domContentLoadedEventEnd),"
                    " loads: Math.round(n.loadEventStart),"
                    " load: Math.round(n.loadEventEnd), now: Math.round(performance.now())}; }"
                )
                assert not errors, errors
                print(
                    f"  {label}: interactive after {elapsed:.2f} s, the "
                    f"hover's keys after {keys_s:.2f} s"
                    f" ({glyphs:,} task-stream glyphs);"
                    f" page ms: {nav | marks}"
                )
                figures[f"run_page_{label}_s"] = round(elapsed, 2)
                figures[f"run_page_{label}_keys_s"] = round(keys_s, 2)
                page.close()
            browser.close()
        figures["run_page_interactive_s"] = figures["run_page_first_s"]
        figures["finish_work_s"] = round(finish_s, 1)
        figures["tasks"] = args.tasks
        met = figures["run_page_interactive_s"] <= TARGETS["run_page_interactive_s"]
        report("dashboard", figures, TARGETS, met)
        return 0
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
