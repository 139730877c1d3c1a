"""Dashboard pages without a browser: auth, tenant isolation, escaping."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import example, post


def login(client: Any, token: str) -> Any:
    return client.post("/login", data={"token": token, "next": "/"})


def test_pages_need_a_read_token_and_login_sets_an_httponly_cookie(apps, make_token):
    collector, query = apps
    token = make_token()
    assert post(collector, example(), token=token).status_code == 202
    resp = query.get("/")
    assert resp.status_code == 302 and "/login" in resp.headers["Location"]
    assert login(query, "hs_wrong").status_code == 401
    assert login(query, make_token(scopes="ingest")).status_code == 401  # no read scope
    resp = login(query, token)
    assert resp.status_code == 302
    cookie = resp.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    page = query.get("/")
    assert page.status_code == 200 and b"nightly-aggregate" in page.data
    assert query.post("/logout").status_code == 302
    assert query.get("/").status_code == 302


def test_a_signed_in_user_reads_the_api_the_pages_use_and_can_sign_out(apps, make_token):
    """Signed in at /login, the pages' own requests (replay, live refresh) and their data
    and export links are answered, not 401: reading the API takes the login cookie as well
    as the bearer header; writing never does."""
    collector, query = apps
    token = make_token(scopes="ingest,read")
    assert post(collector, example(), token=token).status_code == 202
    assert query.get("/v1/runs").status_code == 401
    login(query, token)
    (run,) = query.get("/v1/runs").json["runs"]
    assert query.get(f"/v1/runs/{run['id']}/tasks").status_code == 200
    assert query.get(f"/v1/runs/{run['id']}/trace").status_code == 200
    assert b"sign out" in query.get(f"/runs/{run['id']}").data
    collector.set_cookie("hindsight_token", token)  # the cookie never authorises a write
    assert collector.post("/v1/batches", json=example(seq=1)).status_code == 401
    assert query.post("/logout").status_code == 302
    assert query.get("/v1/runs").status_code == 401


def test_pages_say_when_there_is_nothing_to_draw(apps, make_token):
    """Every "nothing to show" text shows where there is nothing to draw, not an empty box
    (the template must not test the figure's JSON text, in which "null" is true)."""
    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    assert b"No runs recorded yet." in query.get("/history", headers=h).data
    assert b"No runs yet." in query.get("/", headers=h).data
    assert b"No runs match these filters." in query.get("/?cluster=nope", headers=h).data
    assert post(collector, example(), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    page = query.get(f"/runs/{run['id']}", headers=h).data
    assert b'id="no-profile"' in page and b'<div id="profile">' not in page  # none in the example
    assert b'id="no-activity-history"' in query.get("/history?prefix=nope", headers=h).data


def test_a_run_page_names_workers_that_left_with_nothing_of_their_own_arriving(apps, make_token):
    """The run page says what completeness now knows: a worker killed before its agent's
    first batch got through (its logs, values and samples may wait in a spool)."""
    from tests.query.test_runs import T0

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    events = [
        {"kind": "run", "event": "started", "id": "r", "name": "etl", "time": T0},
        *(
            {
                "kind": "worker",
                "event": "joined",
                "address": f"tcp://w:{n}",
                "name": str(n),
                "time": T0,
            }
            for n in range(2)
        ),  # fmt: skip
        {"kind": "worker", "event": "left", "address": "tcp://w:1", "time": T0 + 2},
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 1},
        # a run that started after it left: not its loss
        {"kind": "run", "event": "started", "id": "q", "name": "later", "time": T0 + 3},
        {"kind": "run", "event": "finished", "id": "q", "time": T0 + 4},
        # nor that of a run over before a worker joined (and left with nothing arriving)
        {"kind": "worker", "event": "joined", "address": "tcp://w:5", "name": "5", "time": T0 + 50},
        {"kind": "worker", "event": "left", "address": "tcp://w:5", "time": T0 + 60},
        # a worker killed in a run before its first batch, restarted by its nanny under
        # its name: the new worker's agent is not the dead one's
        {"kind": "run", "event": "started", "id": "k", "name": "killed", "time": T0 + 70},
        {"kind": "worker", "event": "joined", "address": "tcp://w:6", "name": "6", "time": T0 + 70},
        {"kind": "worker", "event": "left", "address": "tcp://w:6", "time": T0 + 71},
        {"kind": "worker", "event": "joined", "address": "tcp://w:7", "name": "6", "time": T0 + 72},
        {"kind": "run", "event": "finished", "id": "k", "time": T0 + 75},
    ]
    body = example(cluster="c", session="Scheduler-1", agent="scheduler-0123456789ab", seq=0,
                   events=events, final=True)  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    sample = {"kind": "metric", "worker": "tcp://w:7", "time": T0 + 73, "values": {"cpu": 1.0}}
    new_agent = example(cluster="c", session="Scheduler-1", agent="worker-6-0123456789ab",
                        seq=0, events=[sample], final=True)  # fmt: skip
    assert post(collector, new_agent, token=token).status_code == 202
    killed, later, run = query.get("/v1/runs", headers=h).json["runs"]
    c = query.get(f"/v1/runs/{killed['id']}", headers=h).json["completeness"]
    assert (c["closed"], c["workers_without_batches"]) == (False, ["tcp://w:6"])
    page = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    assert (
        '<span id="silent-workers">1 worker left with none of its own arriving (tcp://w:1)' in page
    )
    assert 'id="silent-workers"' not in query.get(f"/runs/{later['id']}", headers=h).data.decode()
    c = [query.get(f"/v1/runs/{r['id']}", headers=h).json["completeness"] for r in (run, later)]
    assert [(x["closed"], x["workers_without_batches"]) for x in c] == [
        (False, ["tcp://w:1"]), (True, []),
    ]  # fmt: skip
    # another scheduler's agents (no scheduler-* agent): every agent must have closed
    other = [
        {"kind": "run", "event": "started", "id": "o", "name": "theirs", "time": T0},
        {"kind": "run", "event": "finished", "id": "o", "time": T0 + 1},
    ]
    for agent, final in (("driver-1", True), ("worker-a", False)):
        body = example(cluster="c", session="Other-1", agent=agent, seq=0,
                       events=other if agent == "driver-1" else [], final=final)  # fmt: skip
        assert post(collector, body, token=token).status_code == 202
    (theirs,) = [r for r in query.get("/v1/runs", headers=h).json["runs"] if r["name"] == "theirs"]
    c = query.get(f"/v1/runs/{theirs['id']}", headers=h).json["completeness"]
    assert (c["closed"], c["unclosed_worker_agents"]) == (False, [])


def test_a_run_page_names_worker_agents_that_never_closed_once_the_cluster_did(
    apps, make_token, caplog
):
    """The run page of a worker killed mid-run names the agent whose last batch never came
    (its completeness is not closed), rather than "100.0% of batches". Only the run's own
    workers count: a worker killed in an earlier run is not this run's loss, nor is it when
    a nanny restarted it under its name."""
    from tests.query.test_runs import T0

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}

    def task(run: str, worker: str, t: float) -> dict[str, Any]:
        return {"kind": "task", "key": f"a-{run}", "prefix": "a", "status": "memory", "run": run,
                "worker": worker,
                "startstops": [{"action": "compute", "start": t, "stop": t + 0.5}]}  # fmt: skip

    events = [
        {"kind": "worker", "event": "joined", "address": "tcp://w:1", "name": "1", "time": T0},
        {"kind": "worker", "event": "joined", "address": "tcp://w:2", "name": "2", "time": T0},
        {"kind": "run", "event": "started", "id": "r", "name": "etl", "time": T0},
        task("r", "tcp://w:1", T0),
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 1},
        {"kind": "run", "event": "started", "id": "q", "name": "other", "time": T0 + 2},
        task("q", "tcp://w:2", T0 + 2),
        {"kind": "run", "event": "finished", "id": "q", "time": T0 + 3},
        # worker 1 killed at T0 + 1; its nanny's new worker, under the same name
        {"kind": "worker", "event": "joined", "address": "tcp://w:3", "name": "1", "time": T0 + 4},
        {"kind": "run", "event": "started", "id": "s", "name": "after", "time": T0 + 5},
        task("s", "tcp://w:3", T0 + 5),
        {"kind": "run", "event": "finished", "id": "s", "time": T0 + 6},
    ]
    sched = example(cluster="c", session="Scheduler-1", agent="scheduler-0123456789ab", seq=0,
                    events=events, final=False)  # fmt: skip
    sample = {"kind": "metric", "worker": "tcp://w:1", "time": T0 + 0.5, "values": {"cpu": 1.0}}
    worker = example(cluster="c", session="Scheduler-1", agent="worker-1-0123456789ab", seq=0,
                     events=[sample], final=False)  # fmt: skip
    restarted = example(cluster="c", session="Scheduler-1", agent="worker-1-ba9876543210",
                        seq=0, events=[], final=True)  # fmt: skip
    # worker 2's agent never closed either (its nanny killed it 4 s into a retirement,
    # as an adaptive cluster's are), but its batches reach past run "other"'s end: that
    # run lost nothing of it
    sample2 = {"kind": "metric", "worker": "tcp://w:2", "time": T0 + 3.5, "values": {"cpu": 1.0}}
    retired = example(cluster="c", session="Scheduler-1", agent="worker-2-0123456789ab", seq=0,
                      events=[sample2], final=False)  # fmt: skip
    for body in (sched, worker, restarted, retired):
        assert post(collector, body, token=token).status_code == 202
    after, other, run = query.get("/v1/runs", headers=h).json["runs"]
    assert 'id="unclosed-agents"' not in query.get(f"/runs/{run['id']}", headers=h).data.decode()
    last = example(cluster="c", session="Scheduler-1", agent="scheduler-0123456789ab", seq=1,
                   events=[], final=True)  # fmt: skip
    assert post(collector, last, token=token).status_code == 202  # the cluster closed
    page = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    assert (
        '<span id="unclosed-agents">the cluster closed, and 1 worker agent never sent its last'
        " batch (worker-1-0123456789ab)" in page
    )
    for r in (other, after):
        assert 'id="unclosed-agents"' not in query.get(f"/runs/{r['id']}", headers=h).data.decode()
    # the API says the same of each run (not "not closed" for all three)
    closed = {}
    for r in (run, other, after):
        c = query.get(f"/v1/runs/{r['id']}", headers=h).json["completeness"]
        closed[r["name"]] = (c["closed"], c["unclosed_worker_agents"])
    assert closed == {
        "etl": (False, ["worker-1-0123456789ab"]), "other": (True, []), "after": (True, []),
    }  # fmt: skip
    # a run with a CPU sample and no other metric drew an empty "tasks processing" panel,
    # and Bokeh logged a warning for it at every view
    assert not [r for r in caplog.records if "MISSING_RENDERERS" in r.getMessage()]


