"""What the Dask agent costs a real cluster: wall time, scheduler-process CPU, memory.

Runs the same workloads with and without the agent, interleaved in pairs, on one
LocalCluster (2 worker processes, 1 thread each) recording into a real embedded
Hindsight server (``hindsight serve`` in a subprocess):

* ``map``: ``client.gather(client.map(inc, range(N)))`` with N = 20,000 tasks;
* ``array``: ``da.ones(...).sum()`` with 15,000 chunks (20,000+ tasks).

"Without" removes the plugin from ``scheduler.plugins`` (and stops its sampler), stops
the workers' profile shipping and sets Dask's ``computations.nframes`` back to 0, so the
scheduler runs exactly its default hooks and the client sends no code; "with" puts all of
it back (profiles, fine performance metrics and code on).  Per pair the
order alternates, and the figures are medians of per-pair ratios, which cancels the
slow drift of a shared host.  Scheduler CPU is the CPU time of this process: with
LocalCluster the scheduler, the client and the agent thread all run here, so the
agent's own thread (batching, encoding, HTTP) is counted against it.

Memory: a 200,000-task ``client.map`` with the agent, sampling the agent's holdings every
0.1 s (buffered events x their measured size, the graph-walk key queue, in-memory
batches).  The process RSS is reported for context only: it is dominated by Dask's own
per-task state, and a with/without RSS difference on one process is allocator noise.

``distributed.scheduler.worker-saturation`` is set to ``inf`` to make a run cost
~1 ms of scheduler time per task instead of ~2.5 ms (dask-internals.md 7.2):
that halves the bench's runtime and makes the agent's *relative* cost larger, so the
figures are conservative.

Profile bytes: a run of pandas work (``--profile-tasks`` groupbys of 200,000 rows, deep
stacks as real jobs have) is recorded with the agent on; its profile is read back through
the API and the bytes it takes at rest (its ``run_profiles`` rows, and its share of the
tenant's ``profile_frames``) and on the wire (its share of the compressed worker batches,
by the JSON size of the profile events in each) are reported, with the seconds of task
time they cover.

Usage: ``.venv/bin/python -m bench.agent_overhead [--pairs 5] [--tasks 20000]
[--memory-tasks 200000] [--profile-tasks 40]``.  Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import requests
import zstandard
from distributed import Client, LocalCluster, span

from bench.lib_results import report
from hindsight.dask.records import task_event
from hindsight.schema import ProfileEvent, decode_batch, encode_batch

ROOT = Path(__file__).resolve().parent.parent

TARGETS = {"wall_ratio": 1.03, "scheduler_cpu_ratio": 1.05}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def inc(i: int) -> int:
    return i + 1


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Server:
    def __init__(self, data_dir: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(data_dir, "serve.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hindsight.cli",
                "serve",
                "--data-dir",
                data_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "HINDSIGHT_AUTH": "disabled"},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(f"{self.url}/v1/runs", timeout=1)
                return
            except requests.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("hindsight serve did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


NFRAMES = "distributed.diagnostics.computations.nframes"


def ship_profiles(enabled: bool, dask_worker: Any = None) -> None:
    """On a worker: start or stop the Hindsight worker plugin's profile shipping."""
    plugin = dask_worker.plugins.get("hindsight-worker")
    shipper = plugin._runtime.get("profiles") if plugin is not None else None
    if shipper is not None:
        shipper.set_enabled(enabled)


