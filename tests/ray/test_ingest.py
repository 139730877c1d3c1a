"""POST /v1/ray/events with exporter bodies shaped like Ray's (``bench/lib_ray.py``): what a
real cluster will not do on demand (lost, reordered and repeated events, a late RUNNING, a
job that never finishes, concurrent collectors), on both ways to run (SQLite + files,
Postgres + S3). The sweeper is driven by hand (``run_due`` with a chosen clock)."""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import text
from werkzeug.serving import make_server

from bench.lib_ray import RaySim, bodies
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token
from storage.jobs.reindex import reindex
from storage.ray import bodies as ray_bodies
from storage.ray import hold as ray_hold
from storage.ray import sweep as ray_sweep
from tests.conftest import new_tenant
from tests.dask.conftest import wait_until
from tests.storage.jobs.test_reindex import fresh_index

T0 = 1795383780.0
SETTLE = 5.0
IDLE = 900.0


@pytest.fixture
def app(stack: dict[str, Any]) -> Any:
    from services.embedded import create_app

    return create_app(
        {
            **stack,
            "ray_sweeper": False,
            "access_log": True,
            "ray_settle_seconds": SETTLE,
            "ray_idle_close_seconds": IDLE,
        }
    )


@pytest.fixture
def token(stack: dict[str, Any]) -> str:
    engine = make_engine(stack["database_url"])
    upgrade(engine)
    with make_sessionmaker(engine).begin() as db:
        t = create_token(db, new_tenant(), "ray,read")
    engine.dispose()
    return t


class Ray:
    """A client of one app and tenant: post bodies, run the sweeper, read runs back."""

    def __init__(self, app: Any, token: str, cluster: str = "rc") -> None:
        self.app = app
        self.client = app.test_client()
        self.token = token
        self.cluster = cluster
        self.store = app.extensions["hindsight"]

    def post(self, body: bytes | Any, **params: str) -> Any:
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        query = {"cluster": self.cluster, **params}
        return self.client.post(
            "/v1/ray/events",
            query_string=query,
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
        )

    def post_all(self, chunks: list[bytes]) -> None:
        for b in chunks:
            r = self.post(b)
            assert r.status_code == 200, r.json

    def sweep(self, after: float = 0.0) -> ray_sweep.SweepCounts:
        return ray_sweep.run_due(
            self.store.sessions, self.store.blobs, settle=SETTLE, idle=IDLE, now=time.time() + after
        )

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(
            path, query_string=params, headers={"Authorization": f"Bearer {self.token}"}
        )
        assert r.status_code == 200, r.json
        return r.json

    def runs(self) -> list[dict[str, Any]]:
        return self.get("/v1/runs", cluster=self.cluster)["runs"]

    def run(self, job: int) -> dict[str, Any]:
        (run,) = [r for r in self.runs() if r["run_key"] == ray_job(job)]
        return run

    def tasks(self, run_id: str) -> list[dict[str, Any]]:
        return self.get(f"/v1/runs/{run_id}/tasks", limit=10_000)["tasks"]

    def view(self) -> dict[str, Any]:
        """What a user sees of the cluster, minus when the index saw it."""
        out: dict[str, Any] = {
            "runs": {},
            "history": self.get("/v1/history/clusters", cluster=self.cluster, bucket="day"),
        }
        for r in self.runs():
            d = self.get(f"/v1/runs/{r['id']}")
            tasks = sorted(
                (
                    t["key"],
                    t["attrs"]["attempt"],
                    t["status"],
                    t["prefix"],
                    t["group"],
                    t["worker"],
                    json.dumps(t["startstops"]),
                    t["exception"],
                    json.dumps(t["attrs"], sort_keys=True),
                )
                for t in self.tasks(r["id"])
            )
            out["runs"][r["run_key"]] = {
                "summary": {
                    k: r[k]
                    for k in (
                        "name",
                        "status",
                        "started_at",
                        "finished_at",
                        "makespan",
                        "task_count",
                        "error_count",
                    )
                },
                "detail": {
                    k: d[k] for k in ("tasks_by_status", "workers", "prefixes", "seconds_by_action")
                },
                "tasks": tasks,
                "quantiles": self.get(f"/v1/runs/{r['id']}/summary")["prefixes"],
            }
        return out


def ray_job(job: int) -> str:
    return job.to_bytes(4, "little").hex()


def task_hex(event: dict[str, Any]) -> str | None:
    """The task id (hex) a task lifecycle event is about."""
    payload = event.get("taskLifecycleEvent")
    return base64.b64decode(payload["taskId"]).hex() if payload else None


def is_running(event: dict[str, Any]) -> bool:
    """The executing worker's event (RUNNING, with its pid)."""
    return bool(event.get("taskLifecycleEvent", {}).get("workerPid"))


def workload(seed: int = 1, n: int = 60) -> tuple[RaySim, list[Any], list[dict[str, Any]]]:
    """A session: node and workers, job 1 with ``n`` tasks (every 7th fails), and an actor
    task and a retried task in job 2."""
    sim = RaySim(seed=seed)
    events = sim.node_events(T0 - 5) + sim.worker_events(T0 - 4)
    tasks, job1 = sim.job(1, n, T0, fail_every=7)
    events += job1
    events += sim.job_start(2, T0 + 10)
    actor = b"\x42" * 12 + (2).to_bytes(4, "little")
    incr = sim.task(2, "Counter.incr", T0 + 10.5, 0.02, func="Counter.incr", actor=actor)
    first = sim.task(2, "flaky", T0 + 10.6, 0.01, failed=True)
    retry = sim.task(2, "flaky", T0 + 10.7, 0.01, attempt=1, task_id=first.task_id)
    for t in (incr, first, retry):
        events += sim.task_events(t)
        tasks.append(t)
    events += sim.job_end(2, T0 + 11)
    return sim, tasks, events


# ------------------------------------------------------------------ the basics


