"""Operations: Prometheus /metrics on both services, JSON access logs, and bounded in-flight
requests answering 503 when a process is saturated."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from collector.app import create_app as create_collector
from services.common.ops import JsonFormatter
from services.embedded import create_app as create_embedded
from services.query.app import create_app as create_query
from tests.helpers import auth, encode, example, example_bytes, post
from tests.reliability.conftest import token_for


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition text, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(client: Any, name: str, **labels: str) -> float:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    return samples(resp.get_data(as_text=True)).get((name, tuple(sorted(labels.items()))), 0.0)


def test_collector_metrics_count_events_bytes_rejects_and_latency(embedded):
    app = create_collector(embedded)
    token = token_for(embedded)
    client = app.test_client()
    n = len(json.loads(example_bytes())["events"])
    before = {
        "events": metric(client, "hindsight_ingested_events_total"),
        "bytes": metric(client, "hindsight_ingested_bytes_total", encoding="zstd"),
        "dup": metric(client, "hindsight_ingested_batches_total", duplicate="true"),
        "invalid": metric(client, "hindsight_rejected_requests_total", reason="invalid_batch"),
        "put": metric(client, "hindsight_blob_seconds_count", op="put"),
        "index": metric(client, "hindsight_index_seconds_count"),
    }
    body = encode(example_bytes())
    assert post(client, body, token=token, raw=True).status_code == 202
    assert post(client, body, token=token, raw=True).status_code == 202  # a retry
    assert post(client, example(seq="x"), token=token).status_code == 400

    assert metric(client, "hindsight_ingested_events_total") == before["events"] + n
    assert metric(client, "hindsight_ingested_bytes_total", encoding="zstd") == before[
        "bytes"
    ] + len(body)
    assert metric(client, "hindsight_ingested_batches_total", duplicate="true") == before["dup"] + 1
    assert (
        metric(client, "hindsight_rejected_requests_total", reason="invalid_batch")
        == before["invalid"] + 1
    )
    assert metric(client, "hindsight_blob_seconds_count", op="put") == before["put"] + 2
    assert metric(client, "hindsight_index_seconds_count") == before["index"] + 2
    text = client.get("/metrics").get_data(as_text=True)
    assert "hindsight_http_in_flight_requests" in text
    assert (
        'hindsight_http_requests_total{route="/v1/batches",service="collector",status="202"}'
        in text
    )


@pytest.mark.parametrize("factory", [create_query, create_embedded])
def test_metrics_on_the_query_and_embedded_services_name_no_tenant(embedded, factory):
    tenant = "tenant-that-must-not-leak"
    token = token_for(embedded, tenant)
    client = factory(embedded).test_client()
    assert client.get("/v1/runs", headers=auth(token)).status_code == 200
    resp = client.get("/metrics")  # unauthenticated, like every scrape target
    assert resp.status_code == 200
    assert resp.mimetype == "text/plain"
    text = resp.get_data(as_text=True)
    assert "hindsight_http_request_seconds_bucket" in text
    assert 'route="/v1/runs"' in text
    assert tenant not in text
    # The query service showed the collector's families at zero
    # (hindsight_ingested_events_total 0); the embedded server, which ingests, keeps them.
    ingest = ("hindsight_ingested_events_total", "hindsight_index_seconds_bucket")
    if factory is create_query:
        assert not any(name in text for name in ingest)
    else:
        assert all(name in text for name in ingest)


def test_metrics_can_be_switched_off(embedded):
    client = create_collector({**embedded, "metrics": False}).test_client()
    assert client.get("/metrics").status_code == 404


def test_access_log_is_one_json_line_per_request_with_status_tenant_duration(embedded, caplog):
    tenant = "logged-tenant"
    token = token_for(embedded, tenant)
    client = create_collector({**embedded, "log_format": "json"}).test_client()
    with caplog.at_level(logging.INFO, logger="hindsight.access"):
        assert post(client, example(), token=token).status_code == 202
        assert post(client, example(), token="hs_wrong").status_code == 401
    records = [r for r in caplog.records if r.name == "hindsight.access"]
    assert [r.status for r in records] == [202, 401]
    line = JsonFormatter().format(records[0])
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["status"] == 202 and entry["tenant"] == tenant
    assert entry["method"] == "POST" and entry["route"] == "/v1/batches"
    assert entry["duration_ms"] > 0 and entry["bytes_in"] > 0
    assert json.loads(JsonFormatter().format(records[1]))["tenant"] is None
    # the line itself names the tenant too, for text logs (an operator found none there)
    assert records[0].getMessage().endswith(f"ms {tenant}")
    assert records[1].getMessage().endswith("ms -")


def test_access_log_can_be_switched_off(embedded, caplog):
    client = create_collector({**embedded, "access_log": False}).test_client()
    with caplog.at_level(logging.INFO, logger="hindsight.access"):
        client.get("/v1/openapi.json")
    assert not [r for r in caplog.records if r.name == "hindsight.access"]


def _start_slow_upload(base: str, size: int) -> socket.socket:
    """A client that sends the headers and half the body, then stalls: it holds a slot."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n".encode()
        + b"{" * (size // 2)
    )
    return sock


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.01)


