"""Every route of every service, read from the OpenAPI documents the services serve (so a
route added later is covered without touching this file): authentication required,
scopes enforced, tenants isolated on read and write, parameters capped and validated."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from collector.app import create_app as create_collector
from services.embedded import create_app as create_embedded
from services.query.app import create_app as create_query
from tests.helpers import auth, post
from tests.query.test_runs import run_batch

FACTORIES = {"collector": create_collector, "query": create_query, "embedded": create_embedded}
METHODS = ("get", "post", "put", "patch", "delete")


def operations(client: Any) -> list[tuple[str, str, dict[str, Any]]]:
    doc = client.get("/v1/openapi.json").json
    out = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                secured = op.get("security", doc.get("security")) != []
                out.append((method, path, {**op, "secured": secured}))
    return out


def scope_of(method: str) -> str:
    """Writes need ``ingest``, reads ``read`` (a route needing another scope must say so)."""
    return "read" if method == "get" else "ingest"


@pytest.fixture
def two_tenants(stack, make_token) -> dict[str, Any]:
    """Tenant A with a run in a uniquely named cluster; tenant B with its own run."""
    secret = f"secret-{uuid.uuid4().hex[:10]}"
    a = make_token(scopes="ingest,read")
    b = make_token(scopes="ingest,read")
    collector = create_collector(stack).test_client()
    batch_a = run_batch(secret, "sess-a", f"run-{secret}", 0, n_tasks=5)
    assert post(collector, batch_a, token=a).status_code == 202
    assert post(collector, run_batch("other", "sess-b", "rb", 0), token=b).status_code == 202
    query = create_query(stack).test_client()
    runs = query.get("/v1/runs", headers=auth(a)).json["runs"]
    assert len(runs) == 1
    return {"a": a, "b": b, "secret": secret, "run_a": runs[0]["id"], "batch_a": batch_a}


def fill(path: str, values: dict[str, str], default: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), default), path)


@pytest.mark.parametrize("service", list(FACTORIES))
def test_every_secured_route_needs_a_token_and_its_scope(stack, make_token, service):
    client = FACTORIES[service](stack).test_client()
    ingest_only, read_only = make_token(scopes="ingest"), make_token(scopes="read")
    ops = operations(client)
    assert any(op["secured"] for _, _, op in ops)
    for method, path, op in ops:
        url = fill(path, {}, str(uuid.uuid4()))
        call = getattr(client, method)
        if not op["secured"]:
            assert call(url).status_code < 500
            continue
        for headers in ({}, auth("hs_not-a-token"), {"Authorization": "Basic eDp5"}):
            resp = call(url, headers=headers)
            assert resp.status_code == 401, (method, path, headers)
            assert resp.json["error"]["code"] == "unauthorized"
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        wrong = read_only if scope_of(method) == "ingest" else ingest_only
        resp = call(url, headers=auth(wrong))
        assert resp.status_code == 403, (method, path)
        assert resp.json["error"]["code"] == "forbidden"


@pytest.mark.parametrize("service", ["query", "embedded"])
def test_no_read_route_shows_another_tenants_data(stack, two_tenants, service):
    w = two_tenants
    client = FACTORIES[service](stack).test_client()
    # B asks for A's things by A's own identifiers, on every route, with every parameter.
    values = {"run_id": w["run_a"], "cluster": w["secret"], "session": "sess-a"}
    checked = 0
    for method, path, op in operations(client):
        if method != "get" or not op["secured"]:
            continue
        # Known names get A's value; any other required parameter gets A's run id (the
        # identifier most routes take), so the route is exercised rather than refused.
        query = {
            p["name"]: values.get(p["name"], w["run_a"])
            for p in op.get("parameters", [])
            if p["in"] == "query" and (p["name"] in values or p.get("required"))
        }
        url = fill(path, values, w["run_a"])
        resp = client.get(url, query_string=query, headers=auth(w["b"]))
        assert resp.status_code < 500, (path, resp.json)
        # B's answer about A's identifiers is exactly its answer about identifiers nobody
        # has (an answer may echo what was asked, nothing more): A's data does not exist for B.
        ghost = {"run_id": str(uuid.uuid4()), "cluster": f"ghost-{uuid.uuid4().hex[:10]}"}
        swap = {w["run_a"]: ghost["run_id"], w["secret"]: ghost["cluster"]}
        g_query = {k: swap.get(v, v) for k, v in query.items()}
        g_url = fill(path, {**values, **ghost}, ghost["run_id"])
        g_resp = client.get(g_url, query_string=g_query, headers=auth(w["b"]))
        assert g_resp.status_code == resp.status_code, path
        g_text = g_resp.get_data(as_text=True)
        for real, fake in swap.items():
            g_text = g_text.replace(fake, real)
        assert resp.get_data(as_text=True) == g_text, path
        # ... while A sees its own through the same route.
        mine = client.get(url, query_string=query, headers=auth(w["a"]))
        assert mine.status_code < 500, (path, mine.json)
        checked += mine.status_code == 200
    assert checked >= 3


def test_writes_are_scoped_by_the_tokens_tenant(stack, two_tenants):
    """B sending A's exact batch identity stores B's own copy: never a duplicate of A's,
    never visible to A; the body cannot name a tenant."""
    w = two_tenants
    collector = create_collector(stack).test_client()
    forged = {**w["batch_a"], "tenant": "someone-else"}
    resp = post(collector, forged, token=w["b"])
    assert resp.status_code == 202 and resp.json["duplicate"] is False
    query = create_query(stack).test_client()
    runs_a = query.get("/v1/runs", headers=auth(w["a"])).json["runs"]
    runs_b = query.get("/v1/runs", headers=auth(w["b"])).json["runs"]
    assert [r["id"] for r in runs_a] == [w["run_a"]]
    assert w["run_a"] not in [r["id"] for r in runs_b]  # same names, different tenant id
    assert len(runs_b) == 2


@pytest.mark.parametrize("service", list(FACTORIES))
def test_every_query_parameter_is_capped_and_injection_is_inert(stack, two_tenants, service):
    client = FACTORIES[service](stack).test_client()
    token, real = two_tenants["a"], {"run_id": two_tenants["run_a"]}
    hostile = [
        "x" * 10_000,
        "../../etc/passwd",
        "..",
        "' OR '1'='1",
        "1; DROP TABLE runs; --",
        "%00",
        "\u0000",
    ]
    for method, path, op in operations(client):
        if method != "get" or not op["secured"]:
            continue
        params = [p for p in op.get("parameters", []) if p["in"] in ("query", "path")]
        for p in params:
            for value in hostile:
                if p["in"] == "path":
                    url, query = fill(path, {p["name"]: value.replace("/", "%2F")}, "x"), {}
                else:  # on a real run, so the parameter is read rather than a 404 first
                    url, query = fill(path, real, two_tenants["run_a"]), {p["name"]: value}
                resp = client.get(url, query_string=query, headers=auth(token))
                assert resp.status_code in (200, 400, 404), (
                    path,
                    p["name"],
                    value[:20],
                    resp.status_code,
                )
                if resp.status_code >= 400:
                    assert set(resp.json["error"]) == {"code", "message"}
                if len(value) > 1000 and p["in"] == "query":
                    assert resp.status_code == 400, (path, p["name"])
    # The tables the injections named are still there and answer.
    assert client.get("/v1/openapi.json").status_code == 200
    if service != "collector":
        assert client.get("/v1/runs", headers=auth(token)).status_code == 200