def test_a_job_becomes_a_run_with_its_tasks(app, token):
    r = Ray(app, token)
    sim, tasks, events = workload()
    r.post_all(bodies(events))
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["status"] == "finished" and run["name"] == "python job.py"
    assert run["task_count"] == 60 and run["error_count"] == 60 // 7
    recorded = {t["key"]: t for t in r.tasks(run["id"])}
    for t in tasks[:60]:
        rec = recorded[t.hex]
        assert rec["startstops"] == [
            {
                "action": "compute",
                "start": pytest.approx(t.start, abs=1e-6),
                "stop": pytest.approx(t.stop, abs=1e-6),
            }
        ]
        assert rec["status"] == ("erred" if t.failed else "memory")
        assert rec["worker"] == f"{sim.ip}:{sim.pids[sim.worker_of(t)]}"
        assert rec["prefix"] == "work" and rec["group"] == t.name
    job2 = {(t["key"], t["attrs"]["attempt"]): t for t in r.tasks(r.run(2)["id"])}
    assert len(job2) == 3
    incr = next(t for t in job2.values() if t["prefix"] == "Counter.incr")
    assert (
        incr["attrs"]["type"] == "ACTOR_TASK"
        and incr["attrs"]["actor"] == (b"\x42" * 12 + b"\x02\0\0\0").hex()
    )
    flaky = sorted((k[1], t["status"]) for k, t in job2.items() if t["prefix"] == "flaky")
    assert flaky == [(0, "erred"), (1, "memory")]
    detail = r.get(f"/v1/runs/{run['id']}")
    assert detail["completeness"]["closed_by"] == "finished"
    assert detail["workers_used"] == sim.workers


def test_a_retried_body_is_stored_and_counted_once(app, token):
    r = Ray(app, token)
    _, _, events = workload()
    chunks = bodies(events, 30)
    r.post_all(chunks)
    again = r.post(chunks[3])
    assert again.status_code == 200 and again.json["duplicate"] is True
    # The same events in bodies cut differently: new bodies, no new facts.
    shuffled = events[:]
    random.Random(5).shuffle(shuffled)
    r.post_all(bodies(shuffled, 77))
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["task_count"] == 60 and run["error_count"] == 60 // 7
    assert len(r.tasks(run["id"])) == 60
    detail = r.get(f"/v1/runs/{run['id']}")
    assert detail["completeness"]["batches_received"] == len(chunks) + len(bodies(shuffled, 77))
    assert sum(p["count"] for p in detail["prefixes"]) == 60
    assert sum(w["tasks"] for w in detail["workers"]) == 60
    keys = list(r.store.blobs.list(f"{ray_bodies.RAW_PREFIX}/"))
    assert len(keys) == len(chunks) + len(bodies(shuffled, 77))


def test_an_unknown_event_type_is_stored_and_the_rest_indexed(app, token):
    r = Ray(app, token)
    sim, tasks, events = workload()
    odd = [
        {**events[0], "eventType": "QUANTUM_EVENT", "quantumEvent": {"spin": 0.5}},
        {**events[0], "eventType": "TASK_LIFECYCLE_EVENT", "taskLifecycleEvent": {"taskId": 7}},
        # (a time the reader reads; the event's own ``timestamp`` it does not read)
        {
            **events[0],
            "eventType": "NODE_DEFINITION_EVENT",
            "nodeDefinitionEvent": {"nodeId": "AQ==", "startTimestamp": 12},
        },
        42,
    ]
    body = json.dumps(odd + events[:200]).encode()
    resp = r.post(body)
    assert resp.status_code == 200, resp.json
    assert resp.json["skipped"] == {"QUANTUM_EVENT": 1, "malformed": 3}
    (key,) = [k for k in r.store.blobs.list(f"{ray_bodies.RAW_PREFIX}/")]
    assert (
        ray_bodies.read_stored(r.store.blobs.get(key)) == body
    )  # stored as sent, odd events and all
    r.post_all(bodies(events[200:]))
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["task_count"] == 60
    c = r.get(f"/v1/runs/{run['id']}")["completeness"]
    assert c["events_skipped"] == {"QUANTUM_EVENT": 1, "malformed": 3}


def test_values_the_index_cannot_hold_are_skipped_not_refused(app, token):
    """An attempt past 2**31 or an id longer than any Ray id is unreadable: counted and
    skipped, the body stored, the rest indexed. Passed to the index, it would fail it: 503
    on every retry of the body (Ray retries forever), and ``reindex`` would stop at it."""
    r = Ray(app, token)
    sim, tasks, events = workload()
    defn = next(e for e in events if e["eventType"] == "TASK_DEFINITION_EVENT")
    odd = [
        {**defn, "taskDefinitionEvent": {**defn["taskDefinitionEvent"], "taskAttempt": 2**31}},
        {**defn, "taskDefinitionEvent": {**defn["taskDefinitionEvent"], "taskAttempt": -1}},
        {
            **defn,
            "taskDefinitionEvent": {
                **defn["taskDefinitionEvent"],
                "taskId": base64.b64encode(b"\x01" * 40).decode(),
            },
        },
    ]
    resp = r.post(odd + events[:100])
    assert resp.status_code == 200, resp.json
    assert resp.json["skipped"] == {"malformed": 2, "TASK_DEFINITION_EVENT": 1}
    r.post_all(bodies(events[100:]))
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["task_count"] == 60
    assert {t["attrs"]["attempt"] for t in r.tasks(run["id"])} == {0}