@pytest.mark.parametrize(
    "limits", [{"max_in_flight": 1}, {"max_in_flight": 0, "max_in_flight_bytes": 4096}]
)
def test_saturated_process_answers_503_with_retry_after_before_reading_the_body(
    embedded, serve, limits
):
    app = create_embedded({**embedded, "auth": "disabled", **limits})
    admission = app.extensions["hindsight.admission"]
    base = serve(app)
    slow = _start_slow_upload(base, 4000)
    try:
        _wait_for(lambda: admission.requests == 1)
        resp = requests.post(
            f"{base}/v1/batches",
            data=encode(example()),
            headers={"Content-Type": "application/json", "Content-Encoding": "zstd"},
            timeout=10,
        )
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "overloaded"
        assert int(resp.headers["Retry-After"]) >= 1
        # Probes and the scrape still answer while saturated.
        assert requests.get(f"{base}/healthz", timeout=10).status_code == 200
        assert requests.get(f"{base}/metrics", timeout=10).status_code == 200
    finally:
        slow.close()
    _wait_for(lambda: admission.requests == 0)
    resp = requests.post(
        f"{base}/v1/batches",
        data=encode(example()),
        headers={"Content-Type": "application/json", "Content-Encoding": "zstd"},
        timeout=10,
    )
    assert resp.status_code == 202


def test_one_metrics_answer_for_all_gunicorn_workers_from_a_directory_it_makes(
    pg_url, moto_endpoint, tmp_path
):
    """Under gunicorn without PROMETHEUS_MULTIPROC_DIR each scrape
    read one worker's counters (1 2 3 2 3 4...), and a directory that did not exist stopped
    every worker at boot. The shipped gunicorn configuration makes (and empties) it."""
    from bench.lib_faults import Gunicorn, collector_env
    from bench.lib_faults import make_token as token_of
    from tests.conftest import make_bucket, new_tenant

    directory = tmp_path / "not-yet" / "metrics"
    (tmp_path / "not-yet").mkdir()
    env = collector_env(pg_url, f"s3://{make_bucket(moto_endpoint)}/h", moto_endpoint,
                        PROMETHEUS_MULTIPROC_DIR=str(directory))  # fmt: skip
    token = token_of(pg_url, new_tenant())
    server = Gunicorn(env, workers=2, threads=2)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        seen = []
        for seq in range(6):
            body = json.dumps(example(seq=seq)).encode()
            resp = requests.post(server.url + "/v1/batches", data=body, headers=headers, timeout=60)
            assert resp.status_code == 202, resp.text
            text = requests.get(server.url + "/metrics", timeout=60).text
            seen.append(
                samples(text)[("hindsight_ingested_batches_total", (("duplicate", "false"),))]
            )
        assert seen == [1, 2, 3, 4, 5, 6]  # every scrape counts every worker's batches
    finally:
        server.stop()


def test_a_process_outside_gunicorn_starts_with_a_metrics_directory_not_yet_made(tmp_path):
    """The compose file sets PROMETHEUS_MULTIPROC_DIR for the services; a process started
    beside them in the same container's environment (`docker compose run collector ...`,
    `hindsight serve`) has no gunicorn to make the directory, and importing the services'
    metrics stopped it (FileNotFoundError)."""
    import subprocess
    import sys

    directory = tmp_path / "not-yet" / "metrics"
    code = (
        "import services.common.ops as ops; ops.REQUESTS.labels('x', 'y', '200').inc(); print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert any(directory.glob("counter_*.db"))


def test_json_logs_are_json_lines_gunicorns_own_included(pg_url, moto_endpoint, tmp_path):
    """With HINDSIGHT_LOG_FORMAT=json the services' lines were JSON
    but gunicorn's own ("Booting worker with pid", "Handling signal", a worker timeout)
    were not, so a log pipeline parsing JSON dropped or mangled exactly those."""
    from bench.lib_faults import Gunicorn, collector_env
    from bench.lib_faults import make_token as token_of
    from tests.conftest import make_bucket, new_tenant

    env = collector_env(pg_url, f"s3://{make_bucket(moto_endpoint)}/h", moto_endpoint,
                        HINDSIGHT_LOG_FORMAT="json", HINDSIGHT_LOG_LEVEL="INFO",
                        HINDSIGHT_ACCESS_LOG="true")  # fmt: skip
    token = token_of(pg_url, new_tenant())
    path = tmp_path / "server.log"
    with path.open("wb") as log:
        server = Gunicorn(env, workers=1, threads=2, args=("--log-level", "info"), log=log)
        try:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
            resp = requests.post(server.url + "/v1/batches", data=json.dumps(example()),
                                 headers=headers, timeout=60)  # fmt: skip
            assert resp.status_code == 202, resp.text
        finally:
            server.stop()
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    gunicorn = [e["message"] for e in entries if e["logger"] == "gunicorn.error"]
    assert any("Booting worker" in m for m in gunicorn), gunicorn
    assert any(e["logger"] == "hindsight.access" and e["status"] == 202 for e in entries)
