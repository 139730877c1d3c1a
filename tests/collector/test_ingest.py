"""POST /v1/batches on both ways to run: embedded (SQLite + files) and full (Postgres + S3)."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib
from typing import Any

import pytest
import zstandard

from storage.core.blobs import open_blob_store
from tests.helpers import auth, encode, example, example_bytes, post

TASK_KEYS = [e["key"] for e in example()["events"] if e["kind"] == "task"]


@pytest.fixture(params=["separate", "embedded-app"])
def services(request: pytest.FixtureRequest, stack: dict[str, Any]) -> tuple[Any, Any]:
    """(collector client, query client): two services on one store, or the embedded app."""
    if request.param == "embedded-app":
        from services.embedded import create_app

        client = create_app(stack).test_client()
        return client, client
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    return collector_app(stack).test_client(), query_app(stack).test_client()


def blobs_of(stack: dict[str, Any], tenant_prefix: str = "v1/") -> list[str]:
    store = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    return list(store.list(tenant_prefix))


def test_example_batch_round_trips_and_a_gzip_retry_is_a_duplicate(services, make_token, stack):
    collector, query = services
    token = make_token()

    resp = post(collector, example_bytes(), token=token, encoding="zstd")
    assert resp.status_code == 202, resp.json
    assert resp.json == {
        "batch_id": f"example-etl/{example()['session']}/scheduler-5d1b6f0e/0",
        "accepted": len(example()["events"]),
        "duplicate": False,
    }

    runs = query.get("/v1/runs", headers=auth(token)).json
    assert [r["name"] for r in runs["runs"]] == ["nightly-aggregate"]
    run = runs["runs"][0]
    assert (run["cluster"], run["status"], run["task_count"], run["error_count"]) == (
        "example-etl",
        "erred",
        4,
        1,
    )
    assert runs["next_cursor"] is None

    tasks = query.get(f"/v1/runs/{run['id']}/tasks", headers=auth(token)).json
    sent = {e["key"]: e for e in example()["events"] if e["kind"] == "task"}
    assert [t["key"] for t in tasks["tasks"]] == TASK_KEYS
    for t in tasks["tasks"]:
        for field in ("prefix", "worker", "thread", "status", "startstops"):
            assert t[field] == sent[t["key"]][field]
        assert t["nbytes"] == sent[t["key"]].get("nbytes")

    detail_before = query.get(f"/v1/runs/{run['id']}", headers=auth(token)).json
    assert detail_before["completeness"]["batches_received"] == 1
    assert detail_before["tasks_by_status"] == {"erred": 1, "memory": 3}
    blobs_before = blobs_of(stack)

    again = post(collector, example_bytes(), token=token, encoding="gzip")
    assert again.status_code == 202
    assert again.json["duplicate"] is True
    assert query.get(f"/v1/runs/{run['id']}", headers=auth(token)).json == detail_before
    assert blobs_of(stack) == blobs_before


def test_identity_encoding_and_stored_blob_is_zstd(services, make_token, stack):
    collector, query = services
    token = make_token()
    assert post(collector, example_bytes(), token=token, encoding="identity").status_code == 202
    (key,) = blobs_of(stack)
    assert key.endswith(
        "/example-etl/" + example()["session"] + "/scheduler-5d1b6f0e/000000000000.json.zst"
    )
    store = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    stored = zstandard.ZstdDecompressor().stream_reader(store.get(key)).read()
    assert json.loads(stored) == example()


def assert_error(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.is_json
    body = resp.json
    assert set(body) == {"error"} and body["error"]["code"] == code and body["error"]["message"]
    return body["error"]


def assert_nothing_written(query: Any, token: str, stack: dict[str, Any]) -> None:
    assert blobs_of(stack) == []
    assert query.get("/v1/runs", headers=auth(token)).json["runs"] == []
    assert query.get("/v1/clusters", headers=auth(token)).json["clusters"] == []


def assert_healthy(collector: Any, token: str) -> None:
    assert collector.get("/healthz").status_code == 200
    assert collector.get("/readyz").status_code == 200
    assert post(collector, example_bytes(), token=token).status_code == 202


def _bad_key() -> dict[str, Any]:
    batch = example()
    batch["events"][8]["key"] = 12
    return batch


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (_bad_key(), "$.events[8].key"),
        (example(seq=-1), "$.seq"),
        (example(schema=2), "$.schema"),
        (example(cluster="../etc"), "$.cluster"),
        (example(cluster="a" * 200), "$.cluster"),
        (example(session="s..x"), "$.session"),
        (example(events=[{"kind": "nope"}]), "$.events[0]"),
        ({k: v for k, v in example().items() if k != "agent"}, "agent"),
    ],
    ids=[
        "wrong-type",
        "negative-seq",
        "unknown-schema",
        "traversal",
        "long-name",
        "dotdot",
        "unknown-kind",
        "missing",
    ],
)
def test_invalid_batch_is_400_naming_the_field_and_writes_nothing(
    services, make_token, stack, body, field
):
    collector, query = services
    token = make_token()
    err = assert_error(post(collector, body, token=token), 400, "invalid_batch")
    assert field in err["message"]
    assert_nothing_written(query, token, stack)
    assert_healthy(collector, token)


@pytest.mark.parametrize(
    ("data", "encoding", "code"),
    [
        (b"{not json", "identity", "invalid_batch"),
        (b"\x28\xb5\x2f\xfd garbage", "zstd", "bad_encoding"),
        (gzip.compress(example_bytes())[:-20], "gzip", "bad_encoding"),
        (b"plain text", "gzip", "bad_encoding"),
    ],
    ids=["bad-json", "corrupt-zstd", "truncated-gzip", "not-gzip"],
)
def test_malformed_body_is_400(services, make_token, stack, data, encoding, code):
    collector, query = services
    token = make_token()
    assert_error(post(collector, data, token=token, encoding=encoding, raw=True), 400, code)
    assert_nothing_written(query, token, stack)
    assert_healthy(collector, token)


def test_missing_and_unknown_tokens_are_401(services, make_token, stack):
    collector, query = services
    token = make_token()
    assert_error(post(collector, example_bytes()), 401, "unauthorized")
    assert_error(post(collector, example_bytes(), token="hs_not-a-real-token"), 401, "unauthorized")
    resp = collector.post("/v1/batches", data=encode(example_bytes()),
                          headers={"Authorization": f"Basic {token}", "Content-Type": "application/json",
                                   "Content-Encoding": "zstd"})  # fmt: skip
    assert_error(resp, 401, "unauthorized")
    assert_nothing_written(query, token, stack)


def test_token_without_ingest_scope_is_403(services, make_token, stack):
    collector, query = services
    reader = make_token(scopes="read")
    assert_error(post(collector, example_bytes(), token=reader), 403, "forbidden")
    assert_nothing_written(query, reader, stack)
    writer = make_token(scopes="ingest")
    assert_error(query.get("/v1/runs", headers=auth(writer)), 403, "forbidden")


@pytest.mark.parametrize("encoding", ["identity", "zstd", "gzip"])
def test_body_over_the_cap_after_decompression_is_413(stack, make_token, encoding):
    from collector.app import create_app

    stack = {**stack, "max_batch_bytes": 1 << 20}
    collector = create_app(stack).test_client()
    token = make_token()
    big = example(events=example()["events"] * 3000)  # ~2.3 MB of JSON, compresses well
    err = assert_error(post(collector, big, token=token, encoding=encoding), 413, "batch_too_large")
    assert str(1 << 20) in err["message"]  # by Content-Length (identity) too
    assert blobs_of(stack) == []
    assert_healthy(collector, token)


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_decompression_bomb_is_413_with_bounded_memory(stack, make_token, encoding):
    """1 GiB of zeros, a few hundred KB on the wire: refused after reading ~cap bytes."""
    from collector.app import create_app

    cap = 1 << 20
    stack = {**stack, "max_batch_bytes": cap}
    collector = create_app(stack).test_client()
    token = make_token()
    gib = 1 << 30
    if encoding == "zstd":
        cctx = zstandard.ZstdCompressor(level=3)
        chunk = bytes(1 << 24)
        c = cctx.compressobj(size=gib)
        bomb = b"".join(c.compress(chunk) for _ in range(gib // len(chunk))) + c.flush()
    else:
        c = zlib.compressobj(9, zlib.DEFLATED, 31)
        chunk = bytes(1 << 24)
        bomb = b"".join(c.compress(chunk) for _ in range(gib // len(chunk))) + c.flush()
    assert len(bomb) < cap  # it passes the compressed-size check; only decompression can catch it
    tracemalloc.start()
    try:
        resp = post(collector, bomb, token=token, encoding=encoding, raw=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_error(resp, 413, "batch_too_large")
    assert peak < 8 * cap, f"peak {peak} bytes while refusing a bomb"
    assert blobs_of(stack) == []
    assert_healthy(collector, token)


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [
        ("text/plain", "identity"),
        ("application/json", "br"),
        ("application/x-protobuf", "identity"),
    ],
)
def test_unknown_content_type_or_encoding_is_415(
    services, make_token, stack, content_type, encoding
):
    collector, query = services
    token = make_token()
    resp = post(
        collector,
        example_bytes(),
        token=token,
        encoding=encoding,
        content_type=content_type,
        raw=True,
    )
    assert_error(
        resp, 415, "unsupported_encoding" if encoding == "br" else "unsupported_media_type"
    )
    assert_nothing_written(query, token, stack)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_compressed_body_sent_without_its_encoding_says_so(services, make_token, stack, encoding):
    """A gzip body without Content-Encoding got "malformed JSON:
    invalid character (byte 0)", with no word of the header."""
    collector, query = services
    token = make_token()
    body = encode(json.loads(example_bytes()), encoding)
    resp = post(collector, body, token=token, encoding="identity", raw=True)
    assert_error(resp, 400, "invalid_batch")
    assert f"send Content-Encoding: {encoding}" in resp.json["error"]["message"]
    assert_nothing_written(query, token, stack)