def test_what_ray_reports_of_odd_tasks_and_worker_exits(app, token):
    """What a real Ray cluster sends: a task cancelled before it ran keeps its end; an
    actor's creation task has ``attrs.actor``; a restarted actor's creation task (a RUNNING
    alone for attempt 1) is named after its function; a Ray worker's exit reads as its
    cause (lost, retired), not "an older agent did not say how"."""
    r = Ray(app, token)
    sim = RaySim(seed=3)
    events = sim.node_events(T0 - 5) + sim.worker_events(T0 - 4, ended=T0 + 5)
    deaths = [
        e
        for e in events
        if e["eventType"] == "WORKER_LIFECYCLE_EVENT"
        and e["workerLifecycleEvent"]["stateTransitions"][0]["state"] == "DEAD"
    ]
    for e, exit_type in zip(deaths, ("SYSTEM_ERROR", "INTENDED_SYSTEM_EXIT"), strict=False):
        e["workerLifecycleEvent"]["stateTransitions"][0]["deathInfo"]["exitType"] = exit_type
    # a user error's detail comes coloured for a terminal (it reached the page raw)
    deaths[0]["workerLifecycleEvent"]["stateTransitions"][0]["deathInfo"]["exitDetail"] = (
        "\x1b[36mBadInit.__init__()\x1b[39m failed"
    )
    events += sim.job_start(1, T0)
    cancelled = sim.task(1, "slow", T0 + 0.5, 0.3, failed=True)
    ended = sim.submitter(cancelled)
    ended["taskLifecycleEvent"]["stateTransitions"] = [
        s
        for s in ended["taskLifecycleEvent"]["stateTransitions"]
        if s["state"] not in ("SUBMITTED_TO_WORKER",)
    ]
    # no worker ever had it (Ray 2.60 sends such a task's end with no worker, as seen live)
    ended["taskLifecycleEvent"].update(workerId="", nodeId="", workerPid=0)
    events += [sim.definition(cancelled), ended]
    actor = b"\x42" * 12 + (1).to_bytes(4, "little")
    create = sim.task(
        1, "Fragile.__init__", T0 + 0.2, 0.01, func="Fragile.__init__", task_id=b"\xff" * 8 + actor
    )
    define = sim.definition(create)
    define["taskDefinitionEvent"]["taskType"] = "ACTOR_CREATION_TASK"
    define["taskDefinitionEvent"]["taskFunc"]["pythonFunctionDescriptor"].update(
        className="Fragile", functionName="__init__"
    )  # as Ray sends a creation task's
    events += [define, sim.running(create), sim.submitter(create)]
    restarted = sim.task(1, "Fragile.__init__", T0 + 1.0, 0.01, attempt=1, task_id=create.task_id)
    events += [sim.running(restarted)] + sim.job_end(1, T0 + 2)
    r.post_all(bodies(events))
    r.sweep(after=SETTLE + 1)
    r.sweep(after=IDLE + 1)
    run = r.run(1)
    tasks = {(t["key"], t["attrs"]["attempt"]): t for t in r.tasks(run["id"])}
    c = tasks[(cancelled.hex, 0)]
    assert c["status"] == "erred" and c["startstops"] == []
    assert c["attrs"]["ended_at"] == pytest.approx(cancelled.stop, abs=1e-6)
    # it never reached a worker: no RUNNING is missing (counted as one, a run where one
    # task in ten lacked anything would read 70% recorded)
    complete = r.get(f"/v1/runs/{run['id']}")["completeness"]["tasks"]
    assert complete["without_running"] == 0
    assert complete["complete"] == complete["total"] - 1  # the restarted creation: no end
    first, again = tasks[(create.hex, 0)], tasks[(create.hex, 1)]
    assert (
        first["attrs"]["actor"] == actor.hex() and first["attrs"]["type"] == "ACTOR_CREATION_TASK"
    )
    assert again["prefix"] == "Fragile.__init__" and again["attrs"]["defined"] is False
    assert again["status"] == "lost" and "ended_at" not in again["attrs"]
    workers = r.get(f"/v1/runs/{run['id']}/lifecycle")["workers"]
    causes = sorted((w["reason"].split(":")[0], w["cause"]) for w in workers)
    assert causes == [("INTENDED_SYSTEM_EXIT", "retired"), ("SYSTEM_ERROR", "lost")]
    (lost,) = [w for w in workers if w["cause"] == "lost"]
    assert lost["reason"] == "SYSTEM_ERROR: BadInit.__init__() failed"


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b'{"eventType": "TASK_DEFINITION_EVENT"}', 400, "not_an_array"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "not_an_array"),  # past msgspec's nesting limit
        (b"[{", 400, "not_an_array"),
        (b"\xff\xfe", 400, "not_an_array"),
        (b"[]", 200, None),
        (b"[1, null, []]", 200, None),
    ],
)
def test_only_a_body_that_is_not_an_array_is_refused(app, token, body, status, code):
    resp = Ray(app, token).post(body)
    assert resp.status_code == status, resp.json
    if code:
        assert resp.json["error"]["code"] == code


def test_what_the_answers_say_of_an_empty_or_too_deep_body(app, token):
    """An array nested past what the reader takes is refused saying so (it is an array);
    the first empty array ever sent is not answered as a duplicate."""
    r = Ray(app, token)
    deep = r.post(b'[{"a":' * 600 + b"1" + b"}]" * 600)
    assert deep.status_code == 400 and "nested too deeply" in deep.json["error"]["message"]
    empty = r.post(b"[]")
    assert empty.status_code == 200 and empty.json["duplicate"] is False


def test_bad_cluster_name_type_and_size(stack, token):
    from services.embedded import create_app

    app = create_app({**stack, "ray_sweeper": False, "max_batch_bytes": 4096})
    r = Ray(app, token, cluster="../etc")
    assert r.post(b"[]").status_code == 400
    r.cluster = "ok"
    assert r.post(b"[" + b" " * 5000 + b"]").status_code == 413
    resp = r.client.post(
        "/v1/ray/events",
        data=b"[]",
        headers={"Content-Type": "text/csv", "Authorization": f"Bearer {token}"},
    )
    assert resp.status_code == 415


def test_rate_limited_bodies_get_429(stack, token):
    from services.embedded import create_app

    app = create_app(
        # Ten events of burst, refilled at one event a minute: the second body must wait.
        {**stack, "ray_sweeper": False, "rate_limit_events": 1 / 60, "rate_limit_burst": 10}
    )
    r = Ray(app, token)
    _, _, events = workload()
    assert r.post(json.dumps(events[:10]).encode()).status_code == 200
    resp = r.post(json.dumps(events[10:30]).encode())
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
    assert not list(r.store.blobs.list(f"{ray_bodies.RAW_PREFIX}/"))[1:], (
        "a refused body was stored"
    )


# ------------------------------------------------------------------ order, loss, lateness


