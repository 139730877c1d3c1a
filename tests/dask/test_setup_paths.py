"""The README's set-up paths, as written: CLI preload + environment, install() on a
running cluster (with hindsight.emit and worker logs), and the LocalCluster preload."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import dask
import pytest
from distributed import Client, LocalCluster, get_task_stream, span

import hindsight
from hindsight.dask import install
from hindsight.schema import CustomEvent, LogEvent
from tests.dask.conftest import (
    EmbeddedServer,
    free_port,
    recorded_view,
    stored_events,
    stream_view,
    wait_for_run,
    wait_until,
)

BIN = Path(sys.executable).parent


def square(i: int) -> int:
    return i * i


@pytest.mark.parametrize("configured_by", ["environment", "preload options"])
def test_cli_preload(hindsight_server: EmbeddedServer, tmp_path, configured_by):
    cluster = f"cli-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    preload_args = ["--preload", "hindsight.dask"]
    if configured_by == "environment":
        env.update(HINDSIGHT_URL=hindsight_server.url, HINDSIGHT_CLUSTER=cluster)
    else:
        preload_args += ["--hindsight-url", hindsight_server.url, "--hindsight-cluster", cluster]
    address = f"tcp://127.0.0.1:{port}"
    log = open(tmp_path / "dask.log", "wb")  # noqa: SIM115
    scheduler = subprocess.Popen(
        [str(BIN / "dask"), "scheduler", *preload_args, "--host", "127.0.0.1",
         "--port", str(port), "--dashboard-address", ":0"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    worker = subprocess.Popen(
        [str(BIN / "dask"), "worker", address, "--nthreads", "2", "--dashboard-address", ":0"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            with span("from-cli"), get_task_stream(client) as ts:
                # A builtin: the scheduler and worker processes cannot import this module.
                squares = client.map(pow, range(50), [2] * 50)
                assert sum(client.gather(squares)) == sum(i * i for i in range(50))
            run = wait_for_run(hindsight_server, cluster, "from-cli", len(ts.data))
            assert recorded_view(hindsight_server.tasks(run["id"])) == stream_view(ts.data)
    finally:
        for proc in (worker, scheduler):
            proc.terminate()
            proc.wait(60)
        log.close()


def emitting_task(i: int) -> int:
    hindsight.emit("progress", {"i": i})
    if i == 3:
        logging.getLogger("user.task").warning("task %d looks odd", i)
    return i


def test_install_on_a_running_cluster_records_runs_emits_and_logs(hindsight_server):
    cluster = f"install-{uuid.uuid4().hex[:8]}"
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as lc,
        Client(lc) as client,
    ):
        install(client, url=hindsight_server.url, cluster=cluster)
        install(client, url=hindsight_server.url, cluster=cluster)  # idempotent
        with span("installed"), get_task_stream(client) as ts:
            keys = [f"emitting-{i}" for i in range(10)]
            assert client.gather(client.map(emitting_task, range(10), key=keys)) == list(range(10))
        run = wait_for_run(hindsight_server, cluster, "installed", len(ts.data))
        assert recorded_view(hindsight_server.tasks(run["id"])) == stream_view(ts.data)

        def emitted() -> list[CustomEvent]:
            events = stored_events(hindsight_server, cluster)
            return [e for e in events if type(e) is CustomEvent and e.stream == "progress"]

        custom = wait_until(lambda: len(emitted()) == 10 and emitted(), 30, "emitted values")
        assert sorted(e.value["i"] for e in custom) == list(range(10))
        assert {e.run for e in custom} == {run["run_key"]}
        assert {e.key for e in custom} == set(keys)
        workers = set(client.scheduler_info()["workers"])
        assert {e.worker for e in custom} <= workers

        def logged() -> list[LogEvent]:
            events = stored_events(hindsight_server, cluster)
            return [e for e in events if type(e) is LogEvent and e.logger == "user.task"]

        (record,) = wait_until(logged, 30, "the worker's warning")
        assert record.level == "WARNING" and record.message == "task 3 looks odd"
        assert record.worker in workers


def test_emit_outside_a_worker_is_a_no_op():
    assert hindsight.emit("anything", 1) is False


def test_preload_without_a_url_leaves_the_cluster_alone(caplog):
    with (
        dask.config.set({"hindsight.url": None}),
        LocalCluster(
            n_workers=1,
            processes=True,
            dashboard_address=":0",
            worker_dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc,
        Client(lc) as client,
    ):
        assert client.submit(square, 4).result() == 16
    assert "not recorded" in caplog.text


SCRIPT_WITHOUT_CLOSE = """
import dask.array as da
from distributed import Client, LocalCluster, span

if __name__ == "__main__":
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0",
                           scheduler_kwargs={"preload": ["hindsight.dask"]})
    client = Client(cluster)
    with span("no-close"):
        print(da.ones((100, 100), chunks=50).sum().compute())
    # no client.close() or cluster.close(): the interpreter exits here
"""


def test_a_script_that_never_closes_its_cluster_finishes_its_run(hindsight_server, tmp_path):
    """Python runs exit handlers last-registered first, so
    the agent's (registered when the scheduler started) closed it before distributed's
    closed the cluster; the scheduler's close then found the agent closed and the run
    stayed "running" for good, with every batch delivered."""
    cluster = f"noclose-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT_WITHOUT_CLOSE)
    env = {**os.environ, "HINDSIGHT_URL": hindsight_server.url, "HINDSIGHT_CLUSTER": cluster}
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, timeout=180,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "10000.0"
    assert "Plugin call failed" not in done.stderr, done.stderr
    # Every batch was sent before the process ended: the run is there now, finished.
    run = hindsight_server.run_named(cluster, "no-close")
    assert run is not None and run["status"] == "finished", hindsight_server.runs(cluster)
    assert run["task_count"] >= 4