def test_tenant_over_its_rate_limit_gets_429_with_retry_after(stack, make_token):
    from collector.app import create_app

    n = len(example()["events"])
    collector = create_app({**stack, "rate_limit_events": 1, "rate_limit_burst": n}).test_client()
    token, other = make_token(), make_token()
    assert post(collector, example(seq=0), token=token).status_code == 202
    resp = post(collector, example(seq=1), token=token)
    assert_error(resp, 429, "rate_limited")
    assert int(resp.headers["Retry-After"]) >= 1
    # With its bucket empty, the tenant is refused before the body is read: not even
    # garbage is decoded (a 400 would say it was).
    garbage = b"\x00garbage" * 1000
    assert_error(post(collector, garbage, token=token, raw=True), 429, "rate_limited")
    # ... though a small body is read (an agent's last batch, often with no events)
    assert_error(post(collector, b"\x00garbage", token=token, raw=True), 400, "bad_encoding")
    # Another tenant has its own bucket.
    assert post(collector, example(seq=0), token=other).status_code == 202


def test_blob_store_unavailable_is_503_with_retry_after_and_nothing_indexed(
    stack, make_token, tmp_path
):
    from collector.app import create_app
    from services.query.app import create_app as query_app

    # An S3 endpoint where nothing listens: connection refused.
    down = {**stack, "blob_url": "s3://nowhere/x", "s3_endpoint_url": "http://127.0.0.1:9"}
    collector = create_app(down).test_client()
    token = make_token()
    resp = post(collector, example_bytes(), token=token)
    assert_error(resp, 503, "unavailable")
    assert int(resp.headers["Retry-After"]) > 0
    assert collector.get("/readyz").status_code == 503
    assert collector.get("/healthz").status_code == 200
    assert query_app(stack).test_client().get("/v1/runs", headers=auth(token)).json["runs"] == []


