"""``/v1/lake/...`` on both stacks: the records of the run routes, every filter, pruning
(files the filters exclude are never opened: they are made unreadable and the answer
stands), tenant isolation, formats, and clear 400s."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from hindsight import lake as layout
from storage.lake import write as lakewrite
from tests.helpers import auth
from tests.lake.conftest import DAY, finish_all, lake_location
from tests.lake.test_writer import as_task_record, by_key, route_records, synthetic
from tests.query.test_runs import T0


@pytest.fixture
def lake_app(stack, storage, tenant_runs):
    finish_all(storage.sessions, storage.blobs, tenant_runs["tenant"])
    return tenant_runs


def get(h: dict[str, Any], path: str, **params: Any) -> Any:
    resp = h["query"].get(path, query_string=params, headers=auth(h["token"]))
    assert resp.status_code == 200, resp.json
    return resp


def rows(h: dict[str, Any], table: str = "tasks", **params: Any) -> list[dict[str, Any]]:
    return get(h, f"/v1/lake/{table}", limit=10000, **params).json["rows"]


def key_of(planned: dict[str, Any]) -> str:
    """The blob key of a planned file (its location without the store's root)."""
    return "lake/" + planned["location"].split("/lake/", 1)[1]


def spoil(storage: Any, keys: list[str]) -> None:
    """Make files unreadable: a scan that opened one would fail."""
    for key in keys:
        storage.blobs.put(key, b"not parquet")


def test_lake_tasks_are_the_run_routes_records(lake_app):
    h = lake_app
    for name in ("r0", "r1", "r2", "r3"):
        run_id = h["runs"][name]["id"]
        got = rows(h, run=run_id)
        expected = route_records(h["query"], h["token"], run_id)
        records = [as_task_record({**r, "startstops": json.dumps(r["startstops"])}) for r in got]
        assert by_key(records) == by_key(expected)
        # attrs as the run routes give them: an object, not its JSON text
        attrs = {t["key"]: t["attrs"] for t in h["query"].get(f"/v1/runs/{run_id}/tasks",
                 headers=auth(h["token"])).json["tasks"]}  # fmt: skip
        assert {r["key"]: r["attrs"] for r in got} == attrs and {"retried": 1} in attrs.values()
        assert {(r["cluster"], r["run"]) for r in got} == {(h["runs"][name]["cluster"], run_id)}


def test_filters_columns_sort_and_limit(lake_app):
    h = lake_app
    everything = rows(h)
    assert len(everything) == 16  # four finished runs of four tasks
    runs = h["runs"]

    def keys(rs: list[dict[str, Any]]) -> list[str]:
        return sorted(r["key"] for r in rs)

    assert keys(rows(h, cluster="dev")) == keys([r for r in everything if r["cluster"] == "dev"])
    assert keys(rows(h, status="erred")) == ["inc-r1-0-0"]
    assert keys(rows(h, prefix="inc", worker="tcp://w:1")) == keys(everything)
    assert rows(h, prefix="nope") == []
    # the window keeps tasks overlapping it: r2 and r3 ran on day 1
    day1 = rows(h, since=T0 + DAY, until=T0 + 2 * DAY)
    assert {r["run"] for r in day1} == {runs["r2"]["id"], runs["r3"]["id"]}
    assert keys(rows(h, since=T0 + 2.2)) == keys([r for r in everything if r["stop"] >= T0 + 2.2])
    assert keys(rows(h, min_duration=0.5, max_duration=0.5)) == keys(everything)
    assert rows(h, min_duration=0.51) == []
    assert keys(rows(h, min_nbytes=28, max_nbytes=28)) == keys(everything)
    two = get(h, "/v1/lake/tasks", columns="key,cluster,duration", sort="-start", limit=2).json
    assert [list(r) for r in two["rows"]] == [["key", "cluster", "duration"]] * 2
    latest = sorted(everything, key=lambda r: -r["start"])[:2]
    assert [r["key"] for r in two["rows"]] == [r["key"] for r in latest]
    assert two["truncated"] is True and two["count"] == 2
    # several values of one filter: any of them
    both = rows(h, run=[runs["r0"]["id"], runs["r3"]["id"]])
    assert {r["run"] for r in both} == {runs["r0"]["id"], runs["r3"]["id"]}
    # the other tables
    assert {r["run"] for r in rows(h, "runs", status="erred")} == {runs["r1"]["id"]}
    assert {r["name"] for r in rows(h, "metrics")} == {"cpu"}
    emitted = rows(h, "streams", stream="rows-in", cluster="prod")
    assert sorted(e["value"] for e in emitted) == [1000, 1100, 2000]


@pytest.mark.parametrize("stack", ["full"], indirect=True)
def test_filters_prune_files_and_never_open_the_others(stack, storage, lake_app):
    h = lake_app
    all_files = get(h, "/v1/lake/tasks/files").json["files"]
    assert len(all_files) == 3  # prod day 0, prod day 1, dev day 1
    dev = get(h, "/v1/lake/tasks", cluster="dev").json["scan"]
    assert (dev["partitions"], dev["files"], dev["files_opened"]) == (1, 1, 1)
    day0 = get(h, "/v1/lake/tasks", until=T0 + 0.5 * DAY).json["scan"]
    assert day0["files_opened"] == 1
    erred = get(h, "/v1/lake/tasks", status="erred").json["scan"]
    assert erred["files_opened"] == 1  # only one file holds an erred task
    assert get(h, "/v1/lake/tasks", prefix="nope").json["scan"]["files"] == 0
    # a planned file read straight from S3, as Client.lake(direct=True) has a worker do
    part = layout.LocationPart(
        "tasks", layout.Filters(), ["key", "cluster"], endpoint_url=stack["s3_endpoint_url"]
    )
    dev_file = next(f for f in all_files if f["cluster"] == "dev")
    assert dev_file["location"].startswith("s3://")
    assert sorted(part(dev_file)["key"]) == sorted(r["key"] for r in rows(h, cluster="dev"))
    # spoil every file but dev's: the dev answer stands, a full scan breaks
    spoil(storage, [key_of(f) for f in all_files if f["cluster"] != "dev"])
    assert len(rows(h, cluster="dev")) == 4
    resp = h["query"].get("/v1/lake/tasks", headers=auth(h["token"]))
    assert resp.status_code == 500 and resp.json["error"]["code"] == "internal_error"


@pytest.mark.parametrize("stack", ["full"], indirect=True)
def test_another_tenants_partitions_are_never_read(stack, storage, make_token, lake_app):
    """Tenant B has the same cluster names and days; A's answers and plans never include
    B's files, B's files are spoiled and A's answers stand, and A cannot name B's files."""
    from tests.conftest import new_tenant

    h = lake_app
    b_tenant = new_tenant()
    make_token(b_tenant)
    a_before = rows(h)
    # B's lake: the same cluster and day as A's busiest partition
    part = lakewrite.Partition(b_tenant, "prod", layout.day_of(T0))
    loc = lake_location(storage)
    lakewrite.commit_runs(loc, part, [synthetic("b-run", 50, T0)])
    tasks_dir = loc.key(lakewrite.table(loc, "tasks").location())
    b_keys = list(storage.blobs.list(f"{tasks_dir}/data/tenant={b_tenant}/"))
    assert b_keys
    spoil(storage, b_keys)
    assert rows(h) == a_before
    plan = get(h, "/v1/lake/tasks/files").json["files"]
    assert all(f"tenant={h['tenant']}/" in f["location"] for f in plan)
    # a file name of B asked for under A's token: looked up in A's tenant, not found
    name = b_keys[0].rsplit("/", 1)[1]
    resp = h["query"].get(
        f"/v1/lake/tasks/files/prod/{layout.day_of(T0)}/{name}", headers=auth(h["token"])
    )
    assert resp.status_code == 404 and resp.json["error"]["code"] == "not_found"


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_arrow_and_parquet_answers_hold_the_json_rows(lake_app):
    import pyarrow as pa
    import pyarrow.parquet as pq

    h = lake_app
    expected = sorted(r["key"] for r in rows(h))
    arrow = get(h, "/v1/lake/tasks", format="arrow")
    assert arrow.mimetype == "application/vnd.apache.arrow.stream"
    t = pa.ipc.open_stream(arrow.data).read_all()
    assert sorted(t["key"].to_pylist()) == expected
    assert "cluster" in t.column_names and "tenant" not in t.column_names
    parquet = get(h, "/v1/lake/tasks", format="parquet", columns="key,duration")
    t = pq.read_table(io.BytesIO(parquet.data))
    assert t.column_names == ["key", "duration"] and sorted(t["key"].to_pylist()) == expected
    top = pa.ipc.open_stream(get(h, "/v1/lake/tasks", format="arrow", sort="-start", limit=3).data)
    assert len(top.read_all()) == 3
    # one planned file, as a Dask partition reads it
    f = get(h, "/v1/lake/tasks/files", cluster="dev").json["files"][0]
    part = pa.ipc.open_stream(get(h, f["path"], columns="key,day").data).read_all()
    assert part.column_names == ["key", "day"] and len(part) == 4


BAD = [
    ("/v1/lake/tasks", {"columns": "key,nope"}, "columns"),
    ("/v1/lake/tasks", {"sort": "-nope"}, "sort"),
    ("/v1/lake/tasks", {"sort": "prefixes"}, "sort"),
    ("/v1/lake/runs", {"sort": "prefixes"}, "sort"),
    ("/v1/lake/metrics", {"status": "erred"}, "status"),
    ("/v1/lake/tasks", {"stream": "x"}, "stream"),
    ("/v1/lake/tasks", {"min_duration": "slow"}, "min_duration"),
    ("/v1/lake/tasks", {"min_duration": "nan"}, "min_duration"),
    ("/v1/lake/tasks", {"cluster": "../etc"}, "cluster"),
    ("/v1/lake/tasks", {"run": "not-a-run"}, "run"),
    ("/v1/lake/tasks", {"since": "yesterday"}, "since"),
    ("/v1/lake/tasks", {"limit": "0"}, "limit"),
    ("/v1/lake/tasks", {"limit": "10001"}, "limit"),
    ("/v1/lake/tasks", {"format": "xml"}, "format"),
    ("/v1/lake/tasks/files", {"columns": "key,key"}, "columns"),
    # a typo'd filter answered every row
    ("/v1/lake/tasks", {"prefx": "inc"}, "prefx"),
    ("/v1/lake/tasks/files", {"clustr": "prod"}, "clustr"),
    ("/v1/lake/tasks", {"sort": "--duration"}, "sort"),
    ("/v1/lake/tasks", {"key": "k" * 4097}, "key"),
    (
        "/v1/lake/tasks/files/prod/2026-11-18/part-0000000001-0123456789abcdef.parquet",
        {"name": "x"},
        "name",
    ),
]


@pytest.fixture
def empty_lake(stack, make_token):
    from services.query.app import create_app as query_app

    return {"query": query_app(stack).test_client(), "token": make_token()}


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_bad_parameters_are_clear_400s_and_unknown_tables_404s(empty_lake):
    h = empty_lake
    for path, params, name in BAD:
        resp = h["query"].get(path, query_string=params, headers=auth(h["token"]))
        assert resp.status_code == 400, (path, params, resp.json)
        assert resp.json["error"]["code"] == "invalid_parameter"
        assert resp.json["error"]["message"].startswith(f"{name}:"), resp.json
    # a key as long as a batch may carry is a filter (it was refused over 1,024 characters)
    resp = h["query"].get(
        "/v1/lake/tasks", query_string={"key": "k" * 4096}, headers=auth(h["token"])
    )
    assert resp.status_code == 200 and resp.json["rows"] == [], resp.json
    for path in (
        "/v1/lake/graph",
        "/v1/lake/graph/files",
        "/v1/lake/tasks/files/prod/2026-13-40/part-0000000001-0123456789abcdef.parquet",
        "/v1/lake/tasks/files/prod/2026-11-18/..%2F..%2Fx.parquet",
        "/v1/lake/tasks/files/prod/2026-11-18/part-0000000001-0123456789abcdef.parquet",
    ):
        resp = h["query"].get(path, headers=auth(h["token"]))
        assert resp.status_code == 404 and resp.json["error"]["code"] == "not_found", path


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_top_k_reads_only_the_files_that_can_hold_the_answer(stack, storage, make_token, lake_app):
    """30 days of one cluster, each day's tasks slower than the last: the 10 slowest tasks
    come from the newest file(s) alone."""
    import pyarrow as pa

    from tests.conftest import new_tenant

    tenant = new_tenant()
    token = make_token(tenant)
    for d in range(30):
        part = lakewrite.Partition(tenant, "daily", layout.day_of(T0 + d * DAY))
        run = synthetic(f"day-{d}", 40, T0 + d * DAY, prefix="load")
        tasks = run.tables["tasks"]
        slower = pa.array([d + i / 100 for i in range(40)], pa.float64())
        run.tables["tasks"] = tasks.set_column(
            tasks.schema.get_field_index("duration"), "duration", slower
        )
        lakewrite.commit_runs(lake_location(storage), part, [run])
    h = {**lake_app, "token": token}
    body = get(h, "/v1/lake/tasks", prefix="load", sort="-duration", limit=10).json
    assert [r["duration"] for r in body["rows"]] == [29 + i / 100 for i in range(39, 29, -1)]
    assert body["scan"]["files"] == 30 and body["scan"]["files_opened"] <= 8
    asc = get(h, "/v1/lake/tasks", prefix="load", sort="duration", limit=3).json
    assert [r["duration"] for r in asc["rows"]] == [0.0, 0.01, 0.02]