@pytest.mark.parametrize(
    "case,tasks_fact,errors_fact",
    [("retried", "4 records of 3 tasks (some ran again",
      "1 (every erred task ran again and succeeded)"),
     ("cancelled",
      "2 of the graph's 5 tasks have no record (never ran: cancelled, or the client", None),
     ("still-erred", "3 records of 2 tasks (some ran again", "2 (1 task erred at the end)"),
     # an attempt that erred, then one whose end never came (Ray's lost)
     ("erred-then-lost", "3 records of 2 tasks (some ran again", "1")],
)  # fmt: skip
def test_a_run_page_tells_runs_from_tasks_and_errors_that_were_retried(
    apps, make_token, case, tasks_fact, errors_fact
):
    """A run whose failures were all retried and succeeded (``client.retry``) says so, not a
    bare "tasks 220, errors 20"; a cancelled run says which of the graph's tasks have no
    record, not "tasks 28" beside a progress bar of 200/200."""
    from tests.query.test_runs import T0

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    ran = {"retried": [("a-0", "erred", 1), ("a-0", "memory", 2), ("a-1", "memory", 1),
                       ("a-2", "memory", 1)],
           "cancelled": [("a-0", "memory", 1), ("a-1", "memory", 1), ("a-2", "memory", 1)],
           "still-erred": [("a-0", "erred", 1), ("a-0", "erred", 2), ("a-1", "memory", 1)],
           "erred-then-lost": [("a-0", "erred", 1), ("a-0", "lost", 2),
                               ("a-1", "memory", 1)]}[case]  # fmt: skip
    graph = {"retried": 3, "cancelled": 5, "still-erred": 2, "erred-then-lost": 2}[case]
    events = [
        {"kind": "run", "event": "started", "id": "r", "name": "etl", "time": T0},
        *({"kind": "graph", "key": f"a-{i}", "prefix": "a", "run": "r"} for i in range(graph)),
        *({"kind": "task", "key": k, "prefix": "a", "status": st, "run": "r", "worker": "tcp://w:1",
           "startstops": [{"action": "compute", "start": T0 + t, "stop": T0 + t + 0.5}]}
          for k, st, t in ran),
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 3},
    ]  # fmt: skip
    body = example(cluster="c", session="Scheduler-1", agent="scheduler-0123456789ab", seq=0,
                   events=events, final=True)  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    page = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    tasks = page.split('<div id="tasks-fact"><span>tasks</span>', 1)[1].split("</div>", 1)[0]
    errors = page.split('<div id="errors-fact"><span>errors</span>', 1)[1].split("</div>", 1)[0]
    if tasks_fact is None:
        assert tasks == str(len(ran))
    else:
        assert tasks_fact in tasks, tasks
    if errors_fact is None:
        assert errors == "0"
    else:
        assert errors == errors_fact