def test_get_and_put_on_unknown_routes_and_methods_are_json_errors(services, make_token):
    collector, query = services
    assert_error(collector.get("/v1/batches"), 405, "method_not_allowed")
    assert_error(query.get("/v1/nope"), 404, "not_found")
    assert "/v1/openapi.json" in query.get("/v1/nope").json["error"]["message"]


def test_a_request_sent_to_the_other_service_says_where_to_go(services, make_token):
    """An agent pointed at the query service, or a reader at the
    collector, got werkzeug's "The requested URL was not found on the server"."""
    collector, query = services
    token = make_token()
    if collector is query:  # the embedded app serves both
        assert post(query, example_bytes(), token=token).status_code == 202
        return
    resp = post(query, example_bytes(), token=token)
    assert_error(resp, 404, "not_found")
    assert "query service: batches go to the collector" in resp.json["error"]["message"]
    resp = collector.get("/v1/runs", headers=auth(token))
    assert_error(resp, 404, "not_found")
    assert "collector: runs are read from the query service" in resp.json["error"]["message"]


def test_index_down_after_blob_write_is_503_and_the_retry_converges(
    pg_url, s3_url, moto_endpoint, tmp_path
):
    """The blob is durable but the index is unreachable: 503, and the agent's retry (or a
    reindex) indexes the batch exactly once."""
    from sqlalchemy.engine import make_url

    from collector.app import create_app
    from services.query.app import create_app as query_app
    from storage.core.db import make_engine, make_sessionmaker
    from storage.core.tokens import create_token
    from tests.conftest import new_tenant
    from tests.helpers import TcpProxy

    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    stack = {"data_dir": str(tmp_path), "database_url": proxied, "blob_url": s3_url,
             "s3_endpoint_url": moto_endpoint, "auth": "required", "token_cache_seconds": 60}  # fmt: skip
    engine = make_engine(pg_url)
    with make_sessionmaker(engine).begin() as db:
        token = create_token(db, new_tenant(), "ingest,read")
    engine.dispose()
    collector = create_app(stack).test_client()
    query = query_app({**stack, "database_url": pg_url}).test_client()
    try:
        assert post(collector, example(seq=0), token=token).status_code == 202  # token now cached

        proxy.cut()
        resp = post(collector, example(seq=1), token=token)
        assert_error(resp, 503, "unavailable")
        assert "Retry-After" in resp.headers
        assert len(blobs_of({**stack})) == 2  # seq 1 is durable, only the index missed it
        (run,) = query.get("/v1/runs", headers=auth(token)).json["runs"]
        assert run["task_count"] == 4

        proxy.restore()
        retry = post(collector, example(seq=1), token=token)
        assert retry.status_code == 202 and retry.json["duplicate"] is True
        post(collector, example(seq=1), token=token)  # and once more: still counted once
        detail = query.get(f"/v1/runs/{run['id']}", headers=auth(token)).json
        assert detail["task_count"] == 8
        assert detail["completeness"]["batches_received"] == 2
        assert detail["completeness"]["batches_expected"] == 2
    finally:
        proxy.close()


