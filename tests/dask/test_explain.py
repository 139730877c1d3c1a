"""Why a run was slower, on real LocalClusters (worker processes) recording into a real
embedded server, read back through ``GET /v1/runs/{id}/explain`` only.

One job ("nightly") runs on one Hindsight cluster name across three clusters' sessions:
usual runs, a run whose step got new CPU work in a new function, a usual run after it, a
run whose step waits longer, a run on fewer workers, and a run in a session whose scheduler
has a newer version of a package loaded (the agent reports it among the session's versions).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dask.conftest import EmbeddedServer, wait_until

JOB = "nightly"
# Few tasks of long sleeps: a usual run reads normal within ~10% of its job's median
# (explain's spread floor), so the scheduler's per-task cost on a busy host, which a run
# of many short tasks multiplies, must stay a small share of the run.
TASKS = 8
WAIT = 0.25
CPU = 0.2
USUAL_RUNS = 5


def crunch(seconds: float) -> None:
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass


def step(x: int, cpu: float = 0.0, wait: float = WAIT) -> int:
    time.sleep(wait)
    if cpu:
        crunch(cpu)
    return x


def _cluster(server: EmbeddedServer, name: str, workers: int) -> Any:
    import dask
    from distributed import LocalCluster

    config = {"hindsight.url": server.url, "hindsight.cluster": name}
    with dask.config.set(config):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        )


def _job(client: Any, **kw: Any) -> None:
    from distributed import span

    # A task group of its own per run (a group outlives its computation, and a run is the
    # span of its groups), the same prefix "step" in every run.
    group = f"step-{uuid.uuid4().hex}"
    with span(JOB):
        keys = [(group, i) for i in range(TASKS)]
        client.gather(client.map(step, range(TASKS), key=keys, **kw))


@pytest.fixture(scope="module")
def runs(hindsight_server: EmbeddedServer) -> Iterator[dict[str, Any]]:
    import dask
    from distributed import Client

    name = f"explain-{uuid.uuid4().hex[:8]}"
    kinds: list[str] = []
    with dask.config.set({"hindsight.url": hindsight_server.url, "hindsight.cluster": name}):
        with _cluster(hindsight_server, name, 2) as lc, Client(lc) as client:
            for _ in range(USUAL_RUNS):
                _job(client)
                kinds.append("usual")
            _job(client, cpu=CPU)
            kinds.append("cpu")
            _job(client)
            kinds.append("after")
            _job(client, wait=2 * WAIT)
            kinds.append("wait")
        with _cluster(hindsight_server, name, 1) as lc, Client(lc) as client:
            _job(client)
            kinds.append("fewer")
        # An upgrade between two nightly runs: the next session's scheduler reports the
        # version of the package it has loaded (set here on the module it reads it from).
        import hindsight

        installed = hindsight.__version__
        hindsight.__version__ = f"{installed}.post1"
        try:
            with _cluster(hindsight_server, name, 2) as lc, Client(lc) as client:
                _job(client)
                kinds.append("upgraded")
        finally:
            hindsight.__version__ = installed
    server = hindsight_server

    def all_in() -> list[dict[str, Any]] | None:
        found = [r for r in server.runs(name) if r.get("name") == JOB]
        if len(found) < len(kinds) or any(r["status"] != "finished" for r in found):
            return None
        return sorted(found, key=lambda r: r["started_at"])

    try:
        found = wait_until(all_in, 120, "every run of the job")
    except AssertionError:
        seen = [(r.get("name"), r["status"], r["task_count"]) for r in server.runs(name)]
        raise AssertionError(f"{len(kinds)} runs expected: {seen}") from None

    def settled(run_id: str) -> bool:
        r = server.get(f"/v1/runs/{run_id}")
        return r["completeness"]["closed"] and not r["finished_work"]["pending"]

    for r in found:
        wait_until(lambda r=r: settled(r["id"]), 120, "finished-run work")
    yield {
        "ids": dict(zip(kinds, [r["id"] for r in found], strict=True)),  # usual: the last
        "order": [r["id"] for r in found],
        "installed": installed,
    }


def explain(server: EmbeddedServer, run_id: str, **params: Any) -> dict[str, Any]:
    return server.get(f"/v1/runs/{run_id}/explain", **params)


def test_usual_runs_read_normal_and_the_first_no_history(hindsight_server, runs):
    order = runs["order"]
    for run_id in order[:3]:  # fewer than 3 earlier runs: nothing to judge by
        out = explain(hindsight_server, run_id)
        assert out["verdict"] == "no history" and out["baseline"]["n"] == 0
        assert "too few" in out["text"]
    for run_id in order[3:USUAL_RUNS]:
        out = explain(hindsight_server, run_id)
        assert out["verdict"] == "normal", out["text"]
        assert out["baseline"]["runs"] == order[: order.index(run_id)]


def test_new_cpu_work_in_a_new_function(hindsight_server, runs):
    out = explain(hindsight_server, runs["ids"]["cpu"])
    assert out["verdict"] == "slower", out["text"]
    # judged by the usual runs (one slowed by the host may be left out as unusual)
    assert set(out["baseline"]["runs"]) <= set(runs["order"][:USUAL_RUNS])
    assert out["baseline"]["n"] >= USUAL_RUNS - 1 and out["change"] > 0.3
    kinds = [f["kind"] for f in out["findings"]]
    assert kinds[0] in ("step", "activity", "profile"), out["findings"]
    steps = [f for f in out["findings"] if f["kind"] == "step"]
    assert steps and steps[0]["prefix"] == "step"
    acts = {f["activity"]: f for f in out["findings"] if f["kind"] == "activity"}
    # crunch burns CPU seconds of its thread's CPU time per task; the wait for a core
    # on a busy host shows as thread-noncpu beside it (and may rank first)
    cpu = acts["thread-cpu"]
    assert cpu["after"] - cpu["before"] == pytest.approx(TASKS * CPU, abs=0.3), acts
    assert cpu["seconds"] > 0
    prof = [f for f in out["findings"] if f["kind"] == "profile"]
    assert prof and prof[0]["frames"][0]["function"] == "crunch", prof
    assert prof[0]["frames"][0]["before_share"] == 0
    assert prof[0]["frames"][0]["file"].endswith("test_explain.py")
    assert "longer" in out["text"]


def test_a_usual_run_after_a_slow_one_reads_normal(hindsight_server, runs):
    out = explain(hindsight_server, runs["ids"]["after"])
    assert out["verdict"] == "normal", out["text"]
    assert runs["ids"]["cpu"] not in out["baseline"]["runs"]


def test_a_step_made_to_wait_longer(hindsight_server, runs):
    out = explain(hindsight_server, runs["ids"]["wait"])
    assert out["verdict"] == "slower", out["text"]
    acts = [f for f in out["findings"] if f["kind"] == "activity"]
    assert acts[0]["activity"] == "thread-noncpu", acts
    assert "thread-cpu" not in {f["activity"] for f in acts}  # nothing to explain there
    assert runs["ids"]["cpu"] not in out["baseline"]["runs"]


def test_fewer_workers(hindsight_server, runs):
    out = explain(hindsight_server, runs["ids"]["fewer"])
    assert out["verdict"] == "slower", out["text"]
    cluster = {f["what"]: f for f in out["findings"] if f["kind"] == "cluster"}
    assert (cluster["workers"]["before"], cluster["workers"]["after"]) == (2, 1)
    assert (cluster["threads"]["before"], cluster["threads"]["after"]) == (2, 1)
    assert out["findings"][0]["kind"] == "cluster"


def test_a_changed_package_version(hindsight_server, runs):
    out = explain(hindsight_server, runs["ids"]["upgraded"])
    env = [f for f in out["findings"] if f["kind"] == "environment"]
    got = [(f["what"], f["before"], f["after"]) for f in env]
    assert got == [("hindsight", runs["installed"], f"{runs['installed']}.post1")], out["findings"]


def test_against_a_chosen_run_and_bad_input(hindsight_server, runs):
    ids = runs["ids"]
    out = explain(hindsight_server, ids["cpu"], baseline=ids["after"])
    assert out["verdict"] == "slower" and out["baseline"]["runs"] == [ids["after"]]
    import requests

    url = f"{hindsight_server.url}/v1/runs/{ids['cpu']}/explain"
    same = requests.get(url, params={"baseline": ids["cpu"]}, timeout=30)
    assert same.status_code == 400 and "baseline" in same.json()["error"]["message"]
    missing = requests.get(url, params={"baseline": str(uuid.uuid4())}, timeout=30)
    assert missing.status_code == 404


def test_the_cli_and_the_python_client(hindsight_server, runs):
    import json
    import subprocess

    import hindsight

    run_id = runs["ids"]["cpu"]
    exe = os.path.join(os.path.dirname(sys.executable), "hindsight")
    env = {**os.environ, "HINDSIGHT_QUERY_URL": hindsight_server.url}
    shown = subprocess.run(
        [exe, "explain", run_id], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    first, *rest = shown.stdout.splitlines()
    assert first.startswith("slower: This run took") and "longer than its usual" in first
    assert any("[profile]" in line and "crunch" in line for line in rest)
    as_json = subprocess.run(
        [exe, "explain", run_id, "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert json.loads(as_json.stdout) == explain(hindsight_server, run_id)
    bad = subprocess.run(
        [exe, "explain", str(uuid.uuid4())], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "404" in bad.stderr

    out = hindsight.Client(hindsight_server.url).explain(run_id)
    assert out == explain(hindsight_server, run_id)
    page = out._repr_html_()
    assert (
        "<b>slower</b>" in page
        and "crunch" in page
        and page.count("<tr>") == 1 + len(out["findings"])
    )
