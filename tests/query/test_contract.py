"""The contract of every query route on both stacks (SQLite + files, Postgres + S3): the
read scope, tenant isolation, one error body; and the query rollups commute like the rest
of the index (any batch order, retries and rebuilds give the same figures)."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from tests.helpers import auth, example, post
from tests.query.test_runs import run_batch


def run_routes(app: Any) -> list[str]:
    return sorted(
        re.sub(r"<(?:\w+:)?(\w+)>", "{\\1}", r.rule)
        for r in app.url_map.iter_rules()
        if r.rule.startswith("/v1/") and r.rule != "/v1/openapi.json" and "GET" in r.methods
    )


def fill(path: str, run_id: str) -> str:
    path = path.replace("{run_id}", run_id).replace("{cluster}", "example-etl")
    path = path.replace("{table}", "tasks").replace("{day}", "2026-11-18")
    return path.replace("{stream}", "progress")


@pytest.fixture
def apps(stack):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    app = query_app(stack)
    return collector_app(stack).test_client(), app.test_client(), app


def test_every_route_needs_the_read_scope(apps, make_token):
    _, query, app = apps
    ingest_only = make_token(scopes="ingest")
    for path in run_routes(app):
        url = fill(path, "x")
        resp = query.get(url)
        assert resp.status_code == 401 and resp.json["error"]["code"] == "unauthorized", url
        resp = query.get(url, headers=auth(ingest_only))
        assert resp.status_code == 403 and resp.json["error"]["code"] == "forbidden", url


def test_every_route_answers_only_the_callers_tenant(apps, make_token):
    collector, query, app = apps
    alice, bob = make_token(), make_token()
    assert post(collector, example(), token=alice).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(alice)).json["runs"]
    for path in run_routes(app):
        url = fill(path, run["id"])
        if path in ("/v1/compare", "/v1/compare/profile"):
            url += f"?a={run['id']}&b={run['id']}"
        if path == "/v1/profiles":
            url += "?prefix=inc"
        if path == "/v1/history/prefixes":
            url += "?prefix=inc&bucket=day"
        mine = query.get(url, headers=auth(alice))
        if "{name}" in path:  # one lake file: alice has none (its own test: tests/lake)
            assert mine.status_code == 404 and query.get(url, headers=auth(bob)).status_code == 404
            continue
        assert mine.status_code == 200, (url, mine.data[:300])
        theirs = query.get(url, headers=auth(bob))
        if (
            "{run_id}" in path
            or "{cluster}" in path
            or path in ("/v1/compare", "/v1/compare/profile")
        ):
            assert theirs.status_code == 404 and theirs.json["error"]["code"] == "not_found", url
        else:
            body = theirs.json
            assert theirs.status_code == 200
            assert not any(
                body.get(k) for k in ("runs", "clusters", "points", "workers", "rows", "files")
            ), url
    # a cluster nobody recorded is no cluster (it answered zeros)
    assert query.get("/v1/clusters/nope/time", headers=auth(alice)).status_code == 404


def test_compare_needs_both_runs_and_histories_validate(apps, make_token):
    collector, query, _ = apps
    token = make_token()
    for path, code in (("/v1/compare?a=x", 400), ("/v1/history/prefixes", 400),
                       ("/v1/history/clusters?bucket=week", 400), ("/v1/runs?min_duration=-1", 400),
                       ("/v1/runs?has_errors=maybe", 400), ("/v1/runs?sort=name", 400),
                       ("/v1/compare?a=x&b=y", 404)):  # fmt: skip
        resp = query.get(path, headers=auth(token))
        assert resp.status_code == code, path
        assert set(resp.json["error"]) == {"code", "message"}


def test_a_late_batch_refreshes_the_compacted_copy(apps, make_token):
    collector, query, _ = apps
    token = make_token()
    assert post(collector, run_batch("c", "s", "r", 0, n_tasks=5), token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    url = f"/v1/runs/{run['id']}/tasks"
    assert query.get(url, headers=auth(token)).json["total"] == 5  # compacts (run finished)
    late = run_batch("c", "s", "r", 1, n_tasks=4, status=None)
    assert post(collector, late, token=token).status_code == 202
    assert query.get(url, headers=auth(token)).json["total"] == 9


def rollup_snapshot(sessions: Any, tenant: str) -> dict[str, Any]:
    from sqlalchemy import select

    from storage.core import models as m
    from storage.runs import packed

    with sessions() as db:
        tid = db.execute(select(m.Tenant.id).where(m.Tenant.name == tenant)).scalar_one()
        runs = {
            r.id: r.run_key
            for r in db.execute(select(m.Run).where(m.Run.tenant_id == tid)).scalars()
        }
        clusters = dict(
            db.execute(select(m.Cluster.id, m.Cluster.name).where(m.Cluster.tenant_id == tid)).all()
        )
        hist = sorted(
            (runs[r], p, a, b, c)
            for (r, p, a), buckets in packed.hists(db, runs).items()
            for b, c in buckets.items()
        )
        workers = sorted(
            (
                runs[w.run_id],
                w.worker,
                w.tasks,
                w.errors,
                round(w.compute, 9),
                round(w.transfer, 9),
                w.first_start,
                w.last_stop,
            )
            for w in db.execute(select(m.RunWorker).where(m.RunWorker.run_id.in_(runs))).scalars()
        )
        hours = sorted(
            (clusters[h.cluster_id], h.hour, h.tasks, h.errors, round(h.compute, 9), h.nbytes)
            for h in db.execute(
                select(m.ClusterHour).where(m.ClusterHour.cluster_id.in_(clusters))
            ).scalars()
        )
        days = sorted(
            (clusters[d.cluster_id], d.prefix, d.action, d.day, d.count, round(d.total, 9),
             d.max, sorted(d.buckets.items()))
            for d in db.execute(select(m.PrefixDay).where(m.PrefixDay.cluster_id.in_(clusters))).scalars()
        )  # fmt: skip
    return {"hist": hist, "workers": workers, "hours": hours, "days": days}


def test_rollups_do_not_depend_on_order_or_retries(index_url):
    from storage.core.db import make_engine, make_sessionmaker, upgrade
    from tests.conftest import new_tenant
    from tests.storage.ingest.test_index import apply, synthetic_batches

    engine = make_engine(index_url)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    batches = synthetic_batches(seed=3)
    t1, t2 = new_tenant(), new_tenant()
    apply(sessions, t1, batches)
    shuffled = batches[:]
    random.Random(7).shuffle(shuffled)
    apply(sessions, t2, shuffled)
    apply(sessions, t2, shuffled[:4])  # retries
    a, b = rollup_snapshot(sessions, t1), rollup_snapshot(sessions, t2)
    engine.dispose()
    assert a == b
    assert sum(h[4] for h in a["hist"] if h[2] == "compute") == 12 * 25
    assert sum(w[2] for w in a["workers"]) == 12 * 25
    assert sum(h[2] for h in a["hours"]) == 12 * 25
    assert sum(d[4] for d in a["days"] if d[2] == "compute") == 12 * 25


@pytest.mark.parametrize(
    "path",
    ["/v1/runs?name=a%00b", "/v1/runs/%00/tasks", "/v1/history/prefixes?prefix=%00",
     "/v1/runs/x%00/summary", "/v1/compare?a=%00&b=x", "/v1/runs?cursor=%00"],
)  # fmt: skip
def test_nul_bytes_are_a_client_error_not_a_500(apps, make_token, path):
    _, query, _ = apps
    resp = query.get(path, headers=auth(make_token()))
    assert resp.status_code in (400, 404), resp.data
    assert set(resp.json["error"]) == {"code", "message"}


def test_task_records_come_back_as_sent(apps, make_token):
    collector, query, _ = apps
    token = make_token()
    body = run_batch("c", "s", "r", 0, n_tasks=4)
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    got = query.get(f"/v1/runs/{run['id']}/tasks", headers=auth(token)).json["tasks"]
    sent = [e for e in body["events"] if e["kind"] == "task"]
    assert len(got) == len(sent)
    for g, s in zip(got, sent, strict=True):
        assert {k: g[k] for k in s if k != "kind"} == {k: v for k, v in s.items() if k != "kind"}
        assert g["duration"] == pytest.approx(0.5)


def test_the_latest_time_the_schema_accepts_fits_every_rollup(apps, make_token):
    collector, query, _ = apps
    token = make_token()
    body = run_batch("c", "s", "r", 0, n_tasks=2)
    body["events"][1]["startstops"] = [{"action": "compute", "start": 9.9e10, "stop": 9.9e10 + 1}]
    assert post(collector, body, token=token).status_code == 202
    (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
    assert run["task_count"] == 2
    hours = query.get("/v1/history/clusters?bucket=day", headers=auth(token)).json["points"]
    assert sum(p["tasks"] for p in hours) == 2
    days = query.get("/v1/history/prefixes?prefix=inc&bucket=day", headers=auth(token)).json
    assert sum(p["count"] for p in days["points"]) == 2