@pytest.mark.parametrize("stack", ["full"], indirect=True)
def test_every_index_connection_busy_is_503_and_the_retry_is_indexed(stack, make_token):
    """With every connection of a process's pool busy (a slow index,
    more request threads than connections) a batch was answered 500, and agents drop a batch
    on a 500. It is a 503: the agent retries it."""
    from collector.app import create_app

    app = create_app(stack)
    collector = app.test_client()
    token = make_token()
    engine = app.extensions["hindsight"].sessions.kw["bind"]
    engine.pool._timeout = 0.5  # the wait for a free connection (30 s by default)
    held = [engine.connect() for _ in range(engine.pool.size() + engine.pool._max_overflow)]
    try:
        resp = post(collector, example_bytes(), token=token)
        assert_error(resp, 503, "unavailable")
        assert int(resp.headers["Retry-After"]) > 0
    finally:
        for conn in held:
            conn.close()
    retry = post(collector, example_bytes(), token=token)  # the token's check waited first
    assert retry.status_code == 202 and retry.json["accepted"] > 0


def test_readyz_says_when_the_index_was_never_migrated(tmp_path):
    """With HINDSIGHT_AUTO_UPGRADE off (as compose sets it) and
    `hindsight db upgrade` not run, /readyz said ready while every request failed 503."""
    from collector.app import create_app
    from storage.core.db import make_engine, upgrade

    url = f"sqlite:///{tmp_path / 'index.db'}"
    config = {"data_dir": str(tmp_path), "database_url": url, "auto_upgrade": False,
              "blob_url": (tmp_path / "blobs").as_uri(), "finish_worker": False}  # fmt: skip
    collector = create_app(config).test_client()
    resp = collector.get("/readyz")
    assert resp.status_code == 503, resp.json
    assert "hindsight db upgrade" in resp.json["checks"]["index"]
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    resp = collector.get("/readyz")
    assert resp.status_code == 200 and resp.json["checks"]["index"] == "ok"