def test_two_runs_ticked_in_the_list_compare_the_earlier_as_a(apps, make_token):
    """The list is newest first, yet the earlier of two ticked runs is A (a slowdown must not
    read as "better"); a run page's link has the previous run as A."""
    from tests.query.test_runs import T0, run_batch

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    for seq, (run, t) in enumerate((("old", T0), ("new", T0 + 3600))):
        body = run_batch("c", "s", run, 0, t=t)
        body["seq"] = seq
        assert post(collector, body, token=token).status_code == 202
    runs = query.get("/v1/runs", headers=h).json["runs"]  # newest first, as the list ticks them
    assert [r["name"] for r in runs] == ["job-new", "job-old"]
    page = query.get("/compare", query_string={"run": [r["id"] for r in runs]}, headers=h)
    head = page.data.split(b"</thead>")[0]
    assert (
        head.index(b"A: <a")
        < head.index(b"job-old")
        < head.index(b"B: <a")
        < head.index(b"job-new")
    )
    explicit = query.get(f"/compare?a={runs[0]['id']}&b={runs[1]['id']}", headers=h).data
    assert explicit.index(b"job-new") < explicit.index(b"job-old")  # a= and b= as given


def test_a_wrong_page_address_in_a_browser_gets_the_error_page(apps):
    """/runs, /runs/ID/nope or GET /logout answer a browser with the error page, not the
    API's JSON error. The API keeps its JSON errors."""
    _, query = apps
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    for path, status in (("/runs", 404), ("/nope", 404), ("/logout", 405)):
        resp = query.get(path, headers=browser)
        assert resp.status_code == status and resp.mimetype == "text/html", path
        assert b'class="error"' in resp.data
    assert query.get("/v1/nope", headers=browser).json["error"]["code"] == "not_found"
    assert query.get("/nope").json["error"]["code"] == "not_found"  # a client asking for */*


