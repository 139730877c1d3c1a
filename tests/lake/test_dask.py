"""The lake with Dask on both ends: runs of a real LocalCluster (worker processes,
recorded by the agent into a real ``hindsight serve``) appear in the lake when they finish,
with the records of the run's tasks route; ``hindsight.Client.lake()`` computed on the
LocalCluster gives the rows of the REST route, read through the service or straight from
the blob store."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import pandas as pd
import pyarrow as pa
import pytest
import requests
from distributed import Client, LocalCluster, get_task_stream, span

import hindsight
from hindsight.client import Client as HindsightClient
from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until


def load(i: int) -> int:
    hindsight.emit("rows-in", 1000 + i)
    time.sleep(0.002 * (i % 5))
    return i


def in_lake(server: EmbeddedServer, run_ids: list[str]) -> None:
    """Wait until the server's finish worker has put the runs in the lake."""

    def present() -> bool:
        got = server.get("/v1/lake/runs", run=run_ids, columns="run")["rows"]
        return len(got) == len(run_ids)

    wait_until(present, 120, f"runs {run_ids} in the lake")


@pytest.fixture(scope="module")
def lake_history(hindsight_server: EmbeddedServer) -> Iterator[dict[str, Any]]:
    cluster = f"lake-{uuid.uuid4().hex[:8]}"
    config = {"hindsight.url": hindsight_server.url, "hindsight.cluster": cluster,
              "hindsight.sample-interval": 0.1}  # fmt: skip
    with dask.config.set(config):
        with LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
            worker_dashboard_address=":0", scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            runs = {}
            with span("lake-array"), get_task_stream(client) as ts:
                x = da.random.random((300, 300), chunks=(50, 50))
                dask.compute((x + x.T).sum(), optimize_graph=False)
            runs["array"] = wait_for_run(hindsight_server, cluster, "lake-array", len(ts.data))
            with span("lake-load"), get_task_stream(client) as ts:
                dask.compute(dask.delayed(sum)([dask.delayed(load)(i) for i in range(40)]))
            runs["load"] = wait_for_run(hindsight_server, cluster, "lake-load", len(ts.data))
            in_lake(hindsight_server, [r["id"] for r in runs.values()])
            yield {"cluster": cluster, "runs": runs, "server": hindsight_server,
                   "hs": HindsightClient(hindsight_server.url), "client": client}  # fmt: skip


def test_finished_runs_are_in_the_lake_with_the_route_records(lake_history):
    server = lake_history["server"]
    for run in lake_history["runs"].values():
        lake = server.get("/v1/lake/tasks", run=run["id"], limit=10000)["rows"]
        route = server.tasks(run["id"])
        fields = ("key", "prefix", "group", "worker", "thread", "status", "nbytes", "typename",
                  "startstops", "exception", "traceback")  # fmt: skip
        got = {r["key"]: {**{f: r[f] for f in fields}, "duration": r["duration"]} for r in lake}
        want = {t["key"]: {**{f: t[f] for f in fields}, "duration": t["duration"]} for t in route}
        assert len(got) == len(lake) == len(route) == run["task_count"]
        assert got == want
        summary = server.get("/v1/lake/runs", run=run["id"])["rows"][0]
        assert (summary["name"], summary["task_count"]) == (run["name"], run["task_count"])
    emitted = server.get(
        "/v1/lake/streams", stream="rows-in", run=lake_history["runs"]["load"]["id"]
    )
    assert sorted(e["value"] for e in emitted["rows"]) == [1000 + i for i in range(40)]