@pytest.mark.parametrize("stack", ["full"], indirect=True)
def test_readyz_names_a_missing_bucket(stack):
    """A bucket that does not exist read '"blob_store": "error: "'."""
    from collector.app import create_app

    collector = create_app({**stack, "blob_url": "s3://no-such-bucket-here/x"}).test_client()
    resp = collector.get("/readyz")
    assert resp.status_code == 503
    assert "no bucket 'no-such-bucket-here'" in resp.json["checks"]["blob_store"]


def test_an_index_unreachable_at_start_names_its_setting(tmp_path):
    """With HINDSIGHT_AUTO_UPGRADE on (the default outside compose) a
    Postgres nobody listens on stopped the service with sixty lines of driver traceback."""
    import socket

    from collector.app import create_app
    from storage.core.config import ConfigError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"postgresql+psycopg2://hs:secret@127.0.0.1:{s.getsockname()[1]}/nowhere"
    config = {"data_dir": str(tmp_path), "database_url": url, "auth": "required",
              "blob_url": (tmp_path / "blobs").as_uri(), "finish_worker": False}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        create_app(config)
    message = str(err.value)
    assert message.startswith("HINDSIGHT_DATABASE_URL (") and "cannot be reached" in message
    assert "secret" not in message


def test_a_decoded_task_batch_holds_nothing_the_cyclic_gc_walks():
    """A batch in flight is walked by every full collection while it is tracked: past one
    collection (which untracks a tuple holding only untracked values), none of the decoded
    task events, their phases or attributes may be tracked; only the batch and its one
    events list are, whatever their number. A list of phases is never untracked."""
    import gc

    from hindsight.schema import decode_batch

    events = [
        {
            "kind": "task",
            "key": f"('x-1', {i})",
            "prefix": "x",
            "status": "memory",
            "worker": "tcp://10.0.0.1:1",
            "attrs": {"attempt": 1, "node": "n1"},
            "startstops": [
                {"action": "transfer", "start": 1.0, "stop": 1.5, "source": "tcp://10.0.0.2:1"},
                {"action": "compute", "start": 2.0, "stop": 3.0},
            ],
        }
        for i in range(1000)
    ]
    body = json.dumps(
        {"schema": 1, "cluster": "c", "session": "s", "agent": "a", "seq": 0, "events": events}
    ).encode()
    batch = decode_batch(body)
    gc.collect()
    tracked = [
        o
        for ev in batch.events
        for o in (ev, ev.startstops, ev.attrs, *ev.startstops)
        if gc.is_tracked(o)
    ]
    assert not tracked, tracked[:3]
