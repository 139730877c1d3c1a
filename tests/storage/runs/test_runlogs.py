"""A run's log records, emitted values and worker lifecycle on both stacks, through the API:
which records are the run's, filters and paging, a departure's tasks joined with the run's
task records; the same answers from a rebuilt index; nothing left after retention."""

from __future__ import annotations

import time
from typing import Any

from storage.core.blobs import open_blob_store
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.tokens import create_token
from storage.jobs.reindex import reindex
from storage.jobs.retention import apply
from tests.conftest import new_tenant
from tests.helpers import auth, example, post
from tests.query.test_runs import T0
from tests.storage.jobs.test_reindex import fresh_index

W1, W2 = "tcp://10.0.0.1:4001", "tcp://10.0.0.2:4001"


def task(key: str, worker: str, start: float, status: str = "memory") -> dict[str, Any]:
    ss = [{"action": "compute", "start": start, "stop": start + 0.5}] if status == "memory" else []
    return {"kind": "task", "key": key, "prefix": "inc", "status": status, "run": "r",
            "worker": worker, "startstops": ss}  # fmt: skip


def batches() -> list[dict[str, Any]]:
    """A run (T0 to T0+5) on two workers; w1 is killed at T0+2.2 running inc-9 (which
    erred: KilledWorker) and holding inc-1 (recomputed on w2); a worker's log records and
    emitted values, some of them another run's or outside the run's window."""
    scheduler = [
        {"kind": "worker", "event": "joined", "address": W1, "time": T0 - 5, "name": "0", "nthreads": 1},
        {"kind": "worker", "event": "joined", "address": W2, "time": T0 - 5, "name": "1", "nthreads": 1},
        {"kind": "run", "event": "started", "id": "r", "name": "job", "time": T0},
        *(task(f"inc-{i}", W1, T0 + i * 0.5) for i in range(4)),
        task("inc-9", W1, T0 + 2.2, status="erred"),
        {"kind": "worker", "event": "left", "address": W1, "time": T0 + 2.2, "name": "0",
         "reason": "handle-worker-cleanup", "expected": False, "status": "running",
         "processing": ["inc-9"], "erred": ["inc-9"], "lost": ["inc-1", "inc-2", "other-run-key"],
         "counts": {"processing": 1, "erred": 1, "lost": 3}},
        task("inc-1", W2, T0 + 3),
        {"kind": "log", "time": T0 + 2.2, "level": "ERROR", "worker": "scheduler",
         "logger": "distributed.scheduler", "message": "Task inc-9 marked as failed because 1 workers died"},
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 5},
    ]  # fmt: skip
    worker = [
        {"kind": "log", "time": T0 + 1, "level": "WARNING", "worker": W1, "logger": "user",
         "message": "inc-0 looks odd", "key": "inc-0", "run": "r"},
        {"kind": "log", "time": T0 + 1.5, "level": "INFO", "worker": W1, "logger": "distributed.worker",
         "message": "a worker's own record"},
        {"kind": "log", "time": T0 + 1.6, "level": "WARNING", "worker": W1, "logger": "user",
         "message": "another run's task", "key": "x-0", "run": "other"},
        {"kind": "log", "time": T0 + 100, "level": "ERROR", "worker": W1, "logger": "user",
         "message": "long after the run"},
        *({"kind": "custom", "stream": "loss/train", "time": T0 + i, "value": float(4 - i),
           "worker": W1, "run": "r", "key": f"inc-{i}"} for i in range(4)),
        {"kind": "custom", "stream": "note", "time": T0 + 1, "value": {"a": [1, 2]}, "run": "r"},
        {"kind": "custom", "stream": "note", "time": T0 + 1, "value": "other", "run": "other"},
    ]  # fmt: skip
    return [
        example(cluster="c", session="s", agent="scheduler-1", seq=0, events=scheduler),
        example(cluster="c", session="s", agent="worker-0-abc", seq=0, events=worker),
    ]


def answers(query: Any, token: str) -> dict[str, Any]:
    h = auth(token)
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    base = f"/v1/runs/{run['id']}"
    out = {}
    for path in ("/logs", "/logs?level=warning", "/logs?q=LOOKS&worker=" + W1, "/streams",
                 "/streams/loss/train?buckets=2", "/streams/note", "/lifecycle"):  # fmt: skip
        resp = query.get(base + path, headers=h)
        assert resp.status_code == 200, (path, resp.json)
        out[path] = resp.json
    return out