def printed_catalog(server: EmbeddedServer) -> dict[str, str]:
    """What ``hindsight lake catalog --data-dir`` prints for the server, parsed."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hindsight.cli", "lake", "catalog", "--data-dir", str(server.data_dir)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_engines_read_both_runs_through_the_printed_catalog(lake_history):
    """pyiceberg, through the catalog the command prints, scans every task record of both
    runs; DuckDB reading the data files pyiceberg plans counts the same."""
    import urllib.parse

    import duckdb
    from pyiceberg.catalog import load_catalog
    from pyiceberg.expressions import EqualTo

    h = lake_history
    props = printed_catalog(h["server"])
    assert {"name", "namespace", "type", "uri", "warehouse"} <= set(props)
    assert props["type"] == "sql" and props["namespace"] == "hindsight"
    catalog = load_catalog(props.pop("name"), **props)
    tasks = catalog.load_table(f"{props['namespace']}.tasks")
    scan = tasks.scan(row_filter=EqualTo("cluster", h["cluster"]))
    records = scan.to_arrow()
    runs = h["runs"].values()
    assert len(records) == sum(r["task_count"] for r in runs)
    for run in runs:
        keys = records.filter(pa.compute.equal(records["run"], run["id"]))["key"].to_pylist()
        assert sorted(keys) == sorted(t["key"] for t in h["server"].tasks(run["id"]))
    paths = [urllib.parse.urlsplit(t.file.file_path).path for t in scan.plan_files()]
    counted = duckdb.execute(
        "SELECT count(*), count(DISTINCT run), count(DISTINCT key) FROM read_parquet(?) "
        "WHERE cluster = ?",
        [paths, h["cluster"]],
    ).fetchone()
    assert counted == (len(records), 2, len(set(records["key"].to_pylist())))


def rest_rows(h: dict[str, Any], **params: Any) -> pd.DataFrame:
    resp = requests.get(f"{h['server'].url}/v1/lake/tasks",
                        params={"cluster": h["cluster"], "format": "arrow", **params}, timeout=60)  # fmt: skip
    resp.raise_for_status()
    return pa.ipc.open_stream(resp.content).read_all().to_pandas()


def canonical(df: pd.DataFrame, h: dict[str, Any]) -> pd.DataFrame:
    """The rows of ``h``'s two runs by key, values as Python objects (Dask turns strings
    into its own string dtype; the values are what must agree). Only those runs': the
    tests' reads of the lake compute on the cluster too, and their runs reach the lake a
    few seconds later, between one read and the next."""
    keys = {t["key"] for r in h["runs"].values() for t in h["server"].tasks(r["id"])}
    df = df[df["key"].isin(keys)]
    df = df.sort_values("key").reset_index(drop=True).astype(object)
    return df.where(df.notna(), None)


@pytest.mark.parametrize("direct", [False, True])
def test_client_lake_computed_on_the_cluster_is_the_rest_answer(lake_history, direct):
    h, client = lake_history, lake_history["client"]
    ddf = h["hs"].lake("tasks", cluster=h["cluster"], direct=direct)
    plan = h["server"].get("/v1/lake/tasks/files", cluster=h["cluster"])["files"]
    assert ddf.npartitions == len(plan) >= 1
    with get_task_stream(client) as ts:
        got = ddf.compute()
    # the reads ran on the cluster's workers, one task per file
    workers = set(client.scheduler_info()["workers"])
    assert len(ts.data) >= ddf.npartitions and {t["worker"] for t in ts.data} <= workers
    mine = canonical(got, h)
    assert len(mine) == sum(r["task_count"] for r in h["runs"].values())
    pd.testing.assert_frame_equal(mine, canonical(rest_rows(h), h))
    grouped = h["hs"].lake("tasks", cluster=h["cluster"], direct=direct, files_per_partition=2)
    assert grouped.npartitions == (len(plan) + 1) // 2
    pd.testing.assert_frame_equal(canonical(grouped.compute(), h), mine)
    # filters and columns travel with the partitions
    slow = h["hs"].lake("tasks", cluster=h["cluster"], prefix="load", min_duration=0.004,
                        columns=["key", "duration", "cluster"], direct=direct).compute()  # fmt: skip
    want = rest_rows(h, prefix="load", min_duration=0.004, columns="key,duration,cluster")
    assert len(want) > 0 and list(slow.columns) == ["key", "duration", "cluster"]
    pd.testing.assert_frame_equal(canonical(slow, h), canonical(want, h))


def test_lake_rows_sorts_and_limits_on_the_server(lake_history):
    h = lake_history
    ids = [r["id"] for r in h["runs"].values()]  # (see canonical)
    top = h["hs"].lake_rows("tasks", cluster=h["cluster"], run=ids, sort="-duration", limit=5)
    everything = rest_rows(h, run=ids)
    assert list(top["key"]) == list(everything.sort_values("duration", ascending=False)["key"][:5])


def doc_block(name: str) -> str:
    """The Python block of docs/lake.md marked ``<!-- tested: {name} ... -->``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "lake.md").read_text()
    m = re.search(rf"<!-- tested: {re.escape(name)}\b[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, f"no tested block {name!r} in docs/lake.md"
    return m.group(1)


def test_the_docs_analysis_and_recipes_run(lake_history, capsys):
    h = lake_history
    props = printed_catalog(h["server"])
    load_tasks = h["runs"]["load"]["task_count"] - 1  # and one sum
    ns: dict[str, Any] = {"hs": h["hs"]}
    exec(doc_block("dask-analysis"), ns)
    weekly, throughput = ns["weekly"], ns["throughput"]
    assert weekly.loc["load"]["count"].sum() >= load_tasks
    assert list(throughput.index.get_level_values("cluster")).count(h["cluster"]) >= 1
    assert (throughput > 0).all()
    # every run of the cluster so far in the lake: the tests before computed on the
    # cluster too (reading the lake), and those runs are recorded like any other
    server = h["server"]

    def ended() -> list[dict[str, Any]] | None:
        found = server.runs(h["cluster"])
        return found if all(r["status"] == "finished" for r in found) else None

    ran = wait_until(ended, 120, "the cluster's runs ended")
    assert {r["id"] for r in h["runs"].values()} <= {r["id"] for r in ran}
    in_lake(server, [r["id"] for r in ran])
    ns = {"props": dict(props), "tenant": "default"}
    exec(doc_block("pyiceberg"), ns)
    df = ns["df"]
    assert len(df[df["cluster"] == h["cluster"]]) == sum(r["task_count"] for r in ran)
    ns = {"props": dict(props), "tenant": "default"}
    exec(doc_block("duckdb"), ns)
    assert ns["counted"] == len(df)
    ns = {"props": dict(props), "tenant": "default"}
    exec(doc_block("hindsight-lake"), ns)
    assert set(ns["table"]["prefix"].to_pylist()) == {"load"}
    assert len(ns["table"]) >= load_tasks
    assert sorted(ns["ddf"].compute()["number"])[-40:] == [1000.0 + i for i in range(40)]
    capsys.readouterr()