class Toggle:
    """Switch Hindsight on and off: the scheduler plugin on the in-process scheduler, the
    workers' profile shipping, and code capture in this (the client's) process."""

    def __init__(self, cluster: LocalCluster, client: Client) -> None:
        self.scheduler = cluster.scheduler
        self.client = client
        self.plugin = self.scheduler.plugins["hindsight"]
        self.nframes = dask.config.get(NFRAMES)

    def _on_loop(self, fn: Any) -> None:
        """Run ``fn`` on the scheduler's event loop and wait for it: a PeriodicCallback
        started from this thread would be bound to this thread's (idle) loop and never
        fire, and the "with" runs would go without samples."""
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self.scheduler.loop.add_callback(run)
        if not done.wait(30):
            raise RuntimeError("the scheduler's event loop did not run the toggle")

    def on(self) -> None:
        self.scheduler.plugins["hindsight"] = self.plugin
        if self.plugin._sampler is not None and not self.plugin._sampler.is_running():
            self._on_loop(self.plugin._sampler.start)
        self.client.run(ship_profiles, True)
        dask.config.set({NFRAMES: self.nframes})

    def off(self) -> None:
        self.scheduler.plugins.pop("hindsight", None)
        if self.plugin._sampler is not None and self.plugin._sampler.is_running():
            self._on_loop(self.plugin._sampler.stop)
        self.client.run(ship_profiles, False)
        dask.config.set({NFRAMES: 0})


