"""How soon a finished Dask run is in the lake: real runs of a LocalCluster (worker processes)
recorded by a fresh ``hindsight serve``; for each, the seconds from the run's computation
returning in the user's script to the run's row answering in ``/v1/lake/runs``.

That lag is the settle interval a finished run waits for its workers' last batches
(``storage.ingest.writer.FINISH_SETTLE_S``), the finish worker's poll, the finished-run work
and the lake's commit. Target: at most 10 s for every run.

    .venv/bin/python -m bench.lake_lag [--runs 5] [--tasks 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import requests

from bench.ingest import free_port
from bench.lib_results import report

TARGET_S = 10.0


def wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"not reached in {timeout} s: {what}")
        time.sleep(0.05)


def work(i: int) -> int:
    time.sleep(0.001 * (i % 7))
    return i


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=300)
    args = ap.parse_args()

    import dask
    from distributed import Client, LocalCluster, span

    data_dir = tempfile.mkdtemp(prefix="hindsight-lake-lag-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "hindsight.cli", "serve", "--data-dir", data_dir,
         "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "HINDSIGHT_AUTH": "disabled", "HINDSIGHT_LOG_LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    http = requests.Session()

    def get(path: str, **params: object) -> dict:  # type: ignore[type-arg]
        resp = http.get(url + path, params=params, timeout=30)
        resp.raise_for_status()
        return resp.json()

    lags: list[float] = []
    try:

        def up() -> bool:
            try:
                return http.get(url + "/readyz", timeout=2).status_code == 200
            except requests.RequestException:
                if server.poll() is not None:
                    raise SystemExit("hindsight serve died") from None
                return False

        wait(up, 60, "hindsight serve to answer")
        cluster = f"lake-lag-{uuid.uuid4().hex[:8]}"
        config = {"hindsight.url": url, "hindsight.cluster": cluster}
        with dask.config.set(config):
            with LocalCluster(
                n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
                worker_dashboard_address=":0", scheduler_kwargs={"preload": ["hindsight.dask"]},
            ) as lc, Client(lc) as client:  # fmt: skip
                for r in range(args.runs):
                    name = f"lag-{r}"
                    with span(name):
                        client.gather(client.map(work, range(args.tasks), key=f"{name}-work"))
                    returned = time.monotonic()

                    def finished(name: str = name) -> dict | None:  # type: ignore[type-arg]
                        runs = get("/v1/runs", cluster=cluster, limit=100)["runs"]
                        found = [x for x in runs if x.get("name") == name]
                        return found[0] if found else None

                    run = wait(finished, 60, f"run {name}")

                    def in_lake(run_id: str = run["id"]) -> bool:
                        return bool(get("/v1/lake/runs", run=run_id, columns="run")["rows"])

                    wait(in_lake, 120, f"run {name} in the lake")
                    lags.append(time.monotonic() - returned)
                    print(f"run {r}: in the lake {lags[-1]:.2f} s after it returned", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    figures = {
        "lake_lag_s_median": round(statistics.median(lags), 2),
        "lake_lag_s_max": round(max(lags), 2),
        "runs": len(lags),
        "tasks_per_run": args.tasks,
        "load_average_1m": round(os.getloadavg()[0], 1),
    }
    targets = {"lake_lag_s_max": TARGET_S}
    report("lake_lag", figures, targets, figures["lake_lag_s_max"] <= TARGET_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
