"""Tokens hashed at rest and compared in constant time; names validated before they reach a
blob key or SQL; hostile strings inside events stored and returned verbatim, inert."""

from __future__ import annotations

import hashlib
import hmac
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example as also
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect, select, text

from hindsight.schema import valid_name
from storage.core import models as m
from storage.core.batches import BatchKey, blob_key, parse_blob_key
from storage.core.blobs import LocalBlobStore, open_blob_store
from storage.core.db import make_engine, make_sessionmaker
from storage.core.tokens import hash_token, verify_token
from tests.helpers import auth, example, post
from tests.query.test_runs import run_batch


def test_tokens_are_stored_only_as_sha256(stack, make_token):
    token = make_token(scopes="read")
    engine = make_engine(stack["database_url"])
    try:
        with engine.connect() as conn:
            # No column of any table holds the token itself.
            for table in inspect(conn).get_table_names():
                for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                    assert token not in " ".join(map(str, row)), table
            stored = conn.execute(
                select(m.Token.token_hash).where(m.Token.token_hash == hash_token(token))
            ).scalar_one()
        assert stored == hashlib.sha256(token.encode()).hexdigest()
    finally:
        engine.dispose()
    if stack["database_url"].startswith("sqlite"):  # not even in free pages of the file
        raw = b"".join(p.read_bytes() for p in Path(stack["data_dir"]).glob("index.db*"))
        assert token.encode() not in raw


def test_verification_compares_digests_in_constant_time(stack, make_token, monkeypatch):
    token = make_token(scopes="read")
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    engine = make_engine(stack["database_url"])
    try:
        with make_sessionmaker(engine)() as db:
            assert verify_token(db, token) is not None
            assert verify_token(db, token + "x") is None
    finally:
        engine.dispose()
    assert calls == [(hash_token(token), hash_token(token))]


NASTY_KEYS = ["../x", "a/../../b", "/etc/passwd", "a//b", "./a", "a/./b", "", "a/.."]


@pytest.mark.parametrize("key", NASTY_KEYS)
def test_blob_stores_refuse_traversal_keys(blob_url, moto_endpoint, key):
    store = open_blob_store(blob_url, endpoint_url=moto_endpoint)
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key), lambda: store.delete(key)):
        with pytest.raises(ValueError):
            call()


_ALPHABET = string.ascii_letters + string.digits + "._-/\\%\x00 '\";:~\n"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet=_ALPHABET, min_size=0, max_size=140), min_size=3, max_size=3),
    st.integers(min_value=0, max_value=2**53),
)
@also(["cluster", "session", "agent"], 10**12)
def test_any_valid_name_makes_a_key_inside_the_tenants_prefix(names, seq):
    """Whatever passes name validation can only ever name a file under its own prefix, and
    the key reads back as the same identity (``reindex`` finds every batch by its key: a
    seq of 10**12 or more was skipped)."""
    from hindsight.schema import Batch

    if not all(valid_name(n) for n in names):
        return
    cluster, session, agent = names
    batch = Batch(schema=1, cluster=cluster, session=session, agent=agent, seq=seq, events=[])
    key = blob_key("tenant", batch)
    root = Path("/nonexistent-root")
    path = LocalBlobStore.__new__(LocalBlobStore)
    path.root = root
    resolved = (root / path._path(key)).resolve()
    assert resolved.is_relative_to(root / "v1" / "tenant")
    assert key.count("/") == 5 and len(key) < 1024
    assert parse_blob_key(key) == BatchKey("tenant", cluster, session, agent, seq)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=300))
@also("cluster\n")
def test_names_that_could_escape_are_never_valid(name):
    if valid_name(name):
        assert "/" not in name and "\\" not in name and ".." not in name
        assert name not in (".", "") and len(name) <= 128 and "\x00" not in name
        assert "\n" not in name


HOSTILE = [
    "'); DROP TABLE runs; --",
    '" OR 1=1 --',
    "../../../../etc/passwd",
    "%s%s%s%n",
    "${jndi:ldap://x/a}",
    "<script>alert(1)</script>",
]


def test_hostile_strings_inside_events_are_stored_and_returned_verbatim(stack, make_token):
    from collector.app import create_app as collector_app
    from services.query.app import create_app as query_app

    token = make_token()
    batch = run_batch("prod", "s1", "r1", 0, n_tasks=len(HOSTILE))
    for ev, value in zip([e for e in batch["events"] if e["kind"] == "task"], HOSTILE, strict=True):
        ev["key"] = value
        ev["typename"] = value
    assert post(collector_app(stack).test_client(), batch, token=token).status_code == 202
    query = query_app(stack).test_client()
    runs = query.get("/v1/runs", headers=auth(token)).json["runs"]
    tasks = query.get(f"/v1/runs/{runs[0]['id']}/tasks", headers=auth(token)).json["tasks"]
    assert sorted(t["key"] for t in tasks) == sorted(HOSTILE)
    # The tables the strings named still exist and still answer for everyone.
    assert post(collector_app(stack).test_client(), example(), token=token).status_code == 202
    assert len(query.get("/v1/runs", headers=auth(token)).json["runs"]) == 2


def test_no_token_in_a_url_reaches_gunicorns_access_log(pg_url, moto_endpoint, tmp_path):
    """The deployment's command lines turned on gunicorn's access log,
    whose default line is the whole request line, so a Ray cluster's ingest URL
    (``?token=...``) was written to the collector's log. The compose file no longer turns it
    on, and if an operator does, the line holds the path without the query string."""
    import requests

    from bench.lib_faults import Gunicorn, collector_env
    from tests.conftest import make_bucket

    log = tmp_path / "access.log"
    env = collector_env(pg_url, f"s3://{make_bucket(moto_endpoint)}/h", moto_endpoint)
    server = Gunicorn(env, workers=1, threads=2, args=("--access-logfile", str(log)))
    secret = "hs_" + "s3cr3t" * 6
    try:
        resp = requests.post(f"{server.url}/v1/ray/events?cluster=c&token={secret}", data=b"[]",
                             headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
        assert resp.status_code == 401
    finally:
        server.stop()
    text = log.read_text()
    assert "/v1/ray/events" in text and secret not in text and "token=" not in text