def wait_idle(client: Client, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + 120
    while cluster.scheduler.tasks and time.monotonic() < deadline:
        time.sleep(0.05)


def run_workload(
    name: str, client: Client, cluster: LocalCluster, tasks: int
) -> tuple[float, float]:
    wait_idle(client, cluster)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if name == "map":
        futures = client.map(inc, range(tasks), pure=False)
        client.gather(futures)
        del futures
    else:
        chunks = max(1, (tasks * 3) // 4)  # + the sum tree, ~tasks in all
        da.ones((chunks * 10,), chunks=10).sum().compute()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    wait_idle(client, cluster)
    return wall, cpu


def agent_holdings(plugin: Any) -> dict[str, int]:
    agent = plugin.agent
    if agent is None:
        return {"buffer_events": 0, "graph_keys": 0, "outbox_bytes": 0}
    return {
        "buffer_events": len(agent._buffer),
        "graph_keys": sum(len(e[0]) - e[1] for e in list(plugin._pending_graphs)),
        "outbox_bytes": sum(len(b.body) for b in list(agent._outbox)),
    }


def memory_run(
    client: Client, cluster: LocalCluster, toggle: Toggle, tasks: int, with_agent: bool
) -> dict[str, Any]:
    (toggle.on if with_agent else toggle.off)()
    wait_idle(client, cluster)
    base = rss_bytes()
    peak = {"rss": base, "buffer_events": 0, "graph_keys": 0, "outbox_bytes": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], rss_bytes())
            for k, v in agent_holdings(toggle.plugin).items():
                peak[k] = max(peak[k], v)
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    futures = client.map(inc, range(tasks), pure=False)
    client.gather(futures)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    del futures
    wait_idle(client, cluster)
    return {
        "wall": wall,
        "rss_growth": peak["rss"] - base,
        **{k: peak[k] for k in ("buffer_events", "graph_keys", "outbox_bytes")},
    }


def item_bytes() -> int:
    """Bytes one buffered task record holds (tracemalloc over 10,000 typical items)."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    items = [
        (
            task_event,
            f"inc-{i:032x}",
            "inc",
            "inc",
            "run-id",
            "memory",
            "tcp://127.0.0.1:40000",
            140000000000000 + i,
            28,
            "int",
            ({"action": "compute", "start": 1.7e9 + i, "stop": 1.7e9 + i + 0.001},),
            None,
            None,
        )
        for i in range(10_000)
    ]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(s.size_diff for s in after.compare_to(before, "filename"))
    del items
    return size // 10_000


def groupby_work(i: int) -> int:
    """Pandas work with realistic stacks: a groupby-aggregate and a merge of 200,000 rows."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(i)
    df = pd.DataFrame({"k": rng.integers(0, 1000, 200_000), "v": rng.random(200_000)})
    agg = df.groupby("k")["v"].agg(["sum", "mean", "max"]).reset_index()
    return int(len(df.merge(agg, on="k")))


def profile_bytes(
    client: Client, cluster: LocalCluster, server: Server, data_dir: str, tasks: int
) -> dict[str, Any]:
    """Record one run of pandas work; its profile's bytes at rest and on the wire."""
    wait_idle(client, cluster)
    with span("bench-profile"):
        client.gather(client.map(groupby_work, range(tasks), pure=False))
    deadline = time.monotonic() + 120
    run = None
    while time.monotonic() < deadline:
        runs = requests.get(
            f"{server.url}/v1/runs", params={"name": "bench-profile"}, timeout=30
        ).json()["runs"]
        if runs and runs[0]["status"] != "running" and runs[0]["task_count"] == tasks:
            run = runs[0]
            break
        time.sleep(0.5)
    assert run is not None, f"the profiled run never finished: {runs}"
    # Let the workers' last cycles arrive: the profile must not grow any more.
    last = -1
    while time.monotonic() < deadline:
        prof = requests.get(f"{server.url}/v1/runs/{run['id']}/profile", timeout=60).json()
        if prof["samples"] == last:
            break
        last = prof["samples"]
        time.sleep(3)
    db = sqlite3.connect(os.path.join(data_dir, "index.db"))
    try:
        (run_id,) = db.execute("SELECT id FROM runs WHERE public_id = ?", (run["id"],)).fetchone()
        rows, at_rest, nodes = db.execute(
            "SELECT count(*), sum(length(data)), sum(nodes) FROM run_profiles WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        frames, frame_bytes = db.execute(
            "SELECT count(*), sum(length(name) + length(filename) + length(line) + 40 + 24) "
            "FROM profile_frames"
        ).fetchone()
        stored_runs = db.execute("SELECT count(DISTINCT run_id) FROM run_profiles").fetchone()[0]
    finally:
        db.close()
    # On the wire: each worker batch's compressed bytes, shared by JSON size.
    wire = profile_events = 0
    dctx = zstandard.ZstdDecompressor()
    for path in Path(data_dir, "blobs").rglob("worker-*/*.json.zst"):
        body = path.read_bytes()
        batch = decode_batch(dctx.stream_reader(body, read_across_frames=True).read())
        mine = [
            e
            for e in batch.events
            if isinstance(e, ProfileEvent) and run["started_at"] - 2 <= e.stop
        ]
        if not mine:
            continue
        total = len(encode_batch(batch))
        batch.events = mine
        wire += len(body) * len(encode_batch(batch)) / total
        profile_events += len(mine)
    task_seconds = prof["samples"] * prof["interval"]
    log(
        f"  {tasks} tasks, {prof['samples']:,} samples ({task_seconds:.1f} s of task threads): "
        f"{at_rest:,} bytes in {rows} rows at rest (+ frames {frame_bytes:,} bytes for {frames} "
        f"code locations, shared by {stored_runs} runs), ~{wire:,.0f} bytes on the wire in "
        f"{profile_events} events"
    )
    return {
        "profile_samples": prof["samples"],
        "profile_task_seconds": round(task_seconds, 1),
        "profile_rows": rows,
        "profile_nodes": nodes,
        "profile_bytes_at_rest": at_rest,
        "profile_frame_bytes_tenant": frame_bytes,
        "profile_frames_tenant": frames,
        "profile_wire_bytes": round(wire),
        "profile_events": profile_events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--memory-tasks", type=int, default=200_000)
    parser.add_argument("--profile-tasks", type=int, default=40)
    args = parser.parse_args()

    data_dir = tempfile.mkdtemp(prefix="hindsight-bench-")
    server = Server(data_dir)
    log(f"hindsight serve on {server.url} (data in {data_dir})")
    config = {
        "distributed.scheduler.worker-saturation": float("inf"),
        "hindsight.url": server.url,
        "hindsight.cluster": "bench",
        "hindsight.spool-dir": os.path.join(data_dir, "spool"),
        "hindsight.close-timeout": 30,
    }
    figures: dict[str, Any] = {}
    try:
        with dask.config.set(config):
            with (
                LocalCluster(
                    n_workers=2,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=":0",
                    worker_dashboard_address=":0",
                    scheduler_kwargs={"preload": ["hindsight.dask"]},
                ) as cluster,
                Client(cluster) as client,
            ):
                toggle = Toggle(cluster, client)
                log("warm-up")
                for name in ("map", "array"):
                    run_workload(name, client, cluster, 2000)
                samples: dict[str, dict[str, list[float]]] = {}
                for pair in range(args.pairs):
                    for name in ("map", "array"):
                        order = ("with", "without") if pair % 2 == 0 else ("without", "with")
                        result = {}
                        for config_name in order:
                            (toggle.on if config_name == "with" else toggle.off)()
                            result[config_name] = run_workload(name, client, cluster, args.tasks)
                        toggle.on()
                        s = samples.setdefault(name, {})
                        for cfg in ("with", "without"):
                            s.setdefault(f"wall_{cfg}", []).append(result[cfg][0])
                            s.setdefault(f"cpu_{cfg}", []).append(result[cfg][1])
                        s.setdefault("wall_pair_ratio", []).append(
                            result["with"][0] / result["without"][0]
                        )
                        s.setdefault("cpu_pair_ratio", []).append(
                            result["with"][1] / result["without"][1]
                        )
                        log(
                            f"pair {pair + 1}/{args.pairs} {name}: wall with "
                            f"{result['with'][0]:.1f}s "
                            f"without {result['without'][0]:.1f}s; cpu with "
                            f"{result['with'][1]:.1f}s "
                            f"without {result['without'][1]:.1f}s"
                        )
                all_wall = [r for s in samples.values() for r in s["wall_pair_ratio"]]
                all_cpu = [r for s in samples.values() for r in s["cpu_pair_ratio"]]
                figures["wall_ratio"] = round(statistics.median(all_wall), 4)
                figures["scheduler_cpu_ratio"] = round(statistics.median(all_cpu), 4)
                for name, s in samples.items():
                    for k, v in s.items():
                        figures[f"{name}_{k}_median"] = round(statistics.median(v), 4)
                figures["pairs"] = args.pairs
                figures["tasks_per_workload"] = args.tasks

                if args.memory_tasks:
                    log(f"memory: {args.memory_tasks} tasks with the agent")
                    with_ = memory_run(client, cluster, toggle, args.memory_tasks, True)
                    log(
                        f"  wall {with_['wall']:.1f}s, peak buffer {with_['buffer_events']} "
                        f"events, "
                        f"process RSS growth {with_['rss_growth'] / 2**20:.1f} MiB"
                    )
                    per_item = item_bytes()
                    held = (
                        with_["buffer_events"] * per_item
                        + with_["outbox_bytes"]
                        + with_["graph_keys"] * 8
                    )
                    figures["memory_tasks"] = args.memory_tasks
                    figures["agent_peak_buffer_events"] = with_["buffer_events"]
                    figures["agent_peak_graph_keys_queued"] = with_["graph_keys"]
                    figures["agent_bytes_per_buffered_task"] = per_item
                    figures["agent_peak_held_mib"] = round(held / 2**20, 2)
                    # Context only: the whole process, i.e. mostly Dask's own state for
                    # 200k tasks (an RSS with/without difference is allocator noise here).
                    figures["process_rss_growth_mib"] = round(with_["rss_growth"] / 2**20, 1)
                if args.profile_tasks:
                    log(f"profile bytes: {args.profile_tasks} pandas groupbys with the agent")
                    figures.update(
                        profile_bytes(client, cluster, server, data_dir, args.profile_tasks)
                    )
                stats = toggle.plugin.agent.stats if toggle.plugin.agent else {}
                figures["agent_batches_sent"] = int(stats.get("sent_batches", 0))
                figures["agent_events_sent"] = int(stats.get("sent_events", 0))
                figures["agent_retries"] = int(stats.get("retries", 0))
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    met = (
        figures["wall_ratio"] <= TARGETS["wall_ratio"]
        and figures["scheduler_cpu_ratio"] <= TARGETS["scheduler_cpu_ratio"]
    )
    report("agent_overhead", figures, TARGETS, met)


if __name__ == "__main__":
    main()
