"""One conformance suite, run against every blob store (local directory and S3)."""

from __future__ import annotations

import threading

import pytest

from storage.core.blobs import open_blob_store


@pytest.fixture
def store(blob_url, moto_endpoint):
    return open_blob_store(blob_url, endpoint_url=moto_endpoint)


def test_put_get_exists_delete(store):
    assert not store.exists("a/b/c.bin")
    assert store.put("a/b/c.bin", b"hello") is True
    assert store.exists("a/b/c.bin")
    assert store.get("a/b/c.bin") == b"hello"
    assert store.put("a/b/c.bin", b"again") is True  # plain put overwrites
    assert store.get("a/b/c.bin") == b"again"
    store.delete("a/b/c.bin")
    store.delete("a/b/c.bin")  # deleting twice is fine
    assert not store.exists("a/b/c.bin")


def test_missing_key_is_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        store.get("no/such/key")


def test_put_if_absent_keeps_the_first_write(store):
    assert store.put("k/x", b"first", if_absent=True) is True
    assert store.put("k/x", b"second", if_absent=True) is False
    assert store.get("k/x") == b"first"


def test_concurrent_put_if_absent_has_exactly_one_winner(store):
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def put(i: int) -> None:
        barrier.wait()
        results.append(store.put("race/key", f"writer-{i}".encode(), if_absent=True))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    assert store.get("race/key").startswith(b"writer-")


def test_list_is_by_prefix_and_sorted(store):
    keys = ["v1/t/c1/s1/a/000000000001.json.zst", "v1/t/c1/s1/a/000000000000.json.zst",
            "v1/t/c1/s2/a/000000000000.json.zst", "v1/t/c2/s1/a/000000000000.json.zst"]  # fmt: skip
    for k in keys:
        store.put(k, b"x")
    assert list(store.list("v1/t/c1/s1/")) == sorted(keys[:2])
    assert list(store.list("v1/t/c1/")) == sorted(keys[:3])
    assert list(store.list("v1/")) == sorted(keys)
    assert list(store.list("v1/other/")) == []


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/abs", "a//b", "a/./b", ""])
def test_keys_cannot_escape_the_store(store, key):
    with pytest.raises(ValueError):
        store.put(key, b"x")


def test_ping(store):
    store.ping()


def test_unreachable_s3_raises_connection_error():
    store = open_blob_store("s3://bucket/p", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(ConnectionError):
        store.put("a", b"x")
    with pytest.raises(ConnectionError):
        store.ping()


def test_unsupported_url():
    with pytest.raises(ValueError):
        open_blob_store("ftp://x/y")


def test_s3_puts_are_signed_for_an_endpoint_that_checks(monkeypatch):
    """Puts go out signed (SigV4, as MinIO and AWS check it), not only accepted by a lenient
    endpoint: moto's server with its authentication on takes the store's puts under a real
    access key, keys with spaces and '+' included, and refuses them under a wrong secret."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import boto3
    import requests

    from storage.core.blobs import S3BlobStore
    from tests.dask.conftest import free_port, wait_until

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    moto = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def up() -> bool:
            try:
                return requests.get(url + "/moto-api/", timeout=1).ok
            except requests.RequestException:
                return False

        wait_until(up, 30, "moto's server to start")
        # The first four requests go unchecked: a user, its policy, its key, the bucket.
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")  # fmt: skip
        iam.create_user(UserName="hindsight")
        iam.put_user_policy(UserName="hindsight", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        ))  # fmt: skip
        key = iam.create_access_key(UserName="hindsight")["AccessKey"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="signed")

        for proxy in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(proxy, raising=False)
        store = S3BlobStore("signed", "p", endpoint_url=url)
        assert store._put is not None  # the lean path (storage.core.blobs._PathStylePut) is tested
        assert store.put("a/b c+d~e.json", b"first", if_absent=True) is True
        assert store.put("a/b c+d~e.json", b"second", if_absent=True) is False
        assert store.get("a/b c+d~e.json") == b"first"

        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"][::-1])
        with pytest.raises(ConnectionError, match="403"):
            S3BlobStore("signed", "p", endpoint_url=url).put("x", b"1")
    finally:
        moto.terminate()
        moto.wait(10)