def test_login_redirects_only_to_local_paths(apps, make_token):
    _, query = apps
    token = make_token()
    for target in ("https://evil.example/", "//evil.example/x"):
        resp = query.post("/login", data={"token": token, "next": target})
        assert resp.headers["Location"] == "/"


def test_a_tenant_sees_only_its_own_runs_in_pages(apps, make_token):
    collector, query = apps
    alice, bob = make_token(), make_token()
    assert post(collector, example(), token=alice).status_code == 202
    (run,) = query.get("/v1/runs", headers={"Authorization": f"Bearer {alice}"}).json["runs"]
    h = {"Authorization": f"Bearer {bob}"}
    assert b"nightly-aggregate" not in query.get("/", headers=h).data
    assert query.get(f"/runs/{run['id']}", headers=h).status_code == 404
    assert (
        query.get(f"/runs/{run['id']}", headers={"Authorization": f"Bearer {alice}"}).status_code
        == 200
    )


def test_task_keys_cannot_inject_markup(apps, make_token):
    collector, query = apps
    token = make_token()
    batch = example()
    evil = "</script><script>alert(1)</script>"
    for e in batch["events"]:
        if e["kind"] == "task":
            e["key"] = evil + e["key"]
    assert post(collector, batch, token=token).status_code == 202
    h = {"Authorization": f"Bearer {token}"}
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    html = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    assert evil not in html  # the plot's JSON is escaped for a <script> block
    item = json.loads(html.split("const streamData = ", 1)[1].split(";\n", 1)[0])
    keys_url = item["task-stream-source"]["keys_url"]  # the hover's keys come separately
    resp = query.get(keys_url, headers=h)
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    assert sum(evil in k for k in resp.json) == sum(e["kind"] == "task" for e in batch["events"])
    # another tenant's token reads no keys of this run
    other = make_token()
    assert query.get(keys_url, headers={"Authorization": f"Bearer {other}"}).status_code == 404


