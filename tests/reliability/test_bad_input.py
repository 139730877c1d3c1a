"""Property-based tests of the batch decoder and the capped decompression (hypothesis), and
"no partial write on any rejected request" against the real collector.

The bomb tests (zstd and gzip, 413 with bounded memory) are in tests/collector/test_ingest.py.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

import boto3
import pytest
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collector.body import decompress
from collector.views import decode_body
from hindsight.schema import Batch, SchemaError, decode_batch, encode_batch, valid_name
from services.common.web import ApiError
from tests.helpers import example as example_batch
from tests.helpers import example_bytes, post, short_body_answer

NAME = st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9_-]{0,20}\Z")
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
STARTSTOP = st.fixed_dictionaries(
    {"action": st.sampled_from(["compute", "transfer", "disk-read"]),
     "start": st.floats(0, 2e9), "stop": st.floats(0, 2e9)}
)  # fmt: skip
TASK = st.fixed_dictionaries(
    {"kind": st.just("task"), "key": st.text(min_size=1, max_size=40),
     "prefix": st.text(min_size=1, max_size=20),
     "status": st.sampled_from(["memory", "erred"])},
    optional={"worker": st.text(min_size=1, max_size=20), "nbytes": st.integers(0, 2**53),
              "startstops": st.lists(STARTSTOP, max_size=3), "run": st.text(min_size=1, max_size=10)},
)  # fmt: skip
CUSTOM = st.fixed_dictionaries(
    {"kind": st.just("custom"), "stream": st.text(min_size=1, max_size=10), "time": st.floats(0, 2e9),
     "value": JSON}
)  # fmt: skip
BATCH = st.fixed_dictionaries(
    {"schema": st.just(1), "cluster": NAME, "session": NAME, "agent": NAME,
     "seq": st.integers(0, 2**53), "events": st.lists(TASK | CUSTOM, max_size=6)},
    optional={"final": st.booleans(), "sent_at": st.floats(0, 2e9),
              "dropped": st.dictionaries(st.sampled_from(["buffer_full", "spool_full"]), st.integers(0, 10**9))},
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(BATCH)
def test_every_valid_batch_decodes_and_round_trips(batch):
    decoded = decode_batch(json.dumps(batch, allow_nan=False).encode())
    assert isinstance(decoded, Batch)
    assert (decoded.cluster, decoded.session, decoded.agent, decoded.seq) == (
        batch["cluster"], batch["session"], batch["agent"], batch["seq"]
    )  # fmt: skip
    assert len(decoded.events) == len(batch["events"])
    assert decode_batch(encode_batch(decoded)) == decoded


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2000))
@example(b"")
@example(b"{}")
@example(b'{"schema":1')
@example(b"\xff\xfe")
def test_arbitrary_bytes_are_a_batch_or_a_400(data):
    try:
        decode_body(data)
    except ApiError as exc:
        assert exc.status == 400 and exc.code == "invalid_batch"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BATCH, st.sampled_from(["cluster", "session", "agent", "seq", "schema", "events"]), JSON)
def test_any_field_replaced_by_any_json_is_valid_or_a_schema_error(batch, field, value):
    batch = {**batch, field: value}
    try:
        decoded = decode_batch(json.dumps(batch, allow_nan=False).encode())
    except SchemaError as exc:
        assert str(exc)  # names what is wrong
        return
    # If it decoded, the names are still names: nothing unvalidated reaches a key.
    assert all(valid_name(n) for n in (decoded.cluster, decoded.session, decoded.agent))
    assert decoded.seq >= 0


CAP = 4096


def _compress(data: bytes, encoding: str) -> bytes:
    if encoding == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    if encoding == "gzip":
        return gzip.compress(data)
    return data


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2 * CAP), st.sampled_from(["zstd", "gzip", "identity"]))
def test_decompress_round_trips_under_the_cap_and_is_413_over_it(data, encoding):
    body = _compress(data, encoding)
    if not data and encoding != "identity":
        return  # an empty compressed stream is refused as bad_encoding (no batch is empty)
    if len(data) <= CAP:
        assert decompress(body, encoding, CAP) == data
    else:
        with pytest.raises(ApiError) as exc:
            decompress(body, encoding, CAP)
        assert exc.value.status == 413


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=CAP), min_size=1, max_size=4))
def test_gzip_of_several_members_is_their_concatenation(parts):
    """RFC 1952: a gzip stream may hold several members (``cat a.gz b.gz``); they were
    refused as trailing data."""
    body = b"".join(gzip.compress(p) for p in parts)
    data = b"".join(parts)
    if len(data) <= CAP:
        assert decompress(body, "gzip", CAP) == data
    else:
        with pytest.raises(ApiError) as exc:
            decompress(body, "gzip", CAP)
        assert exc.value.status == 413


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=3000), st.sampled_from(["zstd", "gzip"]))
@example(b"\x28\xb5\x2f\xfd", "zstd")  # a zstd magic number and nothing else
@example(b"\x1f\x8b\x08\x00", "gzip")
def test_corrupt_compressed_bodies_are_400_or_413_never_another_error(data, encoding):
    try:
        out = decompress(data, encoding, CAP)
    except ApiError as exc:
        assert exc.status in (400, 413)
    else:
        assert len(out) <= CAP


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4000), st.sampled_from(["zstd", "gzip"]))
def test_truncated_compressed_bodies_are_refused(cut, encoding):
    body = _compress(example_bytes(), encoding)
    if cut >= len(body):
        return
    try:
        out = decompress(body[:cut], encoding, 1 << 20)
    except ApiError as exc:
        assert exc.status == 400
    else:  # zstd may yield a prefix of the data; the decoder then refuses it
        with pytest.raises(ApiError):
            decode_body(out)


def _mutations() -> Any:
    good = example_bytes()
    return st.one_of(
        st.binary(max_size=500).map(lambda b: (b, "identity")),
        st.integers(0, len(good) - 1).map(lambda i: (good[:i], "identity")),
        st.tuples(st.integers(0, len(good) - 1), st.binary(min_size=1, max_size=3)).map(
            lambda t: (good[: t[0]] + t[1] + good[t[0] + len(t[1]) :], "identity")
        ),
        st.binary(max_size=300).map(lambda b: (b, "zstd")),
        st.binary(max_size=300).map(lambda b: (b, "gzip")),
    )


def test_no_rejected_request_writes_anything(tmp_path):
    """Hundreds of malformed requests of every kind: each is 4xx with the JSON error body,
    and afterwards the blob store and the index hold nothing at all."""
    from collector.app import create_app
    from services.query.app import create_app as query_app

    cfg = {"data_dir": str(tmp_path), "auth": "disabled", "finish_worker": False}
    client = create_app(cfg).test_client()
    seen: dict[int, int] = {}

    @settings(max_examples=400, deadline=None, database=None)
    @given(_mutations())
    def hit(case: tuple[bytes, str]) -> None:
        body, encoding = case
        try:
            decode_body(decompress(body, encoding, 1 << 25))
            return  # a mutation that is still a valid batch is not a rejected request
        except ApiError:
            pass
        resp = client.post(
            "/v1/batches",
            data=body,
            headers={"Content-Type": "application/json", "Content-Encoding": encoding},
        )
        assert 400 <= resp.status_code < 500, resp.status_code
        assert set(resp.json["error"]) == {"code", "message"}
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1

    hit()
    assert sum(seen.values()) >= 100
    assert not any((tmp_path / "blobs").rglob("*.zst"))
    query = query_app(cfg).test_client()
    assert query.get("/v1/runs").json["runs"] == []
    assert query.get("/v1/clusters").json["clusters"] == []


@pytest.mark.parametrize(
    "change",
    [
        {"seq": 2**63},
        {"dropped": {"buffer_full": 2**64}},
        {
            "events": [
                {"kind": "task", "key": "k", "prefix": "p", "status": "memory", "nbytes": 2**70}
            ]
        },
        {
            "events": [
                {
                    "kind": "worker",
                    "event": "joined",
                    "address": "tcp://w",
                    "time": 1.0,
                    "nthreads": 2**40,
                }
            ]
        },
        {"events": [{"kind": "task", "key": "a\x00b", "prefix": "p", "status": "memory"}]},
        {"events": [{"kind": "session", "time": 1.0, "config": {"k\x00": "v"}}]},
    ],
    ids=["seq", "dropped", "nbytes", "nthreads", "nul-key", "nul-in-json"],
)
def test_values_the_index_cannot_hold_are_400_before_anything_is_stored(stack, make_token, change):
    """These were stored, then failed the index on every retry."""
    from collector.app import create_app
    from tests.helpers import example, post

    token = make_token()
    client = create_app(stack).test_client()
    resp = post(client, example(**change), token=token)
    assert resp.status_code == 400 and resp.json["error"]["code"] == "invalid_batch"
    assert any(w in resp.json["error"]["message"] for w in ("range", "above", "<=", "NUL"))
    from storage.core.blobs import open_blob_store

    blobs = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    assert list(blobs.list("v1/")) == []


def _deep(depth: int) -> bytes:
    """The example batch with an unknown field nested ``depth`` arrays deep."""
    return example_bytes().replace(b"{", b'{"x": ' + b"[" * depth + b"]" * depth + b",", 1)


@pytest.mark.parametrize(
    "body, message",
    [
        (_deep(100_000), "nested too deeply"),
        # NUL deep inside: the check for it walked the value recursively (a 500 past ~300)
        (
            example_bytes().replace(
                b"{", b'{"x": ' + b"[" * 900 + b'"\\u0000"' + b"]" * 900 + b",", 1
            ),
            "NUL",
        ),
        (json.dumps(example_batch(cluster="prod\n")).encode(), "invalid name - at `$.cluster`"),
        (json.dumps(example_batch(agent="a\n")).encode(), "invalid name - at `$.agent`"),
    ],
    ids=["nesting", "deep-nul", "newline-cluster", "newline-agent"],
)
def test_deep_nesting_and_names_ending_in_a_newline_are_400(stack, make_token, body, message):
    """Nesting past msgspec's limit (even in a field nobody
    reads) was a 500, and a name ending in "\\n" passed the name pattern (``$`` matches
    before a final newline): 503 forever from S3, a directory with a newline on disk."""
    from collector.app import create_app
    from storage.core.blobs import open_blob_store

    token = make_token()
    client = create_app(stack).test_client()
    assert post(client, _deep(100), token=token).status_code == 202  # nesting as such is fine
    resp = post(client, body, token=token, raw=False, encoding="zstd")
    assert resp.status_code == 400, resp.json
    assert (
        resp.json["error"]["code"] == "invalid_batch" and message in resp.json["error"]["message"]
    )
    blobs = open_blob_store(stack["blob_url"], endpoint_url=stack["s3_endpoint_url"])
    assert len(list(blobs.list("v1/"))) == 1


def test_a_chunked_body_over_the_cap_is_413_under_gunicorn(pg_url, moto_endpoint):
    """Gunicorn marks a chunked body's input terminated, and
    werkzeug then stopped reading at the cap without a word: a body over the cap was decoded
    cut short and answered 400 (an agent drops a batch on a 400; a 413 tells it to split)."""
    import requests

    from bench.lib_faults import Gunicorn, collector_env
    from bench.lib_faults import make_token as token_for
    from tests.conftest import make_bucket, new_tenant

    token = token_for(pg_url, new_tenant())
    env = collector_env(pg_url, f"s3://{make_bucket(moto_endpoint)}/h", moto_endpoint,
                        HINDSIGHT_MAX_BATCH_BYTES="65536")  # fmt: skip
    server = Gunicorn(env, workers=1, threads=2)

    def chunked(data: bytes) -> Any:  # requests sends a generator chunked, with no length
        return (data[i : i + 4096] for i in range(0, len(data), 4096))

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    try:
        for route, fits, over in [
            ("/v1/batches", json.dumps(example_batch()).encode(),
             b" " * 70_000 + json.dumps(example_batch(seq=1)).encode()),
            ("/v1/ray/events", b"[]", b"[" + b" " * 70_000 + b"]"),
        ]:  # fmt: skip
            ok = requests.post(server.url + route, data=chunked(fits), headers=headers, timeout=60)
            assert ok.status_code in (200, 202), ok.text
            # compressed, and over the cap as sent: cut at the cap, it inflated to less
            big = gzip.compress(os.urandom(90_000))  # incompressible
            resp = requests.post(server.url + route, data=chunked(big), timeout=60,
                                 headers={**headers, "Content-Encoding": "gzip"})  # fmt: skip
            assert resp.status_code == 413, (route, resp.text)
            resp = requests.post(
                server.url + route, data=chunked(over), headers=headers, timeout=60
            )
            assert resp.status_code == 413, (route, resp.text)
            assert resp.json()["error"]["code"] == "batch_too_large"
    finally:
        server.stop()


def test_a_body_shorter_than_its_content_length_is_408_under_gunicorn(pg_url, moto_endpoint):
    """A body shorter than its Content-Length held one of the
    collector's threads until the client hung up; cut by a closed connection, gunicorn
    handed over what had arrived, and a cut that was valid JSON was stored as a batch. Now
    each read waits HINDSIGHT_BODY_TIMEOUT, a short body is 408 (an agent retries it),
    nothing of it is stored, and the connection closes; the thread serves again."""
    import requests

    from bench.lib_faults import Gunicorn, collector_env
    from bench.lib_faults import make_token as token_for
    from tests.conftest import make_bucket, new_tenant

    token = token_for(pg_url, new_tenant())
    bucket = make_bucket(moto_endpoint)
    env = collector_env(pg_url, f"s3://{bucket}/h", moto_endpoint, HINDSIGHT_BODY_TIMEOUT="1")
    server = Gunicorn(env, workers=1, threads=1)  # one thread: a held thread would starve it
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    whole = json.dumps(example_batch()).encode()
    try:
        for route, valid in (("/v1/batches", whole), ("/v1/ray/events", b"[]")):
            status, body, rest = short_body_answer(server.url, route, headers)
            assert (status, body["error"]["code"]) == (408, "body_timeout"), body
            assert rest == b""  # closed after the answer: no second answer to stray bytes
            # valid JSON, cut short by a closed connection
            status, body, _ = short_body_answer(server.url, route, headers, valid,
                                                length=len(valid) + 100, close=True)  # fmt: skip
            assert (status, body["error"]["code"]) == (408, "body_incomplete"), body
        s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
        # nothing of them stored: no batch, no Ray body (the index is shared with other
        # tests, whose finished-run work this collector's worker may take and write here)
        for prefix in ("h/v1/", "h/ray/"):
            listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
            assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
        ok = requests.post(server.url + "/v1/batches", data=whole, headers=headers, timeout=60)
        assert ok.status_code == 202, ok.text
    finally:
        server.stop()