def test_logs_streams_and_lifecycle_survive_reindex_and_leave_with_retention(stack, tmp_path):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    tenant = new_tenant()
    engine = make_engine(stack["database_url"])
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as db:
        token = create_token(db, tenant, "ingest,read")
    collector = collector_app(stack).test_client()
    for body in batches():
        assert post(collector, body, token=token).status_code == 202
    query = query_app(stack).test_client()
    got = answers(query, token)

    h = auth(token)
    run_id = query.get("/v1/runs", headers=h).json["runs"][0]["id"]
    logs = got["/logs"]
    assert [r["message"] for r in logs["logs"]] == [
        "inc-0 looks odd", "a worker's own record", "Task inc-9 marked as failed because 1 workers died",
    ]  # fmt: skip
    assert logs["total"] == 3 and logs["levels"] == {"WARNING": 1, "INFO": 1, "ERROR": 1}
    assert logs["logs"][0]["key"] == "inc-0" and logs["logs"][2]["worker"] == "scheduler"
    assert [r["level"] for r in got["/logs?level=warning"]["logs"]] == ["WARNING", "ERROR"]
    assert [r["key"] for r in got["/logs?q=LOOKS&worker=" + W1]["logs"]] == ["inc-0"]

    assert got["/streams"]["streams"] == [
        {"stream": "loss/train", "count": 4, "numeric": 4, "first": T0, "last": T0 + 3, "workers": 1},
        {"stream": "note", "count": 1, "numeric": 0, "first": T0 + 1, "last": T0 + 1, "workers": 0},
    ]  # fmt: skip
    loss = got["/streams/loss/train?buckets=2"]
    assert [v["value"] for v in loss["values"]] == [4.0, 3.0, 2.0, 1.0]
    assert [(p["count"], p["sum"], p["min"], p["max"]) for p in loss["aggregate"]["points"]] == [
        (2, 7.0, 3.0, 4.0),
        (2, 3.0, 1.0, 2.0),
    ]
    quoted = query.get(f"/v1/runs/{run_id}/streams/loss%2Ftrain?buckets=2", headers=h)
    assert quoted.json == loss  # as hindsight.Client sends a name with a slash
    assert got["/streams/note"]["values"][0]["value"] == {"a": [1, 2]}
    assert got["/streams/note"]["aggregate"] is None

    life = got["/lifecycle"]["workers"]
    assert [w["address"] for w in life] == [W1, W2]
    w1 = life[0]
    assert (w1["cause"], w1["left_during_run"], w1["last_status"]) == ("lost", True, "running")
    assert w1["cause_text"] == "connection lost while it was running: killed or crashed"
    assert w1["took_down"]["erred"] == ["inc-9"] and w1["took_down"]["rescheduled"] == []
    assert w1["took_down"]["recomputed"] == [
        {"key": "inc-1", "worker": W2, "status": "memory", "stop": T0 + 3.5}
    ]
    # inc-2's result went with w1 and was never computed again (its future was released):
    # lost, not "recomputed" as the page said
    assert w1["took_down"]["lost"] == ["inc-2"]
    assert "left_at" in life[1] and life[1]["left_at"] is None and "took_down" not in life[1]

    # paging: two records a page, every record once, in order
    page = query.get(f"/v1/runs/{run_id}/logs?limit=2", headers=h).json
    rest = query.get(f"/v1/runs/{run_id}/logs?limit=2&cursor={page['next_cursor']}", headers=h).json
    assert page["logs"] + rest["logs"] == logs["logs"] and rest["next_cursor"] is None
    bad = query.get(f"/v1/runs/{run_id}/logs?cursor={page['next_cursor']}x", headers=h)
    assert bad.status_code == 400 and bad.json["error"]["code"] == "invalid_parameter"
    other = query.get(f"/v1/runs/{run_id}/streams/note?cursor={page['next_cursor']}", headers=h)
    assert other.status_code == 400  # a logs cursor is not a stream's

    # a rebuilt index answers the same (the tables are rebuilt from the batches)
    rebuilt = {**stack, "database_url": fresh_index(stack, tmp_path)}
    engine2 = make_engine(rebuilt["database_url"])
    upgrade(engine2)
    sessions2 = make_sessionmaker(engine2)
    blobs = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    reindex(blobs, sessions2, prefix=f"v1/{tenant}/")
    with sessions2.begin() as db:
        token2 = create_token(db, tenant, "read")
    engine2.dispose()
    assert answers(query_app(rebuilt).test_client(), token2) == got

    # retention removes them with the session's batches
    assert list(blobs.list(f"compact/v1/{tenant}/"))
    apply(blobs, sessions, tenant, max_age=3600, now=time.time() + 86400)
    assert list(blobs.list(f"compact/v1/{tenant}/")) == []
    assert list(blobs.list(f"v1/{tenant}/")) == []
    engine.dispose()


def test_a_worker_lost_while_paused_for_memory_is_said_likely_killed_at_its_limit(
    stack, make_token
):
    """A worker its nanny killed past 95% of its memory limit read
    "killed or crashed" alone, its memory line short of the limit (the last sample came
    before the spike); the scheduler knew it had paused it for memory."""
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    token = make_token()
    events = batches()[0]["events"]
    for ev in events:
        if ev.get("event") == "left":
            ev["status"] = "paused"
    body = example(cluster="c", session="s", agent="scheduler-1", seq=0, events=events)
    assert post(collector_app(stack).test_client(), body, token=token).status_code == 202
    query = query_app(stack).test_client()
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    w1 = query.get(f"/v1/runs/{run['id']}/lifecycle", headers=auth(token)).json["workers"][0]
    assert (w1["cause"], w1["last_status"]) == ("lost", "paused")
    assert w1["cause_text"] == (
        "connection lost while Dask had it paused for memory: likely killed at its memory"
        " limit (or crashed)"
    )
    page = query.get(f"/runs/{run['id']}", headers=auth(token)).data.decode()
    assert "likely killed at its memory limit" in page


def test_level_filters_take_any_case_on_both_sides():
    """Records written "warning" or "Error" (structlog, zap)
    were missed by ``level=warning`` and ``level=error``, and ``level=notice`` missed
    "NOTICE", though the docs say any case."""
    import pyarrow as pa

    from storage.runs.runlogs import LogFilters, filter_logs

    levels = ["warning", "Error", "WARNING", "INFO", "warn", "notice", "NOTICE", "fatal", "debug"]
    logs = pa.table({"level": levels, "message": [str(i) for i in range(len(levels))]})

    def matching(level: str) -> list[str]:
        return filter_logs(logs, LogFilters(level=level))["level"].to_pylist()

    assert matching("warning") == ["warning", "Error", "WARNING", "warn", "fatal"]
    assert matching("ERROR") == ["Error", "fatal"]
    assert matching("Warn") == matching("warning")
    assert matching("notice") == matching("NOTICE") == ["notice", "NOTICE"]
    assert len(matching("debug")) == len(levels) - 2  # all but the custom level