def test_bad_filters_are_a_400_page_and_bokeh_is_served_locally(apps, make_token):
    _, query = apps
    h = {"Authorization": f"Bearer {make_token()}"}
    assert query.get("/?status=nope", headers=h).status_code == 400
    assert query.get("/?since=yesterday", headers=h).status_code == 400
    with query.get("/assets/bokeh/js/bokeh.min.js") as js:  # a streamed file: close it
        assert js.status_code == 200 and len(js.data) > 100_000
    assert query.get("/assets/bokeh/../../secrets").status_code == 404
    assert query.get("/assets/bokeh/css/x.css").status_code == 404


def test_runs_table_shows_each_jobs_makespan_trend(apps, make_token):
    """Runs of the same job (same name) get a sparkline of their makespans."""
    collector, query = apps
    token = make_token()
    for seq, makespan in enumerate([1.0, 2.0, 4.0]):
        events = [
            {"kind": "run", "event": "started", "id": f"r{seq}", "name": "nightly",
             "time": 1.8e9 + seq * 100},
            {"kind": "task", "key": f"k{seq}", "prefix": "inc", "status": "memory",
             "run": f"r{seq}",
             "startstops": [{"action": "compute", "start": 1.8e9 + seq * 100,
                             "stop": 1.8e9 + seq * 100 + makespan}]},
        ]  # fmt: skip
        assert post(collector, example(seq=seq, events=events), token=token).status_code == 202
    html = query.get("/", headers={"Authorization": f"Bearer {token}"}).data.decode()
    assert html.count('<svg class="trend"') == 3
    assert "makespan of the last 3 runs of this job: 1-4 s" in html
    assert html.count('fill="#d62728"') == 3  # each row marks its own run


def test_a_running_runs_page_carries_its_task_keys(apps, make_token):
    """A finished run's page leaves the hover's task keys to /runs/<id>/stream-keys; a
    running run's tasks change between requests, so its page carries them itself."""
    collector, query = apps
    token = make_token()
    events = [
        {"kind": "run", "event": "started", "id": "still-going", "time": 1.8e9},
        {"kind": "task", "key": "k-live", "prefix": "inc", "status": "memory", "run": "still-going",
         "startstops": [{"action": "compute", "start": 1.8e9, "stop": 1.8e9 + 1}]},
    ]  # fmt: skip
    assert post(collector, example(events=events), token=token).status_code == 202
    h = {"Authorization": f"Bearer {token}"}
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    assert run["status"] == "running"
    html = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    stream = json.loads(html.split("const streamData = ", 1)[1].split(";\n", 1)[0])
    assert stream["task-stream-source"]["keys"] == ["k-live"]
    assert "keys_url" not in stream["task-stream-source"]


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)  # an index of its own
def test_a_lost_runs_page_says_what_lost_means(apps, make_token):
    """A run closed 'lost' says what lost means (and the setting behind it), not only the
    word."""
    import time

    from storage.jobs import silent
    from tests.query.test_runs import run_batch

    collector, query = apps
    token = make_token()
    assert post(collector, run_batch("c", "s", "r", 0, status=None), token=token).status_code == 202
    st = query.application.extensions["hindsight"]
    assert silent.close_silent(st.sessions, silence=60, now=time.time() + 120) >= 1
    login(query, token)  # the test client keeps the cookie
    (run,) = query.get("/v1/runs?status=lost").json["runs"]
    page = query.get(f"/runs/{run['id']}").get_data(as_text=True)
    assert 'id="lost-note"' in page and "HINDSIGHT_SILENT_CLOSE_SECONDS" in page


