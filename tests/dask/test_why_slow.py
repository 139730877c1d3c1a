"""Why a run was slow, end to end: a real LocalCluster (worker processes) records into a
real embedded server, and everything is read back through the API only.

One cluster runs four jobs: a CPU-bound prefix, a sleep-bound one, and a run longer than
the workers' profile history (shrunk by Dask config to 8 cycles of 0.2 s), whose early
prefix has left every worker's history by the time it is read.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until

HISTORY_CYCLES = 8
CYCLE = "200ms"


def burn_cpu(x: int) -> int:
    # 0.25 s of this thread's CPU time, however busy the host is.
    deadline = time.thread_time() + 0.25
    n = 0
    while time.thread_time() < deadline:
        n += 1
    return x


def doze(x: int) -> int:
    time.sleep(0.25)
    return x


def gated_doze(x: int, gate: str) -> int:
    from distributed import Event

    Event(gate).wait(60)
    return doze(x)


def known(key: str, dask_scheduler: Any = None) -> bool:
    return key in dask_scheduler.tasks


def early_work(x: int) -> int:
    deadline = time.time() + 0.3
    while time.time() < deadline:
        pass
    return x


def late_wait(x: int) -> int:
    time.sleep(0.5)
    return x


@pytest.fixture(scope="module")
def recorded(hindsight_server: EmbeddedServer) -> Iterator[dict[str, Any]]:
    import dask
    from distributed import Client, Event, LocalCluster, span

    nframes = "distributed.diagnostics.computations.nframes"
    before = dask.config.get(nframes)
    cluster = f"why-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": hindsight_server.url,
        "hindsight.cluster": cluster,
        "distributed.admin.low-level-log-length": HISTORY_CYCLES,
        "distributed.worker.profile.cycle": CYCLE,
    }
    out: dict[str, Any] = {"cluster": cluster}
    try:
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            out["nframes"] = dask.config.get(nframes)
            with span("cpu-bound"):
                # One worker: two spinning processes would compete for this host's 2 cores.
                first = sorted(client.scheduler_info()["workers"])[0]
                client.gather(client.map(burn_cpu, range(8), workers=[first]))
            with span("sleep-bound"):
                client.gather(client.map(doze, range(8)))
            with span("longer-than-history"):
                client.gather(client.map(early_work, range(2)))
                client.gather(client.map(late_wait, range(8)))
            with span("submitted-later"):
                # finish depends on base alone, but the client submits it only once it
                # has slowstep's result: slowstep set the makespan.
                base = client.submit(doze, 1, key="base-0")
                client.submit(late_wait, 2, key="slowstep-0").result()
                client.submit(doze, base, key="finish-0").result()
                del base
            with span("persisted-then-computed"):
                # 6 tasks of 0.25 s on 2 threads, held back until the scheduler has their
                # sum's graph: it lists them again while most are still queued, and they
                # were not submitted then
                gate = Event(f"gate-{cluster}", client=client)
                held = dask.persist(*(dask.delayed(gated_doze)(i, gate.name, dask_key_name=f"part-{i}")
                                      for i in range(6)))  # fmt: skip
                total = client.compute(dask.delayed(sum)(list(held), dask_key_name="total-0"))
                wait_until(lambda: client.run_on_scheduler(known, "total-0"), 30, "the sum's graph")
                gate.set()
                total.result()
                del held, total

            def history_prefixes(dask_worker: Any) -> list[str]:
                return sorted({p for _, trees in dask_worker.profile_keys_history for p in trees})

            out["history"] = client.run(history_prefixes)
        yield out
    finally:
        dask.config.set({nframes: before})


def run_of(server: EmbeddedServer, recorded: dict[str, Any], name: str, tasks: int) -> str:
    """The run's id once every agent of the (closed) cluster delivered its final batch, so
    the profile batches that trail a run are in."""
    run_id = wait_for_run(server, recorded["cluster"], name, tasks)["id"]
    wait_until(
        lambda: server.get(f"/v1/runs/{run_id}")["completeness"]["closed"], 60, "final batches"
    )
    return run_id


def profile(server: EmbeddedServer, run_id: str, **params: Any) -> dict[str, Any]:
    return server.get(f"/v1/runs/{run_id}/profile", **params)


def settled_profile(server: EmbeddedServer, run_id: str, prefix: str, frame: str) -> dict[str, Any]:
    p = profile(server, run_id, prefix=prefix)
    assert any(t["name"] == frame for t in p["top"]), p["top"]
    return p


def activity_of(server: EmbeddedServer, run_id: str, prefix: str) -> dict[str, float]:
    """Seconds by activity of a prefix, once thread-cpu and thread-noncpu are both in."""

    def ready() -> dict[str, float] | None:
        rows = server.get(f"/v1/runs/{run_id}/activity")["activity"]
        got = {
            r["activity"]: r["value"]
            for r in rows
            if r["prefix"] == prefix and r["context"] == "execute" and r["unit"] == "seconds"
        }
        return got if {"thread-cpu", "thread-noncpu"} <= set(got) else None

    return wait_until(ready, 60, f"fine performance metrics of {prefix}")


def test_a_prefix_spinning_in_a_function_has_it_as_its_hottest_frame(hindsight_server, recorded):
    run_id = run_of(hindsight_server, recorded, "cpu-bound", 8)
    p = settled_profile(hindsight_server, run_id, "burn_cpu", "burn_cpu")
    hottest = p["top"][0]
    assert hottest["name"] == "burn_cpu" and hottest["filename"].endswith("test_why_slow.py")
    # 8 tasks of 0.25 s at 10 ms a sample: well over half of the ~200 samples land in it.
    assert hottest["self"] >= 100 and hottest["self"] >= 0.8 * p["samples"]
    # The merged call tree: the function sits under Dask's task call, with its own samples.
    path, node = [], p["tree"]
    while node["children"]:
        node = node["children"][0]
        path.append(node["name"])
    assert path[-1] == "burn_cpu" and node["self"] == hottest["self"]
    # The whole run and one worker's share of it.
    assert profile(hindsight_server, run_id)["samples"] >= p["samples"]
    workers = {t["worker"] for t in hindsight_server.tasks(run_id)}
    per_worker = [profile(hindsight_server, run_id, worker=w)["samples"] for w in workers]
    assert sum(per_worker) == p["samples"] and all(per_worker)


def test_profile_exports_read_by_flamegraph_tools(hindsight_server, recorded):
    run_id = run_of(hindsight_server, recorded, "cpu-bound", 8)
    p = settled_profile(hindsight_server, run_id, "burn_cpu", "burn_cpu")
    url = f"{hindsight_server.url}/v1/runs/{run_id}/profile"
    folded = requests.get(url, params={"prefix": "burn_cpu", "format": "collapsed"}, timeout=30)
    assert folded.headers["Content-Type"].startswith("text/plain")
    lines = folded.text.strip().splitlines()
    counts = [int(line.rsplit(" ", 1)[1]) for line in lines]
    assert sum(counts) == p["samples"]
    assert any(line.rsplit(" ", 1)[0].split(";")[-1].startswith("burn_cpu (") for line in lines)
    scope = requests.get(url, params={"prefix": "burn_cpu", "format": "speedscope"}, timeout=30)
    doc = scope.json()
    (prof,) = doc["profiles"]
    assert prof["type"] == "sampled" and len(prof["samples"]) == len(prof["weights"])
    names = {f["name"] for f in doc["shared"]["frames"]}
    assert "burn_cpu" in names
    assert sum(prof["weights"]) == pytest.approx(p["seconds"])


def compute_seconds(server: EmbeddedServer, run_id: str) -> float:
    return sum(
        s["stop"] - s["start"]
        for t in server.tasks(run_id)
        for s in t["startstops"]
        if s["action"] == "compute"
    )


def test_cpu_bound_and_sleep_bound_prefixes_show_where_their_time_went(hindsight_server, recorded):
    server = hindsight_server
    cpu_run = run_of(server, recorded, "cpu-bound", 8)
    sleepy_run = run_of(server, recorded, "sleep-bound", 8)
    cpu = activity_of(server, cpu_run, "burn_cpu")
    sleepy = activity_of(server, sleepy_run, "doze")
    # burn_cpu burns exactly 8 x 0.25 s of its thread's CPU; doze sleeps 8 x 0.25 s.
    assert cpu["thread-cpu"] == pytest.approx(2.0, abs=0.2)
    assert sleepy["thread-cpu"] < 0.2 < 1.8 < sleepy["thread-noncpu"]
    assert sleepy["thread-noncpu"] > sleepy["thread-cpu"]
    # The metrics of the last tasks came with a heartbeat after each run ended: the
    # thread time of all 8 tasks is there, as much as their compute time in the task
    # records (Dask measures both around the same call).
    for seconds, run_id in ((cpu, cpu_run), (sleepy, sleepy_run)):
        thread = seconds["thread-cpu"] + seconds["thread-noncpu"]
        assert thread == pytest.approx(compute_seconds(server, run_id), rel=0.05)
    # A busy host makes a spinning thread wait for a core, which Dask counts as
    # thread-noncpu: the CPU-bound prefix is above its noncpu time whenever the host had a
    # core to give it (this shared host is often loaded far past its 2 cores).
    if os.getloadavg()[0] < (os.cpu_count() or 1):
        assert cpu["thread-cpu"] > cpu["thread-noncpu"]
    cpu_share = cpu["thread-cpu"] / (cpu["thread-cpu"] + cpu["thread-noncpu"])
    sleepy_share = sleepy["thread-cpu"] / (sleepy["thread-cpu"] + sleepy["thread-noncpu"])
    assert cpu_share > 5 * sleepy_share
    body = server.get(f"/v1/runs/{sleepy_run}/activity")
    totals = {(t["activity"], t["unit"]): t["value"] for t in body["totals"]}
    assert totals[("thread-noncpu", "seconds")] >= sleepy["thread-noncpu"]


def test_the_critical_path_tells_a_task_not_yet_submitted_from_one_waiting(
    hindsight_server, recorded
):
    """A task submitted once the client had another's result
    read as seconds of "wait" (queued, or no free thread) after its dependency, though it
    did not exist yet."""
    run_id = run_of(hindsight_server, recorded, "submitted-later", 3)
    cp = hindsight_server.get(f"/v1/runs/{run_id}/critical-path")
    steps = [(s["kind"], s["key"]) for s in cp["segments"] if s["kind"] != "wait"]
    assert steps == [("compute", "base-0"), ("unsubmitted", "finish-0"),
                     ("compute", "finish-0")], cp["segments"]  # fmt: skip
    # from base's end (0.25 s, beside slowstep) to slowstep's result at the client (0.5 s)
    assert cp["totals"]["unsubmitted"] >= 0.2 > cp["totals"].get("wait", 0.0)


def test_tasks_a_later_graph_touches_keep_their_own_submission(hindsight_server, recorded):
    """Persisted tasks still queued when a later compute() references them (its graph lists
    them again) were submitted with the persist, not then: none of their wait reads as
    "unsubmitted"."""
    run_id = run_of(hindsight_server, recorded, "persisted-then-computed", 7)
    cp = hindsight_server.get(f"/v1/runs/{run_id}/critical-path")
    assert "unsubmitted" not in cp["totals"], cp["segments"]
    assert [s["key"] for s in cp["segments"] if s["kind"] == "compute"][-1] == "total-0"


def test_the_submitting_code_is_in_the_run_detail(hindsight_server, recorded):
    # The preload raised nframes in this process (an in-process LocalCluster's clients).
    assert recorded["nframes"] >= 1
    run_id = run_of(hindsight_server, recorded, "cpu-bound", 8)

    def code() -> list[dict[str, Any]]:
        return hindsight_server.get(f"/v1/runs/{run_id}")["code"]

    (submission,) = wait_until(code, 60, "the submitting code")
    frame = submission["frames"][0]
    assert frame["filename"].endswith("test_why_slow.py")
    lines = frame["code"].splitlines()
    assert "client.map(burn_cpu" in lines[frame["lineno_relative"]]


def test_a_run_longer_than_the_profile_history_keeps_its_early_profile(hindsight_server, recorded):
    # The early prefix has left every worker's profile history ...
    assert recorded["history"] and all(
        "early_work" not in prefixes for prefixes in recorded["history"].values()
    )
    # ... and is in the run's profile all the same.
    run_id = run_of(hindsight_server, recorded, "longer-than-history", 10)
    p = settled_profile(hindsight_server, run_id, "early_work", "early_work")
    assert p["top"][0]["name"] == "early_work" and p["samples"] > 0
    late = settled_profile(hindsight_server, run_id, "late_wait", "late_wait")
    assert late["top"][0]["name"] == "late_wait"


def test_profiles_across_runs_and_their_difference(hindsight_server, recorded):
    server = hindsight_server
    cpu = run_of(server, recorded, "cpu-bound", 8)
    sleepy = run_of(server, recorded, "sleep-bound", 8)
    one = settled_profile(server, cpu, "burn_cpu", "burn_cpu")
    settled_profile(server, sleepy, "doze", "doze")
    merged = server.get("/v1/profiles", prefix="burn_cpu", cluster=recorded["cluster"])
    assert merged["runs"] == 1 and merged["samples"] == one["samples"]
    by_name = server.get("/v1/profiles", name="sleep-bound")
    assert by_name["runs"] >= 1 and by_name["top"][0]["name"] == "doze"
    diff = server.get("/v1/compare/profile", a=sleepy, b=cpu)

    def find(node: dict[str, Any], name: str) -> dict[str, Any] | None:
        if node["name"] == name:
            return node
        for child in node["children"]:
            found = find(child, name)
            if found:
                return found
        return None

    spun, dozed = find(diff["tree"], "burn_cpu"), find(diff["tree"], "doze")
    assert spun and spun["a"] == 0 and spun["b"] > 0 and spun["delta"] > 0.5
    assert dozed and dozed["b"] == 0 and dozed["delta"] < -0.5
    folded = requests.get(
        f"{server.url}/v1/compare/profile", params={"a": sleepy, "b": cpu, "format": "collapsed"},
        timeout=30,
    ).text  # fmt: skip
    assert all(len(line.rsplit(" ", 2)) == 3 for line in folded.strip().splitlines())


def test_activity_history_of_a_prefix(hindsight_server, recorded):
    run_id = run_of(hindsight_server, recorded, "cpu-bound", 8)
    cpu = activity_of(hindsight_server, run_id, "burn_cpu")
    body = hindsight_server.get(
        "/v1/history/activity", prefix="burn_cpu", cluster=recorded["cluster"], bucket="hour"
    )
    (point,) = body["points"]
    assert point["runs"] == 1
    assert point["activity"]["thread-cpu"]["total"] == pytest.approx(cpu["thread-cpu"])
    assert json.dumps(point)  # plain JSON


def test_the_python_client_reads_profiles_and_activity(hindsight_server, recorded):
    from hindsight import Client

    c = Client(hindsight_server.url)
    run_id = run_of(hindsight_server, recorded, "cpu-bound", 8)
    tree = c.profile(run_id, prefix="burn_cpu")
    assert tree["top"][0]["name"] == "burn_cpu"
    folded = c.profile(run_id, prefix="burn_cpu", format="collapsed")
    assert sum(int(line.rsplit(" ", 1)[1]) for line in folded.splitlines()) == tree["samples"]
    assert c.profile(run_id, format="speedscope")["profiles"][0]["type"] == "sampled"
    df = c.activity(run_id)
    seconds = df[df.unit == "seconds"].pivot_table("value", "prefix", "activity", "sum")
    assert seconds.loc["burn_cpu", "thread-cpu"] == pytest.approx(2.0, abs=0.2)
    assert {t["activity"] for t in df.attrs["totals"]} >= {"thread-cpu", "thread-noncpu"}
    assert c.profiles(prefix="burn_cpu", cluster=recorded["cluster"])["runs"] == 1
    sleepy = run_of(hindsight_server, recorded, "sleep-bound", 8)
    assert c.profile_diff(sleepy, run_id)["samples_b"] == c.profile(run_id)["samples"]
    hist = c.activity_history(prefix="burn_cpu", cluster=recorded["cluster"], bucket="day")
    assert set(hist.columns) == {"time", "runs", "activity", "total", "mean"}
    assert hist.set_index("activity").loc["thread-cpu", "total"] == pytest.approx(2.0, abs=0.2)
