"""The smallest read path: clusters, runs (filters, cursor), one run, its tasks."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.helpers import auth, example, post

T0 = 1_795_000_000.0


def run_batch(cluster: str, session: str, run: str, seq: int, *, n_tasks: int = 3, t: float = T0,
              status: str | None = "finished", agent: str = "scheduler-1") -> dict[str, Any]:  # fmt: skip
    events: list[dict[str, Any]] = []
    if seq == 0:
        events.append(
            {"kind": "run", "event": "started", "id": run, "name": f"job-{run}", "time": t}
        )
    for i in range(n_tasks):
        events.append({"kind": "task", "key": f"inc-{run}-{seq}-{i}", "prefix": "inc", "status": "memory",
                       "run": run, "worker": "tcp://w:1", "thread": 7, "nbytes": 28,
                       "startstops": [{"action": "compute", "start": t + i, "stop": t + i + 0.5}]})  # fmt: skip
    if status:
        events.append({"kind": "run", "event": status, "id": run, "time": t + n_tasks})
    return example(cluster=cluster, session=session, agent=agent, seq=seq, events=events)


@pytest.fixture
def history(clients, make_token):
    """Six runs over two clusters and three sessions, one per batch, started an hour apart."""
    collector, query = clients
    token = make_token()
    specs = [("prod", "s1", "finished"), ("prod", "s1", "erred"), ("prod", "s2", "finished"),
             ("dev", "s3", None), ("dev", "s3", "finished"), ("prod", "s2", "finished")]  # fmt: skip
    seqs: dict[str, int] = {}
    for i, (cluster, session, status) in enumerate(specs):
        seq = seqs.get(session, 0)
        seqs[session] = seq + 1
        body = run_batch(cluster, session, f"r{i}", 0, t=T0 + 3600 * i, status=status)
        body["seq"] = seq
        assert post(collector, body, token=token).status_code == 202
    return query, token


def names(resp: Any) -> list[str]:
    assert resp.status_code == 200, resp.json
    return [r["name"] for r in resp.json["runs"]]


def test_runs_newest_first_with_filters(history):
    query, token = history
    h = auth(token)
    assert names(query.get("/v1/runs", headers=h)) == [f"job-r{i}" for i in (5, 4, 3, 2, 1, 0)]
    assert names(query.get("/v1/runs?cluster=dev", headers=h)) == ["job-r4", "job-r3"]
    assert names(query.get("/v1/runs?status=erred", headers=h)) == ["job-r1"]
    assert names(query.get("/v1/runs?status=running", headers=h)) == ["job-r3"]
    assert names(query.get(f"/v1/runs?since={T0 + 3600 * 2}&until={T0 + 3600 * 4}", headers=h)) == [
        "job-r3",
        "job-r2",
    ]
    iso = datetime.fromtimestamp(T0 + 3600 * 4, UTC).isoformat()
    assert names(query.get(f"/v1/runs?since={iso}", headers=h)) == ["job-r5", "job-r4"]
    assert names(query.get("/v1/runs?cluster=nope", headers=h)) == []


def test_a_date_alone_as_until_includes_that_day(history):
    """``until=2026-11-21`` (what the runs page's field suggests) meant midnight at its
    start, leaving out every run of the day named; it now means the day's end. A time with
    it still means that moment."""
    query, token = history
    h = auth(token)
    days = [datetime.fromtimestamp(T0 + 3600 * i, UTC).date() for i in range(6)]
    for day in sorted(set(days)):
        expected = [f"job-r{i}" for i in (5, 4, 3, 2, 1, 0) if days[i] <= day]
        assert names(query.get(f"/v1/runs?until={day.isoformat()}", headers=h)) == expected
        assert names(query.get(f"/v1/runs?until={day.isocalendar()[0]}-W{day.isocalendar()[1]:02}-{day.isocalendar()[2]}",
                               headers=h)) == expected  # fmt: skip
        # 20261126 was read as epoch seconds (1970): all runs
        assert names(query.get(f"/v1/runs?until={day:%Y%m%d}", headers=h)) == expected
        midnight = f"{day.isoformat()}T00:00:00"
        before = [f"job-r{i}" for i in (5, 4, 3, 2, 1, 0) if days[i] < day]
        assert names(query.get(f"/v1/runs?until={midnight}", headers=h)) == before
    first = days[0].isoformat()
    assert names(query.get(f"/v1/runs?since={first}&until={first}", headers=h)) == [
        f"job-r{i}" for i in (5, 4, 3, 2, 1, 0) if days[i] == days[0]
    ]


def test_cursor_pagination_visits_every_run_once(history):
    query, token = history
    seen, cursor = [], None
    while True:
        url = "/v1/runs?limit=4" + (f"&cursor={cursor}" if cursor else "")
        body = query.get(url, headers=auth(token)).json
        assert len(body["runs"]) <= 4
        seen += [r["name"] for r in body["runs"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"job-r{i}" for i in (5, 4, 3, 2, 1, 0)]


@pytest.mark.parametrize(
    "query_string",
    ["limit=0", "limit=abc", "limit=100000", "status=done", "since=yesterday", "cursor=!!!",
     "cursor=WzFd", "cluster=../x", "cluster=" + "a" * 300,
     # ["-started_at", 1.0, 2**63]: an id no database integer holds (a 500 on SQLite)
     "cursor=WyItc3RhcnRlZF9hdCIsMS4wLDkyMjMzNzIwMzY4NTQ3NzU4MDhd",
     # what Python's int() and float() take but no client means
     "limit=1_0", "limit=%20" + "5", "limit=\u0661\u0662", "min_duration=1_0", "since=\uff11"],
)  # fmt: skip
def test_bad_parameters_are_400(history, query_string):
    query, token = history
    resp = query.get(f"/v1/runs?{query_string}", headers=auth(token))
    assert resp.status_code == 400
    assert resp.json["error"]["code"] == "invalid_parameter"


@pytest.mark.parametrize(
    "query_string,message",
    [("clusters=dev", "clusters: not a parameter of this route (it takes cluster, status"),
     ("min_duration=-1", "min_duration: must be at least 0"),
     ("_=123&cluster=dev", None)],
)  # fmt: skip
def test_a_misspelled_filter_is_400_not_ignored(history, query_string, message):
    """``?clusters=dev`` answered every run, as if filtered; and
    ``min_duration=-1`` said "must be between 0.0 and None"."""
    query, token = history
    resp = query.get(f"/v1/runs?{query_string}", headers=auth(token))
    if message is None:  # a cache buster passes
        assert names(resp) == ["job-r4", "job-r3"]
        return
    assert resp.status_code == 400 and resp.json["error"]["message"].startswith(message)


def test_every_route_refuses_a_parameter_it_does_not_take(history):
    """``/v1/history/prefixes?clusters=prod``
    answered every cluster, ``regressions?treshold=500`` kept the default threshold and
    ``compare?acton=transfer`` compared compute. Every GET route answers 400 naming what it
    takes; the parameters it documents pass."""
    query, token = history
    h = auth(token)
    run = query.get("/v1/runs?limit=2", headers=h).json["runs"]
    a, b = run[0]["id"], run[1]["id"]
    values = {"run_id": a, "cluster": "prod", "table": "tasks", "stream": "x", "day": "2026-11-01",
              "name": "x.parquet"}  # fmt: skip
    doc = query.get("/v1/openapi.json").json
    checked = 0
    for path, ops in doc["paths"].items():
        if "get" not in ops or not path.startswith("/v1/") or path == "/v1/openapi.json":
            continue
        url = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
        resp = query.get(f"{url}?clusters=prod", headers=h)
        assert resp.status_code == 400, (path, resp.status_code)
        assert resp.json["error"]["code"] == "invalid_parameter", path
        assert "clusters" in resp.json["error"]["message"], path
        assert query.head(f"{url}?clusters=prod", headers=h).status_code == 400, path
        checked += 1
    assert checked >= 30
    # the lake's file listing too: ?limit=1 answers one file
    resp = query.get("/v1/lake/tasks/files?limit=1", headers=h)
    assert resp.status_code == 400 and "limit" in resp.json["error"]["message"]
    msg = query.get("/v1/clusters?x=1", headers=h).json["error"]["message"]
    assert msg == "x: not a parameter of this route (it takes none)"
    for url in (f"/v1/runs/{a}/regressions?threshold=500", f"/v1/compare?a={a}&b={b}&action=transfer",
                "/v1/history/prefixes?prefix=inc&cluster=prod"):  # fmt: skip
        assert query.get(url, headers=h).status_code == 200, url


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "1e308", "-1", "0001-01-01"])
@pytest.mark.parametrize(
    "route",
    ["/v1/runs", "/v1/history/clusters", "/v1/history/prefixes?prefix=inc", "/v1/lake/tasks"],
)
def test_times_outside_what_a_batch_may_carry_are_400(history, route, value):
    """``since=nan`` or ``until=1e308`` was a 500 where the
    routes did date maths (history by hour, the lake's day partitions)."""
    query, token = history
    for param in ("since", "until"):
        sep = "&" if "?" in route else "?"
        resp = query.get(f"{route}{sep}{param}={value}", headers=auth(token))
        assert resp.status_code == 400, (param, resp.json)
        assert resp.json["error"]["code"] == "invalid_parameter"
        assert resp.json["error"]["message"].startswith(f"{param}: must be a time between")


def test_a_label_as_long_as_the_protocol_allows_filters(clients, make_token):
    """A prefix of up to 1,024 characters is recorded; it must also be a usable filter
    (every parameter was cut at 256 characters before its own limit applied)."""
    collector, query = clients
    token = make_token()
    long = "p" * 1000
    body = run_batch("prod", "s1", "r-long", 0)
    for ev in body["events"]:
        if ev["kind"] == "task":
            ev["prefix"] = long
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs?name=job-r-long", headers=auth(token)).json["runs"]
    resp = query.get(f"/v1/runs/{run['id']}/tasks?prefix={long}", headers=auth(token))
    assert resp.status_code == 200, resp.json
    assert len(resp.json["tasks"]) == 3 and {t["prefix"] for t in resp.json["tasks"]} == {long}
    too_long = query.get(f"/v1/runs/{run['id']}/tasks?prefix={long}{'p' * 25}", headers=auth(token))
    assert too_long.status_code == 400 and "longer than 1024" in too_long.json["error"]["message"]


def test_clusters(history):
    query, token = history
    clusters = query.get("/v1/clusters", headers=auth(token)).json["clusters"]
    assert [(c["name"], c["runs"], c["sessions"]) for c in clusters] == [
        ("dev", 2, 1),
        ("prod", 4, 2),
    ]


def test_run_tasks_paginate_across_batches(clients, make_token):
    collector, query = clients
    token = make_token()
    for seq in range(3):
        body = run_batch("c", "s", "big", seq, n_tasks=10, status=None, t=T0 + seq * 100)
        assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    assert run["task_count"] == 30 and run["status"] == "running"
    keys, cursor = [], None
    while True:
        body = query.get(f"/v1/runs/{run['id']}/tasks?limit=7" + (f"&cursor={cursor}" if cursor else ""),
                         headers=auth(token)).json  # fmt: skip
        keys += [t["key"] for t in body["tasks"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert keys == [f"inc-big-{s}-{i}" for s in range(3) for i in range(10)]
    whole = query.get(f"/v1/runs/{run['id']}/tasks?limit=30", headers=auth(token)).json
    assert len(whole["tasks"]) == 30 and whole["next_cursor"] is None


def test_tenants_see_only_their_own_runs(clients, make_token):
    collector, query = clients
    alice, bob = make_token(), make_token()
    assert post(collector, example(), token=alice).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(alice)).json["runs"]
    assert query.get("/v1/runs", headers=auth(bob)).json["runs"] == []
    assert query.get("/v1/clusters", headers=auth(bob)).json["clusters"] == []
    for path in (f"/v1/runs/{run['id']}", f"/v1/runs/{run['id']}/tasks"):
        resp = query.get(path, headers=auth(bob))
        assert resp.status_code == 404 and resp.json["error"]["code"] == "not_found"
    # The same batch identity from another tenant is that tenant's own, not a duplicate.
    resp = post(collector, example(), token=bob)
    assert resp.status_code == 202 and resp.json["duplicate"] is False


def test_read_routes_need_a_token(clients):
    _, query = clients
    for path in ("/v1/clusters", "/v1/runs", "/v1/runs/x", "/v1/runs/x/tasks"):
        resp = query.get(path)
        assert resp.status_code == 401 and resp.json["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("factory", ["collector.app", "services.query.app", "services.embedded"])
def test_openapi_documents_every_route(stack, factory):
    import importlib

    from services.common.web import openapi_path

    app = importlib.import_module(factory).create_app(stack)
    doc = app.test_client().get("/v1/openapi.json").json
    assert doc["openapi"].startswith("3.")
    routes = {
        (openapi_path(rule.rule), method.lower())
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static" and not rule.endpoint.startswith("dashboard.")  # HTML pages
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert routes == documented


def test_runs_outside_any_span_are_fingerprinted_by_their_prefixes(clients, make_token):
    """Dask files work outside any span under the span ``default``: such runs are told
    apart by their prefixes, or they would share one fingerprint (``name:default``), and
    regressions and "the previous run of this job" would mix unrelated work."""
    collector, query = clients
    token = make_token()
    for i, prefix in enumerate(("inc", "sum", "inc")):
        body = run_batch("prod", "s1", f"span-{i}", 0, t=T0 + 100 * i)
        body["seq"] = i
        for ev in body["events"]:
            if ev["kind"] == "task":
                ev["prefix"] = prefix
            if ev["kind"] == "run" and ev["event"] == "started":
                ev["name"] = "default"
        assert post(collector, body, token=token).status_code == 202
    runs = sorted(
        query.get("/v1/runs", headers=auth(token)).json["runs"], key=lambda r: r["started_at"]
    )
    fps = [query.get(f"/v1/runs/{r['id']}", headers=auth(token)).json["fingerprint"] for r in runs]
    assert [r["name"] for r in runs] == ["default"] * 3
    assert fps[0] == fps[2] != fps[1]
    regressions = query.get(f"/v1/runs/{runs[2]['id']}/regressions", headers=auth(token)).json
    assert regressions["baseline_runs"] == [runs[0]["id"]], regressions


def test_a_run_still_running_is_no_baseline(clients, make_token):
    """A finished run's regressions took an earlier run of
    the same job that was still running (part of its tasks) as a baseline."""
    collector, query = clients
    token = make_token()
    for i, status in enumerate(("finished", None, "finished")):  # the middle one still runs
        body = run_batch("prod", "s1", f"nightly-{i}", 0, t=T0 + 3600 * i, status=status)
        body["seq"] = i
        body["events"][0]["name"] = "nightly"
        assert post(collector, body, token=token).status_code == 202
    runs = query.get("/v1/runs?name=nightly", headers=auth(token)).json["runs"]
    latest, running, first = runs
    assert running["status"] == "running" and first["status"] == "finished"
    reg = query.get(f"/v1/runs/{latest['id']}/regressions", headers=auth(token)).json
    assert reg["baseline_runs"] == [first["id"]]


def test_regressions_can_take_their_baselines_from_the_runs_cluster_only(clients, make_token):
    """A prod run's baselines included a dev cluster's run of the same
    job (a job is its span name, on any cluster), with no way to keep to prod."""
    collector, query = clients
    token = make_token()
    for i, cluster in enumerate(("prod", "dev", "prod")):
        body = run_batch(cluster, f"s{i}", f"nightly-{i}", 0, t=T0 + 3600 * i)
        body["events"][0]["name"] = "nightly"
        assert post(collector, body, token=token).status_code == 202
    latest, dev, first = query.get("/v1/runs?name=nightly", headers=auth(token)).json["runs"]
    url = f"/v1/runs/{latest['id']}/regressions"
    assert query.get(url, headers=auth(token)).json["baseline_runs"] == [dev["id"], first["id"]]
    reg = query.get(f"{url}?same_cluster=true", headers=auth(token)).json
    assert reg["baseline_runs"] == [first["id"]]


def test_a_name_prefix_matches_case_as_exact_names_do(clients, make_token):
    """Name=ETL* matched "etl-nightly" on SQLite, not on
    Postgres (an exact name is case-sensitive on both)."""
    collector, query = clients
    token = make_token()
    for i, name in enumerate(("ETL-nightly", "etl-nightly", "ETL_x", "ETLx")):
        body = run_batch("prod", "s1", f"r{i}", 0, t=T0 + i)
        body["seq"] = i
        body["events"][0]["name"] = name
        assert post(collector, body, token=token).status_code == 202
    assert names(query.get("/v1/runs?name=ETL*", headers=auth(token))) == [
        "ETLx", "ETL_x", "ETL-nightly"]  # fmt: skip
    assert names(query.get("/v1/runs?name=ETL_*", headers=auth(token))) == ["ETL_x"]
    assert names(query.get("/v1/runs?name=etl*", headers=auth(token))) == ["etl-nightly"]


def test_errors_that_differ_only_by_numbers_or_ids_are_one_group(clients, make_token):
    """'bad record 1' and 'bad record 2', or Ray's
    'Task: TaskID(98b3...) was cancelled', made a group per task."""
    collector, query = clients
    token = make_token()
    body = run_batch("prod", "s1", "r", 0, n_tasks=0)
    texts = [f"ValueError('bad record {i}')" for i in range(5)]
    texts += [
        f"TaskCancelledError: Task: TaskID({h}) was cancelled." for h in ("98b3ff0a", "0c1d2e3f")
    ]
    texts += ["ZeroDivisionError: division by zero"]
    # ... but a number that names the error keeps it apart
    texts += ["CalledProcessError: exit status 1", "CalledProcessError: exit status 137"]
    body["events"][1:1] = [
        {"kind": "task", "key": f"bad-{i}", "prefix": "bad", "status": "erred", "run": "r",
         "exception": text, "traceback": "  File x.py, line 1"}
        for i, text in enumerate(texts)
    ]  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    groups = query.get(f"/v1/runs/{run['id']}/errors", headers=auth(token)).json["groups"]
    assert [(g["exception"], g["count"], g["messages"]) for g in groups] == [
        ("ValueError('bad record 0')", 5, 5),
        ("TaskCancelledError: Task: TaskID(98b3ff0a) was cancelled.", 2, 2),
        ("CalledProcessError: exit status 1", 1, 1),
        ("CalledProcessError: exit status 137", 1, 1),
        ("ZeroDivisionError: division by zero", 1, 1),
    ]
    assert groups[0]["keys"] == [f"bad-{i}" for i in range(5)]


def test_time_counts_a_worker_only_while_it_was_there(clients, make_token):
    """Each worker process (alive for a few tasks, as Ray's are) counts as capacity only
    while it was there, not for the whole run's makespan (that made 105.8 s of capacity on
    2 CPUs over 17.6 s); the same for a Dask worker joining an adaptive cluster mid-run."""
    collector, query = clients
    token = make_token()
    body = run_batch("prod", "s1", "r", 0, n_tasks=0)
    w1, w2 = "tcp://w:1", "tcp://w:2"
    body["events"][1:1] = [
        {"kind": "worker", "event": "joined", "address": w1, "time": T0 - 60, "nthreads": 2},
        {"kind": "worker", "event": "joined", "address": w2, "time": T0 + 8, "nthreads": 1},
        {"kind": "worker", "event": "left", "address": w2, "time": T0 + 9.5},
        {"kind": "task", "key": "a-0", "prefix": "a", "status": "memory", "run": "r", "worker": w1,
         "startstops": [{"action": "compute", "start": T0, "stop": T0 + 10}]},
        {"kind": "task", "key": "a-1", "prefix": "a", "status": "memory", "run": "r", "worker": w2,
         "startstops": [{"action": "compute", "start": T0 + 8.5, "stop": T0 + 9}]},
    ]  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    got = query.get(f"/v1/runs/{run['id']}/time", headers=auth(token)).json
    workers = {w["worker"]: w for w in got["workers"]}
    assert workers[w1]["capacity"] == pytest.approx(20.0)  # 2 threads over the 10 s run
    assert workers[w2]["capacity"] == pytest.approx(1.5)  # joined at 8, left at 9.5
    assert workers[w2]["idle"] == pytest.approx(1.0)


def test_a_clusters_time_counts_a_thread_once_when_its_runs_overlap(clients, make_token):
    """Two runs computed at once from two clients read the cluster as
    twice its size, half of it idle (16.6 s of capacity, 8.6 idle, for ~8.6 s of threads
    ~93% busy). Each run's own view still offers it the threads over its makespan."""
    collector, query = clients
    token = make_token()
    w = "tcp://w:1"

    def task(run: str, start: float) -> dict[str, Any]:
        return {"kind": "task", "key": f"a-{run}", "prefix": "a", "status": "memory", "run": run,
                "worker": w, "thread": 1, "startstops": [{"action": "compute", "start": start,
                                                          "stop": start + 10}]}  # fmt: skip

    events = [
        {"kind": "worker", "event": "joined", "address": w, "time": T0 - 60, "nthreads": 2},
        {"kind": "run", "event": "started", "id": "r", "name": "one", "time": T0},
        {"kind": "run", "event": "started", "id": "q", "name": "two", "time": T0 + 5},
        task("r", T0), task("q", T0 + 5),
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 10},
        {"kind": "run", "event": "finished", "id": "q", "time": T0 + 15},
    ]  # fmt: skip
    body = example(cluster="conc", session="s1", agent="scheduler-1", seq=0, events=events)
    assert post(collector, body, token=token).status_code == 202
    for run in query.get("/v1/runs", headers=auth(token)).json["runs"]:
        got = query.get(f"/v1/runs/{run['id']}/time", headers=auth(token)).json
        assert (got["capacity"], got["idle"]) == pytest.approx((20.0, 10.0))
    got = query.get("/v1/clusters/conc/time", headers=auth(token)).json
    # 2 threads over the 15 s the runs covered, 20 s of them busy
    assert (got["runs"], got["capacity"], got["compute"], got["idle"]) == pytest.approx(
        (2, 30.0, 20.0, 10.0)
    )
    assert got["workers"][0]["capacity"] == pytest.approx(30.0)


def test_one_slow_run_does_not_set_the_regression_baseline(clients, make_token):
    """The baseline was the p90 of the previous runs' tasks pooled, so
    one slow run among four set it: the normal run after it read 61% faster, and a
    slowdown right after it would have been hidden. It is the median of their p90s."""
    collector, query = clients
    token = make_token()

    def etl(n: int, seconds: float) -> dict[str, Any]:
        t = T0 + n * 100
        tasks = [{"kind": "task", "key": f"transform-{n}-{i}", "prefix": "transform",
                  "status": "memory", "run": f"r{n}", "worker": "tcp://w:1", "thread": 1,
                  "startstops": [{"action": "compute", "start": t + i, "stop": t + i + seconds}]}
                 for i in range(20)]  # fmt: skip
        events = [{"kind": "run", "event": "started", "id": f"r{n}", "name": "etl", "time": t},
                  *tasks, {"kind": "run", "event": "finished", "id": f"r{n}", "time": t + 20}]  # fmt: skip
        return example(cluster="prod", session="s1", agent="scheduler-1", seq=n, events=events)

    for n, seconds in enumerate((0.03, 0.03, 0.03, 0.08, 0.03, 0.06)):
        assert post(collector, etl(n, seconds), token=token).status_code == 202
    runs = {
        r["started_at"]: r["id"] for r in query.get("/v1/runs", headers=auth(token)).json["runs"]
    }
    normal, slow = runs[T0 + 400], runs[T0 + 500]

    def moved(run_id: str) -> dict[str, Any]:
        got = query.get(f"/v1/runs/{run_id}/regressions?baseline=4&threshold=20",
                        headers=auth(token)).json  # fmt: skip
        assert len(got["baseline_runs"]) == 4
        (entry,) = got["checked"]
        return {"baseline": entry["baseline_p90"], "flagged": [r["direction"] for r in got["regressions"]]}  # fmt: skip

    assert moved(normal) == {"baseline": pytest.approx(0.03, rel=0.05), "flagged": []}
    assert moved(slow) == {"baseline": pytest.approx(0.03, rel=0.05), "flagged": ["slower"]}


def test_transfers_leave_the_threads_idle(clients, make_token):
    """A transfer-bound run's workers read 4.4 s idle of 7.9 s
    of thread capacity, its 3.5 s of transfers taken from the threads; Dask transfers on
    the worker's event loop before a task takes a thread, and its own metrics had the
    threads idle (~11.5 of 15.8 s). A task's disk reads hold its thread's slot (a
    reviewer, from Dask's Worker.execute), so they still count."""
    collector, query = clients
    token = make_token()
    body = run_batch("prod", "s1", "r", 0, n_tasks=0)
    w = "tcp://w:1"
    body["events"][1:1] = [
        {"kind": "worker", "event": "joined", "address": w, "time": T0 - 60, "nthreads": 2},
        {"kind": "task", "key": "a-0", "prefix": "a", "status": "memory", "run": "r", "worker": w,
         "startstops": [{"action": "transfer", "start": T0, "stop": T0 + 6, "source": "tcp://w:2"},
                        {"action": "disk-read", "start": T0 + 6, "stop": T0 + 7},
                        {"action": "compute", "start": T0 + 7, "stop": T0 + 10}]},
    ]  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    got = query.get(f"/v1/runs/{run['id']}/time", headers=auth(token)).json
    assert (got["capacity"], got["compute"], got["transfer"], got["spill"]) == pytest.approx(
        (20.0, 3.0, 6.0, 1.0)
    )
    assert got["idle"] == pytest.approx(16.0)  # 2 threads x 10 s, one of them 4 s busy


def test_a_run_shorter_than_the_sample_interval_keeps_its_workers_nearest_samples(
    clients, make_token
):
    """A loaded scheduler samples late: a 0.3 s run whose workers' samples came 1.6 s
    before and 1.7 s after it had no metrics (found in CI: its page drew no memory or CPU
    lines). Each series keeps its nearest sample either side, but a worker that left
    before the run, or joined after it, does not appear in it."""
    collector, query = clients
    token = make_token()
    start, end = T0 + 10, T0 + 10.3

    def sample(worker: str, t: float) -> dict[str, Any]:
        return {"kind": "metric", "worker": worker, "time": t,
                "values": {"memory.managed": 1e6 * (t - T0), "cpu": 50.0}}  # fmt: skip

    events = [
        sample("tcp://w:1", start - 3.1), sample("tcp://w:1", start - 1.6),
        sample("tcp://gone:1", start - 2.5),  # left before the run
        sample("tcp://w:2", start - 0.4), sample("tcp://w:2", start - 0.9),  # on time
        {"kind": "run", "event": "started", "id": "r", "name": "short", "time": start},
        {"kind": "task", "key": "k", "prefix": "inc", "status": "memory", "run": "r",
         "worker": "tcp://w:1", "startstops": [{"action": "compute", "start": start, "stop": end}]},
        {"kind": "run", "event": "finished", "id": "r", "time": end},
        sample("tcp://w:1", end + 1.7), sample("tcp://w:1", end + 2.7),
        sample("tcp://w:2", end + 0.6),
        sample("tcp://new:1", end + 2.0),  # joined after it
    ]  # fmt: skip
    body = example(cluster="c", session="s", agent="scheduler-1", seq=0, events=events)
    assert post(collector, body, token=token).status_code == 202
    h = auth(token)
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    series = query.get(f"/v1/runs/{run['id']}/metrics", headers=h).json["series"]
    got = {(s["worker"], s["name"]): [round(p["time"] - T0, 1) for p in s["points"]]
           for s in series}  # fmt: skip
    assert got == {
        ("tcp://w:1", "cpu"): [8.4, 12.0], ("tcp://w:1", "memory.managed"): [8.4, 12.0],
        ("tcp://w:2", "cpu"): [9.1, 9.6, 10.9], ("tcp://w:2", "memory.managed"): [9.1, 9.6, 10.9],
    }  # fmt: skip
