"""The full stack's lake (Postgres catalog, S3 warehouse on a real S3 endpoint) opened by
other engines through the catalog ``hindsight lake catalog`` prints: pyiceberg scans every
task record of the tenant's finished runs, DuckDB over the data files pyiceberg plans
counts the same, and the printed properties hold no secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from tests.helpers import auth
from tests.lake.conftest import finish_all


@pytest.mark.parametrize("stack", ["full"], indirect=True)
def test_engines_read_the_full_stacks_lake_through_the_printed_catalog(stack, storage, tenant_runs):
    import duckdb
    import pyarrow.dataset as ds
    from pyarrow import fs as pafs
    from pyiceberg.catalog import load_catalog
    from pyiceberg.expressions import EqualTo

    h = tenant_runs
    finish_all(storage.sessions, storage.blobs, h["tenant"])
    # a password in the URL (the test server trusts local connections, so any will do)
    with_password = make_url(stack["database_url"]).set(password="pg-s3cret")
    env = {
        **os.environ,
        "HINDSIGHT_DATABASE_URL": with_password.render_as_string(hide_password=False),
        "HINDSIGHT_BLOB_URL": stack["blob_url"],
        "HINDSIGHT_S3_ENDPOINT_URL": stack["s3_endpoint_url"],
    }
    out = subprocess.run(
        [sys.executable, "-m", "hindsight.cli", "lake", "catalog"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert "pg-s3cret" not in out and os.environ["AWS_SECRET_ACCESS_KEY"] not in out
    props = json.loads(out)
    assert props["uri"].startswith("postgresql+psycopg2://")
    assert props["warehouse"] == stack["blob_url"].rstrip("/") + "/lake/iceberg"
    assert props["s3.endpoint"] == stack["s3_endpoint_url"]
    catalog = load_catalog(props.pop("name"), **props)
    scan = catalog.load_table("hindsight.tasks").scan(row_filter=EqualTo("tenant", h["tenant"]))
    records = scan.to_arrow()
    finished = [r for r in h["runs"].values() if r["status"] != "running"]
    want = []
    for run in finished:
        body = h["query"].get(f"/v1/runs/{run['id']}/tasks?limit=10000", headers=auth(h["token"]))
        want += [(run["id"], t["key"]) for t in body.json["tasks"]]
    got = list(zip(records["run"].to_pylist(), records["key"].to_pylist(), strict=True))
    assert len(want) == 16 and sorted(got) == sorted(want)
    # DuckDB over the data files pyiceberg planned, read from the bucket through pyarrow
    endpoint = make_url(stack["s3_endpoint_url"].replace("http://", "http+x://"))
    s3 = pafs.S3FileSystem(
        endpoint_override=f"{endpoint.host}:{endpoint.port}", scheme="http", region="us-east-1"
    )
    files = [t.file.file_path.removeprefix("s3://") for t in scan.plan_files()]
    dataset = ds.dataset(files, filesystem=s3, format="parquet")
    con = duckdb.connect()
    con.register("tasks", dataset)
    counted = con.execute(
        "SELECT count(*), count(DISTINCT run) FROM tasks WHERE tenant = ?", [h["tenant"]]
    ).fetchone()
    assert counted == (len(want), len(finished))
