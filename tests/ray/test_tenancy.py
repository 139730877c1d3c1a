"""How a Ray cluster proves its tenant: the exporter sends no header, so a ``ray``-scoped
token rides in the export URL (``hindsight tokens create --for ray``). The token must
never reach a log line, a metric or an error body."""

from __future__ import annotations

import json
import logging

import requests

from bench.lib_ray import RaySim, bodies
from collector.ray import RedactTokens
from tests.ray.test_ingest import T0
from tests.test_cli import Served, env, run


def test_a_token_for_ray_in_the_url_files_runs_under_its_tenant(tmp_path):
    made = run(
        "tokens",
        "create",
        "--tenant",
        "acme",
        "--for",
        "ray",
        "--cluster",
        "prod",
        "--url",
        "http://collector.example:8700",
        "--data-dir",
        str(tmp_path),
        env=env(),
    )
    assert made.returncode == 0, made.stderr
    url = made.stdout.strip().splitlines()[-1]
    assert url.startswith("http://collector.example:8700/v1/ray/events?cluster=prod&token=hs_")
    token = url.rsplit("token=", 1)[1]
    wide = (
        run(
            "tokens",
            "create",
            "--tenant",
            "acme",
            "--scopes",
            "ingest,read",
            "--data-dir",
            str(tmp_path),
            env=env(),
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    server = Served(tmp_path, environ=env(HINDSIGHT_AUTH="required"))
    try:
        export = url.replace("http://collector.example:8700", server.url)
        sim = RaySim(seed=2)
        _, events = sim.job(1, 5, T0)
        body = bodies(sim.node_events(T0 - 1) + events)[0]
        hdr = {"Content-Type": "application/json"}
        ok = requests.post(export, data=body, headers=hdr, timeout=30)
        assert ok.status_code == 200, ok.text
        for bad_url, status in (
            (f"{server.url}/v1/ray/events?cluster=prod", 401),
            (f"{server.url}/v1/ray/events?cluster=prod&token=hs_not-a-token", 401),
            (f"{server.url}/v1/ray/events?cluster=prod&token={wide}", 403),  # could read: refused
        ):
            resp = requests.post(bad_url, data=body, headers=hdr, timeout=30)
            assert resp.status_code == status
            assert "hs_" not in resp.text and wide not in resp.text
        # An ingest token in a header (a proxy adding it) is fine: the same body, stored once.
        again = requests.post(
            f"{server.url}/v1/ray/events?cluster=prod",
            data=body,
            timeout=30,
            headers={**hdr, "Authorization": f"Bearer {wide}"},
        )
        assert again.status_code == 200 and again.json()["duplicate"] is True
        runs = requests.get(
            f"{server.url}/v1/runs", headers={"Authorization": f"Bearer {wide}"}, timeout=30
        ).json()["runs"]
        assert [(r["cluster"], r["task_count"]) for r in runs] == [("prod", 5)]
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
        assert "hindsight_ray_bodies_total" in metrics and token not in metrics
        assert (
            requests.get(f"{server.url}/v1/runs", timeout=30, params={"token": token}).status_code
            == 401
        )
    finally:
        out = server.stop()
    assert "/v1/ray/events" in out  # the request lines are logged ...
    assert token not in out and wide not in out  # ... without the tokens
    assert token.encode() not in (tmp_path / "index.db").read_bytes()


def test_werkzeug_request_lines_lose_their_token():
    record = logging.LogRecord(
        "werkzeug",
        logging.INFO,
        __file__,
        1,
        '%s - - [%s] "%s" %s %s',
        (
            "127.0.0.1",
            "now",
            "POST /v1/ray/events?cluster=a&token=hs_secret&x=1 HTTP/1.1",
            "200",
            "-",
        ),
        None,
    )
    assert RedactTokens().filter(record)
    text = record.getMessage()
    assert "hs_secret" not in text and "token=[redacted]&x=1" in text


def test_the_access_log_has_the_path_not_the_query(tmp_path, caplog):
    from services.embedded import create_app

    app = create_app({"data_dir": str(tmp_path), "auth": "disabled", "ray_sweeper": False})
    with caplog.at_level(logging.INFO, logger="hindsight.access"):
        app.test_client().post(
            "/v1/ray/events?cluster=a&token=hs_secret",
            data=json.dumps([]),
            headers={"Content-Type": "application/json"},
        )
    lines = [r for r in caplog.records if r.name == "hindsight.access"]
    assert lines and all(
        "hs_secret" not in r.getMessage() and "hs_secret" not in str(vars(r)) for r in lines
    )