def test_the_runs_list_sorts_by_its_columns(apps, make_token):
    """The runs list sorts by its columns, /?sort=-makespan included."""
    import re

    from tests.query.test_runs import T0, run_batch

    collector, query = apps
    token = make_token()
    for i, n in enumerate((2, 5, 3)):
        body = run_batch("c", "s", f"r{i}", 0, n_tasks=n, t=T0 + 60 * i)
        body["seq"] = i
        assert post(collector, body, token=token).status_code == 202
    login(query, token)

    def names(path: str) -> list[str]:
        page = query.get(path).get_data(as_text=True)
        return re.findall(r'href="/runs/[^"]+">([^<]+)</a>', page)

    assert names("/") == ["job-r2", "job-r1", "job-r0"]  # newest first
    assert names("/?sort=-task_count") == ["job-r1", "job-r2", "job-r0"]
    assert names("/?sort=task_count") == ["job-r0", "job-r2", "job-r1"]
    page = query.get("/?sort=-task_count&cluster=c").get_data(as_text=True)
    assert 'href="?sort=task_count&amp;cluster=c"' in page  # the header turns it around
    assert query.get("/?sort=nope").status_code == 400


def test_every_page_has_one_title_and_each_checkbox_names_its_run(apps, make_token):
    """Every page has one h1 (not an h2 for its title), and the compare boxes of runs of the
    same name each name their own run, not one shared label ("compare job-x")."""
    import re

    from tests.query.test_runs import T0, run_batch

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    for seq, t in enumerate((T0, T0 + 3600)):  # two runs of one job
        body = run_batch("c", "s", f"r{seq}", 0, t=t)
        body["events"][0]["name"] = "nightly"
        body["seq"] = seq
        assert post(collector, body, token=token).status_code == 202
    runs = query.get("/v1/runs", headers=h).json["runs"]
    assert [r["name"] for r in runs] == ["nightly", "nightly"]
    ids = [r["id"] for r in runs]
    listing = query.get("/", headers=h).data.decode()
    labels = re.findall(r'type="checkbox"[^>]*aria-label="([^"]*)"', listing)
    assert len(labels) == 2 and len(set(labels)) == 2, labels
    pages = ["/", f"/runs/{ids[0]}", f"/compare?a={ids[0]}&b={ids[1]}", "/history",
             "/runs/nope", "/compare?a=x"]  # fmt: skip
    for path in pages:
        page = query.get(path, headers={**h, "Accept": "text/html"}).data.decode()
        assert page.count("<h1") == 1, (path, page.count("<h1"))
        # and no level is skipped going down (sections were h3 under the title)
        levels = [int(n) for n in re.findall(r"<h([1-6])\b", page)]
        assert all(b <= a + 1 for a, b in zip(levels, levels[1:], strict=False)), (path, levels)
    assert query.get("/login").data.decode().count("<h1") == 1


def test_a_run_page_says_which_emitted_streams_its_plot_leaves_out(apps, make_token):
    """Past six numeric streams the plot draws six and names the rest it leaves out (not
    leaving them only as rows of the table below it)."""
    from services.dashboard.side_plots import MAX_PLOTTED
    from tests.query.test_runs import T0, run_batch

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    body = run_batch("c", "s", "r", 0, t=T0)
    streams = MAX_PLOTTED + 2
    body["events"][1:1] = [
        {"kind": "custom", "stream": f"loss-{i}", "time": T0 + j, "value": float(j), "run": "r"}
        for i in range(streams) for j in range(i + 2)
    ]  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    page = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    assert page.count('class="stream-row"') == streams
    note = page.split('id="streams-unplotted">')[1].split("</p>")[0]
    assert f"draws the {MAX_PLOTTED} streams" in note and "2 more are in the table" in note, note
    few = run_batch("c", "s2", "r2", 0, t=T0 + 10)
    few["events"][1:1] = [
        {"kind": "custom", "stream": "one", "time": T0 + 10, "value": 1.0, "run": "r2"}
    ]
    assert post(collector, few, token=token).status_code == 202
    other = next(r for r in query.get("/v1/runs", headers=h).json["runs"] if r["id"] != run["id"])
    assert "streams-unplotted" not in query.get(f"/runs/{other['id']}", headers=h).data.decode()


