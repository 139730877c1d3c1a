"""What the agents send besides tasks, end to end and through the read API only: values
emitted with ``hindsight.emit``, a worker's warning and the scheduler's error, the session's
facts, and a worker killed mid-run (its process exits inside a task) in the lifecycle with
its reason and the run's tasks it took down. One real LocalCluster (worker processes under
nannies) records into a real embedded server.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hindsight
from hindsight.config import load_settings
from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until


def emitting(i: int) -> int:
    # what pandas and NumPy hand a task (a df["x"].sum() is an np.int64) is a number too:
    # it was recorded as the text 'np.int64(3)'
    hindsight.emit("progress", np.int64(i) if i % 2 else i)
    hindsight.emit("note", {"i": i, "even": np.bool_(i % 2 == 0)})
    if i == 3:
        logging.getLogger("user.task").warning("task %d looks odd", i)
    return i


def inc(i: int) -> int:
    return i + 1


def odd_text(i: int) -> int:
    hindsight.emit("odd", f"value\x00{i}")
    if i == 0:
        logging.getLogger("user.task").warning("a NUL\x00in a log")
    return i


def test_a_config_value_json_has_no_number_for_is_recorded_as_text():
    """``worker-saturation: inf`` (root-task queuing off) was recorded
    as null, as if it were not set: JSON has no infinity."""
    import math
    from types import SimpleNamespace

    import dask
    import msgspec

    from hindsight.dask import SchedulerAgentPlugin

    plugin = SchedulerAgentPlugin(url="http://127.0.0.1:1", cluster="c")
    plugin.settings = load_settings(plugin.overrides)
    scheduler = SimpleNamespace(id="Scheduler-1", address="tcp://127.0.0.1:8786")
    for value, recorded in ((math.inf, "inf"), (1.1, 1.1)):
        with dask.config.set({"distributed.scheduler.worker-saturation": value}):
            event = plugin._session_event(scheduler)
        config = msgspec.json.decode(msgspec.json.encode(event))["config"]
        assert config["distributed.scheduler.worker-saturation"] == recorded


def flaky(marker: str) -> int:
    """Fails its first attempt (Dask's ``retries=`` runs it again), then succeeds."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(0.2)  # longer than the workers' clocks may differ: attempts stay in order
        raise ValueError("first attempt fails")
    return 1


def die(_: Any) -> None:
    os._exit(1)  # the worker process ends here, as a segfault or the OOM killer would end it


def die_later(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(1)


@pytest.fixture(scope="module")
def recorded(
    hindsight_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    import dask
    from distributed import Client, LocalCluster, span
    from distributed.scheduler import KilledWorker

    cluster = f"side-{uuid.uuid4().hex[:8]}"
    config = {
        "hindsight.url": hindsight_server.url,
        "hindsight.cluster": cluster,
        # the first death of a worker running a task fails the task (KilledWorker)
        "distributed.scheduler.allowed-failures": 0,
    }
    out: dict[str, Any] = {"cluster": cluster}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
        scheduler_kwargs={"preload": ["hindsight.dask"]},
    ) as lc, Client(lc) as client:  # fmt: skip
        with span("emits-and-logs"):
            keys = [f"emitting-{i}" for i in range(20)]
            assert client.gather(client.map(emitting, range(20), key=keys)) == list(range(20))
        out["workers"] = set(client.scheduler_info()["workers"])
        with span("nul-in-text"):  # Dask takes a NUL in a key, a log message, a value
            keys = [f"odd\x00key-{i}" for i in range(10)]
            assert client.gather(client.map(odd_text, range(10), key=keys)) == list(range(10))
        with span("retried"):  # Dask logs the failed attempt on the event loop, no task's
            marker = str(tmp_path_factory.mktemp("flaky") / "attempted")
            client.get_task_stream()  # Dask's task stream from here on
            assert client.submit(flaky, marker, key="flaky-0", retries=1).result() == 1
            out["retried_stream"] = client.get_task_stream()
        with span("after-retried"):
            assert client.submit(inc, 1, key="after-0").result() == 2
        # A worker's events leave with its agent's next batch: wait for both workers' before
        # one is killed (what a killed worker had not sent yet is lost with it).
        first = wait_for_run(hindsight_server, cluster, "emits-and-logs", 20)
        wait_until(lambda: _values(hindsight_server, first) == 40, 60, "40 emitted values")
        with span("worker-killed"):
            victim = sorted(client.scheduler_info()["workers"])[0]
            # kept-* prefer the victim (and may run elsewhere once it is gone); die-0 needs
            # them, so it runs there after them: their results are only on the victim
            kept = client.map(
                inc, range(6), key=[f"kept-{i}" for i in range(6)], workers=[victim],
                allow_other_workers=True,
            )  # fmt: skip
            doomed = client.submit(die, kept, key="die-0", workers=[victim])
            with pytest.raises(KilledWorker):
                doomed.result(timeout=60)
            # the victim held kept-*: the scheduler recomputes them elsewhere
            assert client.gather(kept) == list(range(1, 7))
            del kept, doomed
        out["victim"] = victim
        with span("dies-last"):  # the run's last task kills its worker, after the others
            before = client.map(inc, range(3), key=[f"before-{i}" for i in range(3)])
            assert client.gather(before) == [1, 2, 3]
            out["die_last_submitted"] = time.time()
            with pytest.raises(KilledWorker):
                client.submit(die_later, 0.3, key="die-last").result(timeout=60)
            del before
        with span("restarted"):  # last: the workers come back, nothing else runs after it
            done = client.submit(inc, 1, key="done-0")
            assert done.result() == 2
            slow = client.map(time.sleep, [5] * 4, key=[f"slow-{i}" for i in range(4)])
            wait_until(lambda: client.processing() and any(client.processing().values()),
                       30, "the slow tasks running")  # fmt: skip
            client.restart()
            del done, slow
    yield out


def _values(server: EmbeddedServer, run: dict[str, Any]) -> int:
    return sum(s["count"] for s in server.get(f"/v1/runs/{run['id']}/streams")["streams"])


def _finished(server: EmbeddedServer, run: dict[str, Any]) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        detail = server.get(f"/v1/runs/{run['id']}")
        return (
            detail
            if detail["finished_work"]["done_at"] and not detail["finished_work"]["pending"]
            else None
        )

    return wait_until(done, 60, "the run's finished-run work")


def test_emitted_values_come_back_by_stream(hindsight_server: EmbeddedServer, recorded):
    run = wait_for_run(hindsight_server, recorded["cluster"], "emits-and-logs", 20)

    listed = hindsight_server.get(f"/v1/runs/{run['id']}/streams")["streams"]
    assert [(s["stream"], s["count"], s["numeric"]) for s in listed] == [
        ("note", 20, 0),
        ("progress", 20, 20),
    ]
    _finished(hindsight_server, run)  # now read from the stored tables
    progress = hindsight_server.get(f"/v1/runs/{run['id']}/streams/progress", limit=7, buckets=4)
    values, cursor = list(progress["values"]), progress["next_cursor"]
    while cursor:
        page = hindsight_server.get(
            f"/v1/runs/{run['id']}/streams/progress", cursor=cursor, limit=7
        )
        values += page["values"]
        cursor = page["next_cursor"]
    assert progress["total"] == 20 and len(values) == 20
    assert sorted(v["value"] for v in values) == list(range(20))
    assert {v["key"]: v["value"] for v in values} == {f"emitting-{i}": i for i in range(20)}
    assert {v["worker"] for v in values} <= recorded["workers"]
    assert [v["time"] for v in values] == sorted(v["time"] for v in values)
    agg = progress["aggregate"]
    assert sum(p["count"] for p in agg["points"]) == 20
    assert sum(p["sum"] for p in agg["points"]) == sum(range(20))
    assert len(agg["points"]) <= 5
    note = hindsight_server.get(f"/v1/runs/{run['id']}/streams/note", limit=100)
    assert note["aggregate"] is None
    assert sorted(v["value"]["i"] for v in note["values"]) == list(range(20))

    # the same through hindsight.Client, as DataFrames
    client = hindsight.Client(hindsight_server.url)
    assert client.streams(run["id"]).set_index("stream")["count"].to_dict() == {
        "note": 20,
        "progress": 20,
    }
    df = client.stream(run["id"], "progress")
    assert sorted(df["value"]) == list(range(20)) and set(df["key"]) == {
        f"emitting-{i}" for i in range(20)
    }
    assert df.attrs["aggregate"]["sum"].sum() == sum(range(20))
    assert client.stream(run["id"], "note").attrs["aggregate"] is None


def test_a_workers_warning_comes_back_from_the_logs_route(hindsight_server, recorded):
    run = wait_for_run(hindsight_server, recorded["cluster"], "emits-and-logs", 20)

    def warning() -> list[dict[str, Any]]:
        return hindsight_server.get(f"/v1/runs/{run['id']}/logs", level="WARNING", q="LOOKS ODD")[
            "logs"
        ]

    (record,) = wait_until(warning, 60, "the worker's warning")
    assert record["level"] == "WARNING" and record["message"] == "task 3 looks odd"
    assert record["logger"] == "user.task" and record["key"] == "emitting-3"
    assert record["worker"] in recorded["workers"]
    # filters that exclude it
    base = f"/v1/runs/{run['id']}/logs"
    assert hindsight_server.get(base, level="ERROR", q="looks odd")["logs"] == []
    assert hindsight_server.get(base, worker="scheduler", q="looks odd")["logs"] == []
    assert hindsight_server.get(base, q="looks odd", since=record["time"] + 0.001)["logs"] == []
    assert hindsight_server.get(base, q="looks odd", until=record["time"])["logs"] == []
    assert hindsight_server.get(base, worker=record["worker"], q="odd")["logs"] == [record]
    # Python's alias: it matched nothing
    assert hindsight_server.get(base, level="warn", q="looks odd")["logs"] == [record]
    logs = hindsight.Client(hindsight_server.url).logs(run["id"], level="warning")
    (got,) = logs[logs.logger == "user.task"].to_dict("records")
    assert got.pop("time").timestamp() == pytest.approx(record["time"])  # a UTC datetime
    assert got == {k: v for k, v in record.items() if k != "time"}


def test_a_retried_tasks_failure_is_logged_with_its_key_in_its_run(hindsight_server, recorded):
    """Dask logs "Compute Failed" on the worker's event loop, after the
    task's thread let go of it, so the record had no key and was placed in a run by its
    time alone (a failure of one run was listed in the next). A failed attempt that
    ``retries=`` ran again is not in Dask's task stream: this record is where it shows."""
    run = wait_for_run(hindsight_server, recorded["cluster"], "retried", 1)
    base = f"/v1/runs/{run['id']}/logs"
    (record,) = wait_until(
        lambda: hindsight_server.get(base, q="Compute Failed")["logs"], 60, "the failure"
    )
    assert record["key"] == "flaky-0" and record["level"] == "ERROR"
    assert "first attempt fails" in record["message"]
    assert record["worker"] in recorded["workers"]
    after = wait_for_run(hindsight_server, recorded["cluster"], "after-retried", 1)
    logs = hindsight_server.get(f"/v1/runs/{after['id']}/logs", q="Compute Failed")["logs"]
    assert logs == []


def test_an_attempt_that_retries_ran_again_is_a_task_record(hindsight_server, recorded):
    """Dask passes nothing of an attempt ``retries=`` runs again to
    plugins (nor is it in Dask's task stream), so its thread's seconds read as idle and
    the critical path waited for the task meanwhile. It is an erred record with
    ``attrs.retried``; the run, whose task succeeded in the end, is finished."""
    run = wait_for_run(hindsight_server, recorded["cluster"], "retried", 2)
    tasks = hindsight_server.get(f"/v1/runs/{run['id']}/tasks", sort="start")["tasks"]
    (failed,) = [t for t in tasks if t["status"] == "erred"]
    (ok,) = [t for t in tasks if t["status"] == "memory"]
    assert (failed["key"], failed["status"], failed["attrs"]) == (
        "flaky-0",
        "erred",
        {"retried": True},
    )
    assert "first attempt fails" in failed["exception"] and "flaky" in failed["traceback"]
    assert failed["worker"] in recorded["workers"] and failed["thread"] is not None
    (phase,) = failed["startstops"]
    # before the attempt that succeeded (its end may read a few ms past that start: two
    # workers' clocks, each corrected to the scheduler's at its heartbeats)
    assert phase["action"] == "compute" and phase["stop"] - phase["start"] >= 0.2
    assert phase["start"] < ok["startstops"][0]["start"]
    # the attempt that succeeded is Dask's own task stream's record, as ever
    (dask_record,) = [r for r in recorded["retried_stream"] if r["key"] == "flaky-0"]
    assert (ok["status"], ok["worker"]) == ("memory", dask_record["worker"])
    assert ok["startstops"][0]["start"] == dask_record["startstops"][0]["start"]
    detail = hindsight_server.get(f"/v1/runs/{run['id']}")
    assert (detail["status"], detail["task_count"], detail["error_count"]) == ("finished", 2, 1)
    (group,) = hindsight_server.get(f"/v1/runs/{run['id']}/errors")["groups"]
    assert (group["count"], group["retried"], group["keys"]) == (1, 1, ["flaky-0"])
    # the critical path: the failed attempt's compute, not waiting
    cp = hindsight_server.get(f"/v1/runs/{run['id']}/critical-path")
    assert [s["kind"] for s in cp["segments"] if s["kind"] != "wait"] == ["failed", "compute"], (
        cp,
        tasks,
        hindsight_server.get(f"/v1/runs/{run['id']}/graph"),
    )
    # the run's time counts the failed attempt's seconds as compute, not idle
    time_ = hindsight_server.get(f"/v1/runs/{run['id']}/time")
    assert time_["compute"] == pytest.approx(
        sum(t["startstops"][0]["stop"] - t["startstops"][0]["start"] for t in tasks)
    )


def test_a_restart_is_in_the_logs_of_the_run_it_cut_short(hindsight_server, recorded):
    """``client.restart()`` cancelled a run's tasks and left no trace
    (Dask logs it at INFO); the run read finished, most of its tasks never run."""
    run = wait_for_run(hindsight_server, recorded["cluster"], "restarted", 1)
    base = f"/v1/runs/{run['id']}/logs"
    (record,) = wait_until(
        lambda: hindsight_server.get(base, q="client.restart()")["logs"], 60, "the restart"
    )
    assert record["worker"] == "scheduler" and record["level"] == "WARNING"
    assert record["message"].startswith("Restarting workers and releasing all keys")


def test_a_nul_in_a_key_a_log_or_a_value_loses_nothing(hindsight_server, recorded):
    """The collector refuses a batch holding U+0000, and a
    NUL in one task's key lost its whole run (in a log or a value, the batch's other
    events). The agent sends U+FFFD in its place."""
    run = wait_for_run(hindsight_server, recorded["cluster"], "nul-in-text", 10)
    keys = {t["key"] for t in hindsight_server.get(f"/v1/runs/{run['id']}/tasks")["tasks"]}
    assert keys == {f"odd\ufffdkey-{i}" for i in range(10)}

    def logged() -> list[dict[str, Any]]:
        return hindsight_server.get(f"/v1/runs/{run['id']}/logs", q="in a log")["logs"]

    (record,) = wait_until(logged, 60, "the worker's warning")
    assert record["message"] == "a NUL\ufffdin a log"
    wait_until(lambda: _values(hindsight_server, run) == 10, 60, "10 emitted values")
    values = hindsight_server.get(f"/v1/runs/{run['id']}/streams/odd", limit=100)["values"]
    assert sorted(v["value"] for v in values) == sorted(f"value\ufffd{i}" for i in range(10))
    agents = hindsight_server.get(f"/v1/runs/{run['id']}")["completeness"]["agents"]
    assert not [a for a in agents if "http_400" in a["events_dropped"]]  # no batch refused


def test_a_killed_worker_is_in_the_lifecycle_with_what_it_took_down(hindsight_server, recorded):
    run = wait_for_run(hindsight_server, recorded["cluster"], "worker-killed", 7, status="erred")
    detail = _finished(hindsight_server, run)
    info = detail["session_info"]
    assert info["versions"]["distributed"] and info["address"].startswith("tcp://")
    assert info["config"]["distributed.scheduler.allowed-failures"] == 0

    life = hindsight_server.get(f"/v1/runs/{run['id']}/lifecycle")
    workers = hindsight.Client(hindsight_server.url).lifecycle(run["id"])["workers"]
    assert workers.set_index("address").loc[recorded["victim"], "cause"] == "lost"
    assert life["session"] == info
    by_address = {w["address"]: w for w in life["workers"]}
    victim = by_address[recorded["victim"]]
    assert victim["left_during_run"] and victim["cause"] == "lost"
    assert victim["reason"] == "handle-worker-cleanup" and victim["expected"] is False
    down = victim["took_down"]
    assert down["erred"] == ["die-0"]
    recomputed = {r["key"]: r for r in down["recomputed"]}
    # lost: the kept-* results computed on the victim (work stealing may move some away)
    first: dict[str, dict[str, Any]] = {}
    records = hindsight_server.tasks(run["id"])
    for t in sorted(records, key=lambda t: max((s["stop"] for s in t["startstops"]), default=0)):
        first.setdefault(t["key"], t)
    on_victim = {
        k for k, t in first.items() if k.startswith("kept-") and t["worker"] == recorded["victim"]
    }
    assert on_victim and set(recomputed) == on_victim
    assert all(
        r["worker"] != recorded["victim"] and r["status"] == "memory" for r in recomputed.values()
    )
    assert all(not w.get("left_during_run") for w in life["workers"] if w is not victim)

    # die-0's record says what failed it, in Dask's words
    (group,) = hindsight_server.get(f"/v1/runs/{run['id']}/errors")["groups"]
    assert group["exception"].startswith("KilledWorker: Attempted to run task 'die-0' on 1 ")
    assert group["keys"] == ["die-0"] and recorded["victim"] in group["exception"]
    # the scheduler said why die-0 failed
    errors = hindsight_server.get(f"/v1/runs/{run['id']}/logs", worker="scheduler", level="ERROR")
    assert any(
        "die-0" in r["message"] and "marked as failed" in r["message"] for r in errors["logs"]
    )


def test_a_worker_killed_by_the_runs_last_task_left_during_the_run(hindsight_server, recorded):
    """The task a KilledWorker fails has no times, and Dask
    removes the worker after the span ended, so the departure fell after the run's window
    and the run page did not show it, nor what it took down."""
    run = wait_for_run(hindsight_server, recorded["cluster"], "dies-last", 4, status="erred")
    detail = _finished(hindsight_server, run)
    life = hindsight_server.get(f"/v1/runs/{run['id']}/lifecycle")["workers"]
    (gone,) = [w for w in life if w["left_during_run"]]
    assert gone["cause"] == "lost" and gone["took_down"]["erred"] == ["die-last"]
    # The run ended at the last task that succeeded, before
    # die-last was even submitted, and the scheduler's error about it fell outside the run.
    assert detail["finished_at"] >= recorded["die_last_submitted"] + 0.3
    errors = hindsight_server.get(f"/v1/runs/{run['id']}/logs", worker="scheduler", level="ERROR")
    assert any("die-last" in r["message"] and "marked as failed" in r["message"]
               for r in errors["logs"])  # fmt: skip


def in_process_task(i: int) -> int:
    hindsight.emit("rows", i)
    if i % 5 == 0:
        logging.getLogger("user.task").warning("warning from task %d", i)
    return i


def fail_on(worker: str) -> None:
    raise ValueError(f"failed on {worker}")


def test_workers_sharing_a_process_keep_their_own_values_and_logs(hindsight_server):
    """In a LocalCluster(processes=False), the usual notebook
    cluster, one process-wide context sent every value to the last worker set up (the other
    worker's were lost) and each log record was kept once per worker, under both."""
    import dask
    from distributed import Client, LocalCluster, span

    cluster = f"inproc-{uuid.uuid4().hex[:8]}"
    with dask.config.set({"hindsight.url": hindsight_server.url, "hindsight.cluster": cluster}):
        with LocalCluster(
            n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            with span("in-process"):
                keys = [f"in-process-{i}" for i in range(40)]
                futures = client.map(in_process_task, range(40), key=keys)
                assert client.gather(futures) == list(range(40))
                where = {k: next(iter(ws)) for k, ws in client.who_has(futures).items()}
                # a failure on each worker: Dask logs it on the loop the workers share
                workers = sorted(set(where.values()))
                failing = [
                    client.submit(fail_on, w, key=f"fail-on-{n}", workers=[w])
                    for n, w in enumerate(workers)
                ]  # fmt: skip
                client.gather(failing, errors="skip")
            assert len(set(where.values())) == 2  # both workers ran some
    run = wait_for_run(hindsight_server, cluster, "in-process", 42, status="erred")
    wait_until(lambda: _values(hindsight_server, run) == 40, 60, "40 emitted values")
    values = hindsight_server.get(f"/v1/runs/{run['id']}/streams/rows", limit=100)["values"]
    assert {v["key"]: v["worker"] for v in values} == where

    def logged() -> list[dict[str, Any]] | None:
        got = hindsight_server.get(f"/v1/runs/{run['id']}/logs", q="warning from task")["logs"]
        return got if len(got) >= 8 else None

    logs = wait_until(logged, 60, "the tasks' 8 warnings")
    assert sorted((r["key"], r["worker"]) for r in logs) == sorted((k, where[k]) for k in keys[::5])
    # each failure once, with its task and the worker that ran it (the process's first
    # worker kept both, and the other's without its task)
    failed = wait_until(
        lambda: hindsight_server.get(f"/v1/runs/{run['id']}/logs", q="Compute Failed")["logs"],
        60, "the failures",
    )  # fmt: skip
    assert sorted((r["key"], r["worker"]) for r in failed) == [
        (f"fail-on-{n}", w) for n, w in enumerate(workers)
    ]
