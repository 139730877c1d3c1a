"""The full stack where users run it: the project's unchanged docker-compose.yml brought up
with the README's own commands, a real LocalCluster on the host recording through the compose
collector, the lake read by pyiceberg and DuckDB through the catalog the stack prints, the
dashboard in Chromium, kill -9 of the collector and Postgres under a live run,
two collector replicas, and ``down -v`` leaving nothing behind.

The tests share one stack and run in file order (each builds on what the previous recorded).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
import requests
from distributed import Client, LocalCluster

from tests.compose.conftest import (
    ARTIFACTS,
    FIGURES,
    LONG_RUNNING,
    ONE_SHOT,
    ROOT,
    Stack,
    load_average,
)
from tests.dask.conftest import (
    Api,
    free_port,
    recorded_view,
    stream_view,
    wait_for_run,
    wait_until,
)
from tests.dask.test_faults import run_map

pytestmark = pytest.mark.compose

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
#: kill -9 during the live run, in this order: three of each.
CHAOS = ("collector", "postgres") * 3
CHAOS_RUN_TASKS = 600


def bash_block(path: Path, heading: str) -> list[str]:
    """The command lines of the ```bash blocks under ``heading`` (comments dropped)."""
    text = path.read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, f"no bash block under {heading!r} in {path.name}"
    lines = [
        re.split(r"\s#\s", line, maxsplit=1)[0].strip() for b in blocks for line in b.splitlines()
    ]
    return [line for line in lines if line]


def readme_compose_commands() -> list[list[str]]:
    """The README's full-stack commands, each `docker compose ...` split into its words."""
    commands = [shlex.split(line) for line in bash_block(ROOT / "README.md",
                                                          "## The full stack: docker compose")]  # fmt: skip
    assert commands and all(c[:2] == ["docker", "compose"] for c in commands), commands
    return commands


def dask_config(stack: Stack, cluster: str, spool: Path, **more: Any) -> dict[str, Any]:
    return {
        "hindsight.url": stack.collector_url,
        "hindsight.token": stack.token,
        "hindsight.cluster": cluster,
        "hindsight.spool-dir": str(spool),
        **more,
    }


CLUSTER_KW: dict[str, Any] = dict(
    threads_per_worker=1,
    processes=True,
    dashboard_address=":0",
    worker_dashboard_address=":0",
    scheduler_kwargs={"preload": ["hindsight.dask"]},
)


def assert_recorded(api: Api, cluster: str, streams: dict[str, list[Any]], timeout: float) -> None:
    """Every run equals Dask's own task stream, and the session's batches all arrived."""
    detail = None
    for name, stream in streams.items():
        run = wait_for_run(api, cluster, name, len(stream), timeout=timeout)
        assert recorded_view(api.tasks(run["id"])) == stream_view(stream), name
        detail = api.get(f"/v1/runs/{run['id']}")
    assert detail is not None
    completeness = detail["completeness"]
    assert completeness["ratio"] == 1.0 and completeness["closed"], completeness
    assert completeness["events_dropped_at_agents"] == 0, completeness


@pytest.fixture(scope="module")
def stack(images: dict[str, str]) -> Iterator[Stack]:
    s = Stack(images)
    s.compose("down", "-v", "--remove-orphans", check=False)  # what a failed run left
    up, token = readme_compose_commands()
    assert up[2:] == ["up", "-d", "--build"] and token[2:5] == ["run", "--rm", "collector"]
    try:
        start = time.monotonic()
        s.run([*s.prefix, *up[2:]])
        FIGURES["readme_up_s"] = round(time.monotonic() - start, 1)
        s.wait_healthy(*LONG_RUNNING)
        FIGURES["time_to_healthy_s"] = round(time.monotonic() - start, 1)
        FIGURES["healthy_after_up_returned_s"] = round(
            FIGURES["time_to_healthy_s"] - FIGURES["readme_up_s"], 1
        )
        start = time.monotonic()
        s.token = s.run([*s.prefix, *token[2:]]).stdout.strip().splitlines()[-1]
        FIGURES["token_run_rm_s"] = round(time.monotonic() - start, 1)
        s.collector_url = f"http://127.0.0.1:{s.port('collector', 8700)}"
        s.query_url = f"http://127.0.0.1:{s.port('query', 8701)}"
        s.api = Api(s.query_url, s.token)
        s.recorded = {}
        yield s
    finally:
        if not s.logs_saved:  # a test failed before the last one took them
            s.save_logs()
        s.compose("down", "-v", "--remove-orphans", check=False)


def test_every_service_healthy_migrations_applied_once_and_a_token(stack):
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(str(ROOT / "migrations")).get_current_head()
    assert stack.healthy(*LONG_RUNNING)
    for service in ONE_SHOT:
        states = [stack.inspect(c)["State"] for c in stack.containers(service)]
        assert [(st["Status"], st["ExitCode"]) for st in states] == [("exited", 0)], service
    assert re.fullmatch(r"hs_[A-Za-z0-9_-]{40,}", stack.token), stack.token
    # The one-shot job migrated the index; the services did not (HINDSIGHT_AUTO_UPGRADE=false),
    # and the database is at the head revision, recorded once.
    assert f"index at revision {head}" in stack.compose("logs", "--no-color", "migrate").stdout
    for service in ("collector", "query"):
        assert "Running upgrade" not in stack.compose("logs", "--no-color", service).stdout
    versions = stack.compose(
        "exec", "-T", "postgres", "psql", "-U", "hindsight", "-d", "hindsight", "-Atc",
        "SELECT version_num FROM alembic_version",
    ).stdout.split()  # fmt: skip
    assert versions == [head]
    for base in (stack.collector_url, stack.query_url):
        assert requests.get(f"{base}/readyz", timeout=10).json()["status"] == "ready"


def test_a_local_cluster_records_through_the_compose_collector(stack, tmp_path):
    import dask.array as da
    from distributed import get_task_stream, span

    cluster = f"compose-{uuid.uuid4().hex[:8]}"
    streams = {}
    with dask.config.set(dask_config(stack, cluster, tmp_path / "spool")):
        with LocalCluster(n_workers=2, **CLUSTER_KW) as lc, Client(lc) as client:
            streams["map"] = run_map(client, "map", 400)
            with span("array-sum"), get_task_stream(client) as ts:
                assert da.ones((3000,), chunks=20).sum().compute() == 3000
            streams["array-sum"] = ts.data
        start = time.monotonic()
    assert_recorded(stack.api, cluster, streams, timeout=120)
    FIGURES["dask_runs_complete_after_close_s"] = round(time.monotonic() - start, 1)
    stack.recorded.update(cluster=cluster, streams=streams)


#: Run inside the query container, where the compose network's names (postgres, minio) and
#: the S3 credentials are: open the catalog ``hindsight lake catalog`` prints, scan the
#: cluster's task records, and copy out the data files the scan planned.
LAKE_SCAN = """
import json, os, subprocess, sys
from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo
props = json.loads(subprocess.run(["hindsight", "lake", "catalog"], check=True,
                                  capture_output=True, text=True).stdout)
printed = dict(props)
table = load_catalog(props.pop("name"), **props).load_table(props["namespace"] + ".tasks")
scan = table.scan(row_filter=EqualTo("cluster", sys.argv[1]))
records = scan.to_arrow()
os.makedirs(sys.argv[2], exist_ok=True)
files = [t.file.file_path for t in scan.plan_files()]
for i, path in enumerate(files):
    with table.io.new_input(path).open() as src, open(f"{sys.argv[2]}/{i}.parquet", "wb") as dst:
        dst.write(src.read())
rows = sorted(zip(records["run"].to_pylist(), records["key"].to_pylist()))
print(json.dumps({"props": printed, "rows": rows, "files": files}))
"""


def test_engines_read_the_stacks_lake_through_the_printed_catalog(stack, tmp_path):
    """The Postgres catalog and S3 warehouse of the compose stack: pyiceberg, through the
    catalog ``hindsight lake catalog`` prints, scans every task record of both runs, and
    DuckDB reading the data files pyiceberg planned counts the same."""
    import duckdb

    cluster = stack.recorded["cluster"]
    runs = {name: stack.api.run_named(cluster, name) for name in ("map", "array-sum")}
    want = sorted(
        [run["id"], t["key"]] for run in runs.values() for t in stack.api.tasks(run["id"])
    )
    assert len(want) == sum(r["task_count"] for r in runs.values()) > 0
    container = stack.containers("query")[0]
    inside = f"/tmp/lake-{uuid.uuid4().hex[:8]}"
    seen: dict[str, Any] = {}

    # The printed catalog never holds the password: libpq takes it from PGPASSWORD (docs/lake.md).
    password = stack.env().get("POSTGRES_PASSWORD", "hindsight-dev-only")

    def scanned_whole() -> bool:
        out = stack.compose("exec", "-T", "-e", f"PGPASSWORD={password}", "query",
                            "python", "-c", LAKE_SCAN, cluster, inside)  # fmt: skip
        seen.update(json.loads(out.stdout.strip().splitlines()[-1]))
        return seen["rows"] == want

    start = time.monotonic()
    wait_until(scanned_whole, 120, "both runs' task records in the lake")
    FIGURES["lake_scan_whole_after_s"] = round(time.monotonic() - start, 1)
    props = seen["props"]
    assert props["type"] == "sql" and props["namespace"] == "hindsight"
    assert props["uri"].startswith("postgresql+psycopg2://") and "@postgres:5432/" in props["uri"]
    assert props["warehouse"].startswith("s3://") and props["warehouse"].endswith("/lake/iceberg")
    printed = json.dumps(props)
    for secret in ("hindsight-dev-only", "aws_secret_access_key", "s3.secret-access-key"):
        assert secret not in printed, secret
    stack.run(["docker", "cp", f"{container}:{inside}", str(tmp_path / "files")])
    paths = sorted(str(p) for p in (tmp_path / "files").glob("*.parquet"))
    assert len(paths) == len(seen["files"]) >= 1
    counted = duckdb.execute(
        "SELECT count(*), count(DISTINCT run), count(DISTINCT key) FROM read_parquet(?) "
        "WHERE cluster = ?",
        [paths, cluster],
    ).fetchone()
    assert counted == (len(want), 2, len({key for _, key in want}))


def test_the_docs_commands_work_against_the_stack(stack):
    """docs/deploy.md's curl commands, as written but for the host and the published ports."""
    cluster = stack.recorded["cluster"]
    run_id = stack.api.run_named(cluster, "map")["id"]
    collector_port = stack.collector_url.rsplit(":", 1)[1]
    query_port = stack.query_url.rsplit(":", 1)[1]
    deploy = ROOT / "docs" / "deploy.md"
    lines = bash_block(deploy, "## Bring it up") + bash_block(deploy, "## Query runs")
    ran = 0
    for line in lines:
        if line.startswith("docker compose "):
            words = shlex.split(line)
            if words[2:] == ["ps"]:
                assert "Up (healthy)" in stack.compose("ps").stdout
            continue
        if not line.startswith("curl "):
            continue  # cp .env.example .env, export TOKEN=...: the test sets both itself
        line = (
            line.replace("localhost:8700", f"127.0.0.1:{collector_port}")
            .replace("localhost:8701", f"127.0.0.1:{query_port}")
            .replace("HOST:8700", f"127.0.0.1:{collector_port}")
            .replace("HOST:8701", f"127.0.0.1:{query_port}")
            .replace("RUN_ID", run_id)
            .replace("prod-etl", cluster)
        )
        out = subprocess.run(
            ["bash", "-c", line], env={**stack.env(), "TOKEN": stack.token},
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert out.startswith("{") and '"error"' not in out, (line, out[:300])
        ran += 1
    assert ran >= 6


def test_the_query_containers_dashboard_renders_the_runs(stack):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: make test-compose installs it")
    from playwright.sync_api import sync_playwright

    cluster = stack.recorded["cluster"]
    run = stack.api.run_named(cluster, "array-sum")
    tasks = stack.api.tasks(run["id"])
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{stack.query_url}/?cluster={cluster}")
            page.fill("input[name=token]", stack.token)  # the dashboard's own sign-in
            page.get_by_role("button", name="sign in").click()
            assert page.locator("tr.run-row").count() == len(stack.api.runs(cluster)) == 2
            page.get_by_role("link", name="array-sum").click()
            page.wait_for_selector("body[data-rendered='1']", timeout=60_000)
            glyphs = page.evaluate(
                """() => { for (const doc of Bokeh.documents) for (const m of doc.all_models)
                    if (m.name === 'task-stream-source') return m.data.x.length; }"""
            )
            assert glyphs == sum(len(t["startstops"]) for t in tasks)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []


def _restarted(stack: Stack, service: str, before: int) -> bool:
    if stack.restarts(service) <= before:
        return False
    return stack.state(service).get("Health", {}).get("Status") == "healthy"


def test_kill9_of_the_collector_and_postgres_during_a_live_run(stack, tmp_path):
    cluster = f"chaos-{uuid.uuid4().hex[:8]}"
    recoveries: list[tuple[str, float]] = []
    failures: list[BaseException] = []
    done = threading.Event()
    moto_restarts = stack.restarts("minio")

    def chaos() -> None:
        try:
            for service in CHAOS:
                before = stack.restarts(service)
                start = time.monotonic()
                stack.kill9(service)
                wait_until(lambda s=service, b=before: _restarted(stack, s, b), 180,
                           f"{service} back and healthy")  # fmt: skip
                recoveries.append((service, round(time.monotonic() - start, 1)))
        except BaseException as exc:
            failures.append(exc)
        finally:
            done.set()

    streams: dict[str, list[Any]] = {}
    config = dask_config(stack, cluster, tmp_path / "spool", **{"close-timeout": 180})
    with dask.config.set(config):
        with LocalCluster(n_workers=2, **CLUSTER_KW) as lc, Client(lc) as client:
            agent = lc.scheduler.plugins["hindsight"].agent  # in this process: its counters
            thread = threading.Thread(target=chaos, name="chaos", daemon=True)
            start = time.monotonic()
            thread.start()
            while not done.is_set():
                name = f"chaos-{len(streams)}"
                streams[name] = run_map(client, name, CHAOS_RUN_TASKS)
            thread.join()
            chaos_s = time.monotonic() - start
            chaos_load = load_average()
            streams["after"] = run_map(client, "after", CHAOS_RUN_TASKS)
        closed = time.monotonic()
    assert not failures, failures
    last = wait_for_run(stack.api, cluster, "after", CHAOS_RUN_TASKS, timeout=300)
    wait_until(
        lambda: stack.api.get(f"/v1/runs/{last['id']}")["completeness"]["ratio"] == 1.0,
        300, "every batch of the session",
    )  # fmt: skip
    delivered = time.monotonic() - closed
    assert_recorded(stack.api, cluster, streams, timeout=300)
    assert stack.restarts("minio") == moto_restarts  # the S3 store never restarted
    by = {s: [r for name, r in recoveries if name == s] for s in ("collector", "postgres")}
    FIGURES.update(
        chaos_kills=f"{len(by['collector'])} collector + {len(by['postgres'])} postgres (kill -9)",
        chaos_recovery_s_collector=by["collector"],
        chaos_recovery_s_postgres=by["postgres"],
        chaos_runs=len(streams),
        chaos_tasks=sum(len(s) for s in streams.values()),
        chaos_duration_s=round(chaos_s, 1),
        chaos_load_average=chaos_load,
        chaos_all_batches_in_after_close_s=round(delivered, 1),
        chaos_scheduler_agent=(
            f"{agent.stats['sent_batches']} batches in {agent.stats['posts']} POSTs "
            f"({agent.stats['retries']} retried)"
        ),
    )


def _post_until_stored(url: str, token: str, body: bytes) -> dict[str, Any]:
    """POST one batch as an agent would: again after 429/503 (Retry-After), else the answer."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
               "Content-Encoding": "zstd"}  # fmt: skip
    for _ in range(60):
        answer = requests.post(f"{url}/v1/batches", data=body, headers=headers, timeout=60)
        if answer.status_code in (429, 503):
            time.sleep(float(answer.headers.get("Retry-After", "1")))
            continue
        assert answer.status_code in (200, 202), (answer.status_code, answer.text)
        return answer.json()
    raise AssertionError("the collector kept answering 503")


def test_two_collector_replicas_take_batches_at_once(stack, tmp_path):
    from bench.lib_workload import encoded_batches

    first, second = int(stack.collector_url.rsplit(":", 1)[1]), free_port()
    # Publishing a range lets every replica have a host port (docs/deploy.md, "Scale").
    stack.settings["COLLECTOR_PORT"] = f"{min(first, second)}-{max(first, second)}"
    start = time.monotonic()
    stack.compose("up", "-d", "--no-deps", "--scale", "collector=2", "collector")
    stack.wait_healthy("collector")
    FIGURES["scale_to_2_collectors_s"] = round(time.monotonic() - start, 1)
    urls = [f"http://127.0.0.1:{stack.port('collector', 8700, i)}" for i in (1, 2)]
    assert len(set(urls)) == 2 and len(stack.containers("collector")) == 2

    # Synthetic agents whose every batch goes to both replicas at the same moment (a retry
    # through the other replica, at its worst), while a real cluster records via replica 2.
    cluster = f"replicas-{uuid.uuid4().hex[:8]}"
    agents, per_agent, events = 4, 10, 500
    batches = [
        body
        for a in range(agents)
        for body in encoded_batches(
            per_agent, events, agent=f"synthetic-{a}", session="replicas", cluster=cluster, seed=a
        )  # fmt: skip
    ]
    answers: list[dict[str, Any]] = []

    def send(url: str) -> None:
        for body in batches:
            answers.append(_post_until_stored(url, stack.token, body))

    senders = [threading.Thread(target=send, args=(url,)) for url in urls]
    for t in senders:
        t.start()
    dask_cluster = f"replica-dask-{uuid.uuid4().hex[:8]}"
    config = dask_config(stack, dask_cluster, tmp_path / "spool")
    config["hindsight.url"] = urls[1]
    with dask.config.set(config):
        with LocalCluster(n_workers=1, **CLUSTER_KW) as lc, Client(lc) as client:
            stream = run_map(client, "via-replica-2", 1000)
    for t in senders:
        t.join(600)
    assert len(answers) == 2 * len(batches)
    assert sum(1 for a in answers if a.get("duplicate")) == len(batches)  # stored once each

    runs = wait_until(lambda: stack.api.runs(cluster), 120, "the synthetic run")
    (run,) = runs
    wait_until(
        lambda: stack.api.get(f"/v1/runs/{run['id']}")["task_count"] == agents * per_agent * events,
        120, "every synthetic task",
    )  # fmt: skip
    detail = stack.api.get(f"/v1/runs/{run['id']}")
    assert detail["task_count"] == agents * per_agent * events  # nothing lost, nothing twice
    assert detail["completeness"]["batches_received"] == len(batches)
    assert detail["completeness"]["ratio"] == 1.0
    assert_recorded(stack.api, dask_cluster, {"via-replica-2": stream}, timeout=120)
    FIGURES["replicas_batches_posted"] = f"{2 * len(batches)} ({len(batches)} to each replica)"


def test_down_v_leaves_no_containers_networks_or_volumes(stack):
    stack.save_logs()
    start = time.monotonic()
    stack.compose("down", "-v")
    FIGURES["down_v_s"] = round(time.monotonic() - start, 1)
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    # Nothing answers on the published ports any more.
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{stack.query_url}/readyz", timeout=5)