def test_order_and_repetition_do_not_change_the_result(stack, app):
    """The same events in order, and shuffled with repeats, late RUNNING events and the
    job's FINISHED first, give the same runs, tasks, rollups and history."""
    engine = make_engine(stack["database_url"])
    with make_sessionmaker(engine).begin() as db:
        in_order, mixed = (
            create_token(db, new_tenant(), "ray,read"),
            create_token(db, new_tenant(), "ray,read"),
        )
    engine.dispose()
    _, _, events = workload(seed=3)
    a = Ray(app, in_order)
    a.post_all(bodies(events))
    rng = random.Random(11)
    late = [e for e in events if is_running(e)]
    ends = [e for e in events if e["eventType"] == "DRIVER_JOB_LIFECYCLE_EVENT"]
    rest = [e for e in events if e not in late and e not in ends]
    rest += rng.sample(rest, len(rest) // 5)  # repeats
    rng.shuffle(rest)
    b = Ray(app, mixed)
    b.post_all(bodies(ends + rest, 53))
    b.post_all(bodies(late, 41))
    for client in (a, b):
        client.sweep(after=SETTLE + 1)
    assert a.view() == b.view()
    assert a.view()["runs"][ray_job(1)]["summary"]["task_count"] == 60


def test_a_task_whose_running_never_arrives_is_written_after_settling(app, token):
    r = Ray(app, token)
    sim, tasks, events = workload()
    lost = {t.hex for t in tasks[:60:10]}  # six tasks lose their RUNNING event
    keep = [e for e in events if not (is_running(e) and task_hex(e) in lost)]
    r.post_all(bodies(keep))
    run = r.run(1)
    assert run["task_count"] == 54  # the others wait for their RUNNING
    r.sweep(after=SETTLE / 2)
    assert r.run(1)["task_count"] == 54
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["task_count"] == 60
    waited = {t["key"]: t for t in r.tasks(run["id"]) if t["key"] in lost}
    assert len(waited) == 6
    for t in tasks[:60:10]:
        rec = waited[t.hex]
        assert rec["attrs"]["start_from"] == "SUBMITTED_TO_WORKER"
        assert rec["startstops"][0]["start"] == pytest.approx(t.start - 0.0005, abs=1e-6)
    c = r.get(f"/v1/runs/{run['id']}")["completeness"]
    assert c["tasks"]["without_running"] == 6 and c["ratio"] == pytest.approx(54 / 60)


def test_a_session_that_cannot_be_written_does_not_hold_up_the_others(stack, app, token):
    """The sweeper's work for one session fails (here: its blob prefix is taken by a file, so
    nothing can be stored under it): the other session's tasks and jobs are still written
    in the same pass, and the failed one is written once its store takes writes again."""
    if not stack["blob_url"].startswith("file:"):
        pytest.skip("the failure is made on the file store (a file where a directory goes)")
    r = Ray(app, token)
    sessions = {}
    for seed in (1, 2):
        sim, tasks, events = workload(seed=seed)
        lost = {t.hex for t in tasks[:60:10]}  # six tasks left for the sweeper to settle
        r.post_all(bodies([e for e in events if not (is_running(e) and task_hex(e) in lost)]))
        sessions[seed] = sim.session

    def state(seed: int) -> list[tuple[str, int]]:
        return sorted(
            (x["status"], x["task_count"]) for x in r.runs() if x["session"] == sessions[seed]
        )

    assert state(1) == state(2) == [("running", 3), ("running", 54)]
    derived = Path(stack["blob_url"][len("file://") :]) / ray_bodies.DERIVED_PREFIX
    (broken,) = derived.glob(f"*/{r.cluster}/{sessions[1]}")
    aside = broken.with_name(broken.name + ".aside")
    broken.rename(aside)
    broken.write_bytes(b"")  # a file where the session's directory goes
    got = r.sweep(after=SETTLE + 1)
    assert got.failed >= 1
    assert state(2) == [("finished", 3), ("finished", 60)]  # written in the same pass
    assert state(1) == [("running", 3), ("running", 54)]  # left as it was, nothing half-done
    broken.unlink()
    aside.rename(broken)

    def written() -> bool:
        r.sweep(after=SETTLE + 1)  # the failed session is tried again after a pause
        return state(1) == [("finished", 3), ("finished", 60)]

    wait_until(written, 30, "the failed session to be written once it can be")


def test_tasks_unfinished_when_their_driver_exits_fail_with_the_job_as_ray_says(app, token):
    """A driver that exits with tasks pending or running ends its job, and Ray's State
    API lists those tasks FAILED (WORKER_DIED); Ray sends no event for it, so without this
    rule the run would read ``lost`` tasks and no error. A pending one ends at the job's
    end; a running one when its worker died, which Ray force-exits a few ms later (not at
    the job's end, 9-22 ms early). An attempt whose definition never came (a restarted
    actor's creation task, which the State API does not list) stays lost."""
    r = Ray(app, token)
    sim = RaySim(seed=11)
    events = sim.node_events(T0 - 5) + sim.worker_events(T0 - 4) + sim.job_start(1, T0)
    done = [sim.task(1, f"work-{i}", T0 + 0.1 * i, 0.05) for i in range(2)]
    running = [sim.task(1, f"slow-{i}", T0 + 1 + i, 10) for i in range(2)]
    pending = [sim.task(1, f"slow-{i + 2}", T0 + 3, 10) for i in range(2)]
    restarted = sim.task(1, "Actor.__init__", T0 + 2, 1, attempt=1)
    for t in done:
        events += sim.task_events(t)
    events += [e for t in running for e in (sim.definition(t), sim.running(t))]
    events += [sim.definition(t) for t in pending] + [sim.running(restarted)]
    end = T0 + 4
    events += sim.job_end(1, end)
    died = end + 0.0157  # Ray force-exits the job's workers
    events += sim.worker_events(T0 - 4, ended=died)
    r.post_all(bodies(events))
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert (run["status"], run["task_count"], run["error_count"]) == ("finished", 7, 4)
    tasks = {t["group"] or t["key"]: t for t in r.tasks(run["id"])}
    job_end = end + 0.003  # Ray's FINISHED of the job (the driver's own end is 3 ms before)
    for t in running + pending:
        got = tasks[t.name]
        assert (got["status"], got["attrs"]["state"], got["attrs"]["error_type"]) == (
            "erred",
            "FAILED",
            "WORKER_DIED",
        )
    for t in pending:
        assert tasks[t.name]["exception"].startswith("Job finishes (01000000) as driver exits.")
    for t in running:  # ran from RUNNING until its worker died (Ray sends that end in ms)
        (phase,) = tasks[t.name]["startstops"]
        assert (phase["start"], phase["stop"]) == (
            pytest.approx(t.start, abs=1e-6),
            pytest.approx(int(died * 1000) / 1000, abs=1e-6),
        )
        assert tasks[t.name]["exception"].startswith("Worker running the task (")
        assert tasks[t.name]["exception"].endswith(
            "died with exit_type: 3 with error_message: Worker force exited because its job"
            " has finished"
        )
    for t in pending:  # never ran: no phase, the end Ray reports
        assert tasks[t.name]["startstops"] == []
        assert tasks[t.name]["attrs"]["ended_at"] == pytest.approx(job_end, abs=1e-6)
    assert tasks[restarted.hex]["status"] == "lost"
    assert {tasks[t.name]["status"] for t in done} == {"memory"}
    groups = r.get(f"/v1/runs/{run['id']}/errors")["groups"]
    assert sorted(g["count"] for g in groups) == [2, 2]  # the workers' deaths (ids apart), the job
    # Nothing of those is missing: Ray sends no end for them, and a pending one never ran
    # (they read as 4 tasks without their end, the pending ones also without RUNNING).
    c = r.get(f"/v1/runs/{run['id']}")["completeness"]["tasks"]
    assert (c["complete"], c["without_definition"], c["without_running"], c["without_end"]) == (
        6,
        1,
        0,
        1,
    )


def test_a_task_running_when_its_job_ends_ends_as_ray_says_live_and_rebuilt(
    stack, app, token, tmp_path
):
    """A call still running on a detached actor (whose worker outlives the job) when the
    job's driver exited. Ray's GCS ends such a task when its worker dies if that is within
    14 s of the job's end (it fails a finished job's tasks 15 s on, a dead worker's 1 s
    on), else at the job's end. The live index and a rebuild from the same bodies both end
    it so: not at the job's end 9 s before Ray, nor at a worker's death 27 s on where Ray
    uses the job's end."""
    r = Ray(app, token)
    sim = RaySim(seed=12)
    end = T0 + 4
    candidates = [sim.task(1, f"call-{i}", T0 + 1, 60) for i in range(8)]
    soon, late = (next(t for t in candidates if sim.worker_of(t) == w) for w in (0, 1))

    def death(t: Any, at: float) -> list[dict[str, Any]]:
        wid = base64.b64encode(sim.worker_ids[sim.worker_of(t)]).decode()
        return [
            e
            for e in sim.worker_events(T0 - 4, ended=at)
            if e.get("workerLifecycleEvent", {}).get("workerId") == wid
            and e["workerLifecycleEvent"]["stateTransitions"][0]["state"] == "DEAD"
        ]

    events = sim.node_events(T0 - 5) + sim.worker_events(T0 - 4) + sim.job_start(1, T0)
    events += [e for t in (soon, late) for e in (sim.definition(t), sim.running(t))]
    events += sim.job_end(1, end)
    r.post_all(bodies(events))
    r.sweep(after=SETTLE + 1)
    assert r.run(1)["status"] == "running"  # waits for the workers' deaths
    r.post_all(bodies(death(soon, end + 9)))
    r.sweep(after=SETTLE + 1)
    assert r.run(1)["status"] == "running"  # the other one's has not come
    r.sweep(after=ray_sweep.WORKER_DEATH_WINDOW_S + SETTLE + 1)
    r.post_all(bodies(death(late, end + 27)))  # after its job closed
    r.sweep(after=ray_sweep.WORKER_DEATH_WINDOW_S + SETTLE + 1)
    run = r.run(1)
    assert run["status"] == "finished" and run["task_count"] == 2
    tasks = {t["group"]: t for t in r.tasks(run["id"])}
    (phase,) = tasks[soon.name]["startstops"]
    assert phase["stop"] == pytest.approx(int((end + 9) * 1000) / 1000, abs=1e-6)
    assert tasks[soon.name]["exception"].startswith("Worker running the task (")
    (phase,) = tasks[late.name]["startstops"]
    assert phase["stop"] == pytest.approx(end + 0.003, abs=1e-6)  # the job's FINISHED
    assert tasks[late.name]["exception"].startswith("Job finishes (01000000) as driver exits.")
    before = r.view()
    rebuilt, _ = rebuild(stack, r, token, tmp_path)
    assert rebuilt.view() == before


def test_a_job_that_never_finishes_closes_when_idle(app, token):
    r = Ray(app, token)
    sim = RaySim(seed=9)
    tasks, events = sim.job(1, 20, T0, finish=False)
    # The last task's end never arrives.
    cut = [e for e in events if not (task_hex(e) == tasks[-1].hex and not is_running(e))]
    r.post_all(bodies(sim.node_events(T0 - 1) + sim.worker_events(T0 - 1) + cut))
    r.sweep(after=SETTLE + 1)
    assert r.run(1)["status"] == "running"
    r.sweep(after=IDLE + 1)
    run = r.run(1)
    assert run["status"] == "finished" and run["task_count"] == 20
    assert run["finished_at"] == pytest.approx(tasks[-2].stop, abs=1e-6)
    detail = r.get(f"/v1/runs/{run['id']}")
    assert detail["completeness"]["closed_by"] == "idle"
    assert detail["completeness"]["job_finished_event"] is False
    assert detail["tasks_by_status"] == {"memory": 19, "lost": 1}
    # Ray's FINISHED comes after all (a notebook's driver idled, then ran more and ended):
    # the run ends then, not at the idle close's end, 37 s before the job's.
    r.post_all(bodies(sim.job_end(1, T0 + 60)))
    r.sweep(after=SETTLE + 1)
    detail = r.get(f"/v1/runs/{run['id']}")
    assert detail["finished_at"] == pytest.approx(T0 + 60.003, abs=1e-6)  # the job's FINISHED
    assert detail["completeness"]["closed_by"] == "finished"
    assert detail["completeness"]["job_finished_event"] is True
    # The task written lost at the idle close stays lost, and without its end.
    assert detail["tasks_by_status"] == {"memory": 19, "lost": 1}
    assert detail["completeness"]["tasks"]["without_end"] == 1


def test_events_after_the_job_closed_are_still_written_once(app, token):
    r = Ray(app, token)
    sim = RaySim(seed=4)
    tasks, events = sim.job(1, 10, T0)
    r.post_all(bodies(sim.node_events(T0 - 1) + events))
    r.sweep(after=SETTLE + 1)
    assert r.run(1)["task_count"] == 10
    late = sim.task(1, "late", T0 + 1, 0.01)
    r.post_all(bodies(sim.task_events(late)))  # complete on arrival
    straggler = sim.task(1, "straggler", T0 + 2, 0.01)
    r.post_all(bodies([sim.definition(straggler), sim.submitter(straggler)]))  # no RUNNING
    assert r.run(1)["task_count"] == 11
    r.sweep(after=SETTLE + 1)
    assert r.run(1)["task_count"] == 12
    r.post_all(bodies(sim.task_events(late) + [sim.running(straggler)]))  # repeats: no change
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["task_count"] == 12 and len(r.tasks(run["id"])) == 12


def narrowed_index(
    stack: dict[str, Any], tmp_path: Any, table: str, column: str, n: int
) -> tuple[str, Any, str]:
    """A fresh Postgres index whose ``table.column`` holds at most ``n`` characters (a value
    the reader's bounds let through that the index still refuses), its engine and a
    ray,read token; skips on SQLite, which does not hold strings to a column's length."""
    if make_engine(stack["database_url"]).dialect.name != "postgresql":
        pytest.skip("SQLite does not hold strings to a column's length")
    url = fresh_index(stack, tmp_path)
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar({n})"))
    with make_sessionmaker(engine).begin() as db:
        token = create_token(db, new_tenant(), "ray,read")
    return url, engine, token


def test_a_value_postgres_refuses_is_stored_and_skipped_not_refused(stack, tmp_path):
    """The net under the reader's bounds: a value the index still cannot hold (here Postgres
    refuses a job's entrypoint, its column narrowed by hand) is stored, answered 200 with
    what was skipped (Ray retries a refused body forever), and the next body indexes."""
    from services.embedded import create_app

    url, engine, t = narrowed_index(stack, tmp_path, "ray_jobs", "entrypoint", 20)
    r = Ray(create_app({**stack, "database_url": url, "ray_sweeper": False}), t)
    odd = RaySim(seed=8)
    started = odd.job_start(1, T0, "python " + "x" * 40)
    body = json.dumps(started).encode()
    resp = r.post(body)
    assert resp.status_code == 200, resp.json
    assert resp.json["skipped"] == {"unindexable": len(started)}
    assert resp.json["duplicate"] is False
    (key,) = r.store.blobs.list(f"{ray_bodies.RAW_PREFIX}/")
    assert ray_bodies.read_stored(r.store.blobs.get(key)) == body  # stored as sent
    _, _, events = workload()
    r.post_all(bodies(events))
    r.sweep(after=SETTLE + 1)
    assert r.run(1)["task_count"] == 60
    # A rebuild into an index with the same limit skips that body and indexes the rest.
    again = fresh_index(stack, tmp_path)
    upgrade(again)
    narrowed = make_engine(again)
    with narrowed.begin() as conn:
        conn.execute(text("ALTER TABLE ray_jobs ALTER COLUMN entrypoint TYPE varchar(20)"))
    counts = reindex(r.store.blobs, make_sessionmaker(narrowed))
    assert counts["ray_skipped"] == 1 and counts["ray_merged"] == len(bodies(events))
    narrowed.dispose()
    engine.dispose()


def rebuild(stack: dict[str, Any], r: Ray, token: str, tmp_path: Any) -> tuple[Ray, dict[str, int]]:
    """A fresh index rebuilt from ``r``'s blob store (every body is in: no settle time),
    and a client of it for the same tenant; with the rebuild's counts."""
    from services.embedded import create_app

    rebuilt_url = fresh_index(stack, tmp_path)
    upgrade(rebuilt_url)
    engine = make_engine(rebuilt_url)
    counts = reindex(r.store.blobs, make_sessionmaker(engine), ray_settle=0)
    # Tokens are not in the blob store: one for the same tenant in the rebuilt index.
    principal = r.store.principal_for(token)
    assert principal is not None
    with make_sessionmaker(engine).begin() as db:
        again = create_token(db, principal.tenant, "ray,read")
    engine.dispose()
    app = create_app({**stack, "database_url": rebuilt_url, "ray_sweeper": False})
    return Ray(app, again), counts


def test_reindex_rebuilds_the_same_runs(stack, app, token, tmp_path):
    r = Ray(app, token)
    _, _, events = workload(seed=6)
    rng = random.Random(2)
    mixed = events + rng.sample(events, 40)
    rng.shuffle(mixed)
    r.post_all(bodies(mixed, 90))
    r.sweep(after=SETTLE + 1)
    before = r.view()
    rebuilt, counts = rebuild(stack, r, token, tmp_path)
    assert counts["ray_merged"] == len(bodies(mixed, 90)) and counts["ray_skipped"] == 0
    after = rebuilt.view()
    for job in before["runs"]:
        for part in before["runs"][job]:
            assert after["runs"][job][part] == before["runs"][job][part], (job, part)
    assert after == before


def test_reindex_on_a_live_index_leaves_a_job_that_just_ended_to_settle(app, token):
    """Reindex settles as the collector's sweeper does: sweeping with no settle time, on a
    live index it would close a job whose end had just arrived and write its tasks still
    under way (one with only its definition: lost; one without its RUNNING: timed from its
    submission), for good."""
    r = Ray(app, token)
    sim = RaySim(seed=3)
    t0 = time.time() - 2
    early = sim.node_events(t0 - 5) + sim.worker_events(t0 - 4) + sim.job_start(1, t0)
    a = sim.task(1, "work-a", t0 + 0.1, 0.5, func="work")  # complete in the first bodies
    b = sim.task(1, "work-b", t0 + 0.2, 0.5, func="work")  # only its definition so far
    c = sim.task(1, "work-c", t0 + 0.3, 0.5, func="work")  # its RUNNING comes late
    early += sim.task_events(a) + [sim.definition(b), sim.definition(c), sim.submitter(c)]
    early += sim.job_end(1, t0 + 1.0)
    r.post_all(bodies(early))
    r.sweep()
    reindex(r.store.blobs, r.store.sessions, ray_settle=SETTLE, ray_idle=IDLE)
    r.post_all(bodies([sim.running(b), sim.submitter(b), sim.running(c)]))  # another node's
    r.sweep(after=SETTLE + 1)
    run = r.run(1)
    assert run["status"] == "finished" and run["task_count"] == 3
    for t in r.tasks(run["id"]):
        (phase,) = t["startstops"]
        assert t["status"] == "memory", t
        assert phase["stop"] - phase["start"] == pytest.approx(0.5, abs=1e-6), t


def test_tasks_wait_for_their_nodes_address(app, token):
    """A task is written with its worker's ``ip:pid``, even when the node's definition
    arrives after the task's events (it waits for it, up to the settle time)."""
    r = Ray(app, token)
    sim = RaySim(seed=8)
    tasks, events = sim.job(1, 12, T0)
    r.post_all(bodies(events))
    assert r.run(1)["task_count"] == 0
    r.post_all(bodies(sim.node_events(T0 - 1)))
    run = r.run(1)
    assert run["task_count"] == 12
    assert {t["worker"] for t in r.tasks(run["id"])} == {f"{sim.ip}:{p}" for p in sim.pids}


@pytest.mark.postgres
def test_a_collector_with_a_sweeper_writes_the_same_as_with_each_body(stack, app):
    """With a sweeper (as under gunicorn), a body's completed tasks are left to it and
    written many bodies to a batch; users see exactly what writing them with each body
    gives: the same runs, tasks, rollups and history."""
    from services.embedded import create_app

    engine = make_engine(stack["database_url"])
    tenants = new_tenant(), new_tenant()
    with make_sessionmaker(engine).begin() as db:
        inline_token, swept_token = (create_token(db, t, "ray,read") for t in tenants)
    engine.dispose()
    _, _, events = workload(seed=4)
    inline = Ray(app, inline_token)
    inline.post_all(bodies(events, 30))
    inline.sweep(after=SETTLE + 1)

    swept_app = create_app(
        {
            **stack,
            "ray_sweeper": True,
            "access_log": False,
            "ray_settle_seconds": 0.5,
            "ray_idle_close_seconds": IDLE,
        }
    )
    try:
        swept = Ray(swept_app, swept_token)
        answers = [swept.post(b) for b in bodies(events, 30)]
        assert [a.status_code for a in answers] == [200] * len(answers)
        assert sum(a.json["tasks_written"] for a in answers) == 0  # all left to the sweeper

        def closed() -> bool:
            runs = swept.runs()
            return len(runs) == 2 and all(r["status"] != "running" for r in runs)

        wait_until(closed, 60, "the sweeper to write the tasks and close both jobs")
        assert swept.view() == inline.view()
        assert swept.view()["runs"][ray_job(1)]["summary"]["task_count"] == 60
    finally:
        swept_app.extensions["hindsight.ray_sweeper"].stop()


def test_concurrent_collectors_write_each_task_once(pg_url, s3_url, moto_endpoint):
    """Bodies of one job posted at once by eight clients to a threaded collector on
    Postgres (each request its own transaction), with repeats: every attempt once, and
    the rollups add up to the task count."""
    from services.embedded import create_app

    stack = {
        "database_url": pg_url,
        "blob_url": s3_url,
        "s3_endpoint_url": moto_endpoint,
        "auth": "required",
        "ray_sweeper": False,
        "access_log": False,
    }
    engine = make_engine(pg_url)
    tenant = new_tenant()
    with make_sessionmaker(engine).begin() as db:
        tok, reader = create_token(db, tenant, "ray"), create_token(db, tenant, "read")
    engine.dispose()
    app = create_app(stack)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sim = RaySim(seed=12, workers=4)
        _, events = sim.job(1, 600, T0, fail_every=9)
        events = sim.node_events(T0 - 1) + sim.worker_events(T0 - 1) + events
        rng = random.Random(3)
        mixed = events + rng.sample(events, 300)
        rng.shuffle(mixed)
        chunks = bodies(mixed, 40)
        chunks += chunks[::7]  # retried bodies
        rng.shuffle(chunks)
        url = f"http://127.0.0.1:{server.port}/v1/ray/events?cluster=rc&token={tok}"
        errors: list[Any] = []

        def send(mine: list[bytes]) -> None:
            with requests.Session() as http:
                for b in mine:
                    resp = http.post(
                        url, data=b, headers={"Content-Type": "application/json"}, timeout=60
                    )
                    if resp.status_code != 200:
                        errors.append((resp.status_code, resp.text))

        senders = [threading.Thread(target=send, args=(chunks[i::8],)) for i in range(8)]
        for s in senders:
            s.start()
        for s in senders:
            s.join(120)
        assert errors == []
        r = Ray(app, reader)
        r.sweep(after=SETTLE + 1)
        run = r.run(1)
        assert run["task_count"] == 600 and run["error_count"] == 600 // 9
        tasks = r.tasks(run["id"])
        assert len({t["key"] for t in tasks}) == len(tasks) == 600
        detail = r.get(f"/v1/runs/{run['id']}")
        assert sum(w["tasks"] for w in detail["workers"]) == 600
        assert sum(p["count"] for p in detail["prefixes"]) == 600
        (q,) = r.get(f"/v1/runs/{run['id']}/summary")["prefixes"]
        assert q["actions"]["compute"]["count"] == 600
        (hour,) = r.get("/v1/history/clusters", cluster="rc", bucket="day")["points"]
        assert hour["tasks"] == 600
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_retention_removes_a_ray_session_and_reindex_does_not_bring_it_back(app, token):
    from sqlalchemy import update

    from storage.core import models as m
    from storage.jobs.retention import apply

    r = Ray(app, token)
    _, _, events = workload(seed=13)
    r.post_all(bodies(events))
    r.sweep(after=SETTLE + 1)
    assert len(r.runs()) == 2
    tenant = r.store.principal_for(token).tenant
    with r.store.sessions.begin() as db:
        db.execute(update(m.Session).values(last_seen=time.time() - 40 * 86400))
    done = apply(r.store.blobs, r.store.sessions, tenant, max_age=30 * 86400)
    assert len(done.sessions) == 1 and done.blobs_deleted > 0
    assert not list(r.store.blobs.list(f"{ray_bodies.RAW_PREFIX}/{tenant}/"))
    assert not list(r.store.blobs.list(f"{ray_bodies.DERIVED_PREFIX}/{tenant}/"))
    assert r.runs() == []
    reindex(r.store.blobs, r.store.sessions)
    assert r.runs() == []


def test_a_body_of_many_sessions_is_split_and_bounded(app, token):
    """Ray sends one session a body; events of several are stored per session, and past
    sixteen sessions the rest are stored and counted, not indexed."""
    r = Ray(app, token)
    events = []
    for seed in range(20):
        sim = RaySim(seed=100 + seed)
        events += sim.node_events(T0) + sim.job(1, 1, T0)[1]
    resp = r.post(json.dumps(events).encode())
    assert resp.status_code == 200
    assert len(resp.json["sessions"]) == 16
    assert resp.json["skipped"] == {"too_many_sessions": len(events) * 4 // 20}
    stored = [
        ray_bodies.read_stored(r.store.blobs.get(k))
        for k in r.store.blobs.list(f"{ray_bodies.RAW_PREFIX}/")
    ]
    assert sum(len(json.loads(b)) for b in stored) == len(events)  # every event kept


@pytest.mark.postgres
def test_task_patches_a_killed_collector_held_are_merged_from_the_stored_bodies(
    pg_url, s3_url, moto_endpoint, tmp_path
):
    """A collector holds acknowledged bodies' task patches a moment before merging them
    (storage.ray.hold.TaskHold). Killed (SIGKILL) while it holds them, nothing acknowledged is
    lost: another collector's sweeper merges those bodies again from their stored blobs,
    and users see what a collector that merged each body at once shows."""
    from services.embedded import create_app
    from tests.test_cli import Served, env

    stack = {
        "database_url": pg_url,
        "blob_url": s3_url,
        "s3_endpoint_url": moto_endpoint,
        "auth": "required",
        "access_log": False,
        "finish_worker": False,
        "ray_settle_seconds": SETTLE,
        "ray_idle_close_seconds": IDLE,
    }
    engine = make_engine(pg_url)
    tenants = new_tenant(), new_tenant()
    with make_sessionmaker(engine).begin() as db:
        inline_token, held_token = (create_token(db, t, "ray,read") for t in tenants)
    _, _, events = workload(seed=6)
    chunks = bodies(events, 30)
    inline = Ray(create_app({**stack, "ray_sweeper": False}), inline_token)
    inline.post_all(chunks)
    inline.sweep(after=SETTLE + 1)

    # A collector with a sweeper that holds patches for a minute (its settle time allows
    # it), so the kill surely comes while it holds them.
    server = Served(
        tmp_path,
        environ=env(
            HINDSIGHT_DATABASE_URL=pg_url,
            HINDSIGHT_BLOB_URL=s3_url,
            HINDSIGHT_S3_ENDPOINT_URL=moto_endpoint,
            HINDSIGHT_AUTH="required",
            HINDSIGHT_FINISH_WORKER="false",
            HINDSIGHT_RAY_SETTLE_SECONDS="600",
            HINDSIGHT_RAY_HOLD_SECONDS="60",
        ),
    )
    try:
        for chunk in chunks:
            r = requests.post(
                f"{server.url}/v1/ray/events",
                params={"cluster": "rc"},
                data=chunk,
                headers={
                    "Authorization": f"Bearer {held_token}",
                    "Content-Type": "application/json",
                },
                timeout=30,
            )
            assert r.status_code == 200, r.text
    finally:
        server.proc.kill()
        server.proc.communicate(timeout=30)
    with engine.connect() as conn:
        tenant_sessions = text(
            "SELECT s.id FROM sessions s JOIN clusters c ON c.id = s.cluster_id"
            " JOIN tenants t ON t.id = c.tenant_id WHERE t.name = :t"
        )
        sids = [r[0] for r in conn.execute(tenant_sessions, {"t": tenants[1]})]
        held = conn.execute(
            text("SELECT count(*) FROM ray_bodies WHERE NOT tasks_merged AND session_id = ANY(:s)"),
            {"s": sids},
        ).scalar()
        merged = conn.execute(
            text("SELECT count(*) FROM ray_tasks WHERE session_id = ANY(:s)"), {"s": sids}
        ).scalar()
    assert held > 0 and merged < 63, "the kill came after the patches were merged"

    after = create_app({**stack, "ray_sweeper": False})
    st = after.extensions["hindsight"]
    now = time.time()
    assert ray_hold.recover_held(st.sessions, st.blobs, now=now).batches == 0  # not yet: held
    got = ray_hold.recover_held(st.sessions, st.blobs, now=now + ray_hold.RECOVER_AFTER + 1)
    assert got.batches == held and got.failed == 0
    survivor = Ray(after, held_token)
    survivor.sweep(after=SETTLE + 1)
    assert survivor.view() == inline.view()
    assert survivor.view()["runs"][ray_job(1)]["summary"]["task_count"] == 60
    engine.dispose()


@pytest.mark.postgres
def test_a_held_task_postgres_refuses_is_left_out_and_the_others_merge(stack, tmp_path):
    """The same net for held task patches (merged by the sweeper, many bodies at once): a
    task whose value the index cannot hold (its name's column narrowed by hand) is left
    out, logged; the other tasks of the flush are merged and written, and the bodies are
    not merged again."""
    from services.embedded import create_app

    url, engine, t = narrowed_index(stack, tmp_path, "ray_tasks", "name", 12)
    app = create_app(
        {
            **stack,
            "database_url": url,
            "ray_sweeper": True,
            "access_log": False,
            "ray_settle_seconds": 0.5,
            "ray_idle_close_seconds": IDLE,
        }
    )
    try:
        r = Ray(app, t)
        sim, tasks, events = workload(seed=9)
        odd = sim.task(1, "a-name-longer-than-twelve", T0 + 1, 0.01, func="work")
        r.post_all(bodies(events[:-2] + sim.task_events(odd) + events[-2:], 30))
        wait_until(
            lambda: any(x["run_key"] == ray_job(1) and x["status"] != "running" for x in r.runs()),
            60,
            "job 1 to be written and closed",
        )
        assert r.run(1)["task_count"] == 60
        with engine.connect() as conn:
            assert (
                conn.execute(
                    text("SELECT count(*) FROM ray_bodies WHERE NOT tasks_merged")
                ).scalar()
                == 0
            )
    finally:
        app.extensions["hindsight.ray_sweeper"].stop()
        engine.dispose()