def _sources(item: Any) -> dict[str, dict[str, list[Any]]]:
    """The named data sources of an embedded Bokeh item, by name: their columns."""
    found: dict[str, dict[str, list[Any]]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            attrs = node.get("attributes") or {}
            if node.get("name") == "ColumnDataSource" and "name" in attrs:
                found[attrs["name"]] = dict(attrs["data"]["entries"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(item)
    return found


def test_history_lines_break_over_hours_without_runs(apps, make_token):
    """A cluster's history line breaks over hours without runs: no one line from its runs of
    10:00 to its runs of 15:00, as if it had run between."""
    from tests.query.test_runs import T0, run_batch

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    for seq, hour in enumerate((0, 1, 5)):
        body = run_batch("c", "s", f"r{hour}", 0, t=T0 + 3600 * hour)
        body["seq"] = seq
        assert post(collector, body, token=token).status_code == 202
    page = query.get("/history?bucket=hour", headers=h).data.decode()
    item = json.loads(page.split("const plot = ")[1].split(";\n")[0])
    ys = _sources(item)["history-runs-line"]["y"]
    gap = {"type": "number", "value": "nan"}
    assert ys == [1, 1, gap, 1], ys  # hours 0 and 1 joined, then a break before hour 5
    day = json.loads(query.get("/history?bucket=day", headers=h).data.decode()
                     .split("const plot = ")[1].split(";\n")[0])  # fmt: skip
    assert gap not in _sources(day)["history-runs-line"]["y"]


# werkzeug leaves the part it was spooling when it stops at the limit to the collector
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sign_in_form_past_flasks_limit_is_not_called_a_batch(apps):
    """A sign-in form past Flask's own form limit (500 kB) is a 413 request_too_large, not
    batch_too_large with the ingest cap's message."""
    import gc

    _, query = apps
    resp = query.post("/login", data={"token": "x" * 600_000}, content_type="multipart/form-data",
                      headers={"Accept": "application/json"})  # fmt: skip
    assert resp.status_code == 413
    assert resp.json["error"]["code"] == "request_too_large"
    assert "batch" not in resp.json["error"]["message"]
    del resp
    gc.collect()


def test_activity_history_lines_break_over_buckets_without_runs():
    """The same for a prefix's seconds by activity (/history?prefix=): hours 0 and 1
    joined, a break before hour 5."""
    from services.dashboard.why_plots import activity_history_chart

    t0 = 1_795_000_000 // 3600 * 3600
    points = [{"time": t0 + 3600 * h, "runs": 1, "activity": {"thread-cpu": {"mean": 2.0}}}
              for h in (0, 1, 5)]  # fmt: skip
    ys = _sources(activity_history_chart(points, "t", 3600))["activity-history-0"]["y"]
    assert ys == [2.0, 2.0, {"type": "number", "value": "nan"}, 2.0], ys


def test_a_graph_past_the_node_budget_is_drawn_by_prefix_with_edge_counts(
    apps, make_token, monkeypatch
):
    """A graph with more tasks than the graph view draws one by one shows its shape: a node
    per prefix sized by its tasks, by depth, and an edge per pair of prefixes with how many
    task dependencies it stands for (a dependency within a prefix is none)."""
    from services.dashboard import plots
    from tests.query.test_runs import T0

    collector, query = apps
    token = make_token()
    h = {"Authorization": f"Bearer {token}"}
    n = 12
    graph = [
        *({"key": f"load-{i}", "prefix": "load", "dependencies": []} for i in range(n)),
        *({"key": f"clean-{i}", "prefix": "clean", "dependencies": [f"load-{i}"]}
          for i in range(n)),
        *({"key": f"clean-x{i}", "prefix": "clean", "dependencies": [f"clean-{i}"]}
          for i in range(3)),
        {"key": "total", "prefix": "total", "dependencies": [f"clean-{i}" for i in range(n)]},
    ]  # fmt: skip
    events = [
        {"kind": "run", "event": "started", "id": "r", "name": "etl", "time": T0},
        *({"kind": "graph", "run": "r", **g} for g in graph),
        *({"kind": "task", "key": g["key"], "prefix": g["prefix"], "status": "memory", "run": "r",
           "worker": "tcp://w:1",
           "startstops": [{"action": "compute", "start": T0 + 0.1 * i, "stop": T0 + 0.1 * i + 0.05}]}
          for i, g in enumerate(graph)),
        {"kind": "run", "event": "finished", "id": "r", "time": T0 + 5},
    ]  # fmt: skip
    body = example(cluster="c", session="Scheduler-1", agent="scheduler-0123456789ab", seq=0,
                   events=events, final=True)  # fmt: skip
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=h).json["runs"]

    page = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    assert 'id="dag-grouped"' not in page  # within the budget: every task drawn
    monkeypatch.setattr(plots, "DAG_MAX_NODES", len(graph) - 1)
    page = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    note = page.split('id="dag-grouped">')[1].split("</p>")[0]
    assert f"This graph has {len(graph)} tasks" in note, note
    dag = json.loads(page.split("const dag = ", 1)[1].split(";\n", 1)[0])
    found = _sources(dag)
    nodes, edges = found["dag-nodes"], found["dag-edges"]
    tasks = dict(zip(nodes["prefix"], nodes["tasks"], strict=True))
    assert tasks == {"load": n, "clean": n + 3, "total": 1}
    depth = dict(zip(nodes["prefix"], nodes["x"], strict=True))
    assert depth == {"load": 0, "clean": 1, "total": 2}
    pos = {(x, y): p for p, x, y in zip(nodes["prefix"], nodes["x"], nodes["y"], strict=True)}
    drawn = {
        (pos[(x0, y0)], pos[(x1, y1)]): c
        for x0, y0, x1, y1, c in zip(
            edges["x0"], edges["y0"], edges["x1"], edges["y1"], edges["count"], strict=True
        )
    }
    assert drawn == {("load", "clean"): n, ("clean", "total"): n}


def test_a_run_pages_time_plots_come_apart_on_the_streams_range(apps, make_token):
    """The run page carries its task stream alone and where to fetch the plots under it
    (progress, memory, CPU, tasks processing: /runs/<id>/time-plots) once its first view
    is drawn: they are built on the stream's time range, from 0 to past its last stop and
    sample, and the route answers bad input with JSON errors."""
    collector, query = apps
    token = make_token()
    t0 = 1.8e9
    events = [
        {"kind": "run", "event": "started", "id": "plotted", "time": t0},
        *(
            {"kind": "task", "key": f"inc-{i}", "prefix": "inc", "status": "memory",
             "run": "plotted", "worker": "tcp://w:1", "thread": 1,
             "startstops": [{"action": "compute", "start": t0 + i, "stop": t0 + i + 0.5}]}
            for i in range(4)
        ),
        *(
            {"kind": "metric", "worker": "tcp://w:1", "time": t0 + i,
             "values": {"memory.managed": 1e6 * i, "cpu": 50.0}}
            for i in range(6)
        ),
        {"kind": "run", "event": "finished", "id": "plotted", "time": t0 + 4},
    ]  # fmt: skip
    assert post(collector, example(events=events), token=token).status_code == 202
    h = {"Authorization": f"Bearer {token}"}
    (run,) = query.get("/v1/runs", headers=h).json["runs"]
    html = query.get(f"/runs/{run['id']}", headers=h).data.decode()
    first = json.loads(html.split("const timeline = ", 1)[1].split(";\n", 1)[0])
    names = json.dumps(first)
    assert '"task-stream"' in names and '"memory-managed"' not in names
    url = json.loads(html.split("const timePlots = ", 1)[1].split(";\n", 1)[0])
    assert url.startswith(f"/runs/{run['id']}/time-plots?")
    # the stream's range reaches the last sample (5 s in), not only its last stop (3.5 s)
    end = float(url.split("end=", 1)[1].split("&", 1)[0])
    assert 5.0 < end < 5.5
    item = query.get(url, headers=h).json
    plotted = _sources(item)
    assert {"progress", "memory-managed", "cpu"} <= set(plotted)
    assert "run-time-more" in json.dumps(item)
    for bad, why in (("origin=x&end=1", "origin"), (f"origin={t0}", "origin and end"),
                     (f"origin={t0}&end=-1", "end")):  # fmt: skip
        resp = query.get(f"/runs/{run['id']}/time-plots?{bad}", headers=h)
        assert resp.status_code == 400 and why in resp.json["error"]["message"], resp.json
    assert query.get("/runs/nope/time-plots?origin=1&end=1", headers=h).status_code == 404
    assert query.get(url).status_code in (302, 401)  # no token, no plots
