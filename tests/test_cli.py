"""The `hindsight` command as a user runs it: serve, tokens create, db upgrade, reindex."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from hindsight.sender import Sender
from tests.helpers import example, example_bytes, short_body_answer

HINDSIGHT = [sys.executable, "-m", "hindsight.cli"]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    e.update(extra)
    return e


def run(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HINDSIGHT, *args], capture_output=True, text=True, timeout=120, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, data_dir: Path, *extra: str, environ: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*HINDSIGHT, "serve", "--data-dir", str(data_dir), "--port", str(self.port), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ or env(),
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited: {self.proc.stdout.read()}")
            try:
                if requests.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                time.sleep(0.05)  # polling for the port to open, bounded by the deadline
        raise AssertionError("serve did not become ready in 60 s")

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return out


def test_a_restarted_server_finishes_the_run_a_kill_left_claimed(tmp_path):
    """``hindsight serve`` killed while finishing a run left the
    job claimed (a 10-minute lease then): restarted, the server, the index's only worker,
    waited it out, the run without lake rows meanwhile. It frees its own claims on start."""
    import sqlite3

    server = Served(tmp_path)
    try:
        with Sender(server.url) as sender:
            assert sender.send(example_bytes()).status == 202
        (run,) = requests.get(server.url + "/v1/runs", timeout=10).json()["runs"]

        def finished_work() -> dict:
            return requests.get(f"{server.url}/v1/runs/{run['id']}", timeout=10).json()[
                "finished_work"
            ]

        deadline = time.monotonic() + 60
        while finished_work()["pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not finished_work()["pending"]
    finally:
        server.stop()
    # What a kill -9 mid-job leaves: the job, claimed for its lease.
    with sqlite3.connect(tmp_path / "index.db") as db:
        (run_id,) = db.execute("SELECT id FROM runs").fetchone()
        db.execute("INSERT INTO finish_jobs (run_id, due_at, claimed_until, attempts) "
                   "VALUES (?, ?, ?, 1)", (run_id, time.time() - 5, time.time() + 3600))  # fmt: skip
    server = Served(tmp_path)
    try:
        deadline = time.monotonic() + 30  # the lease had an hour to run
        while finished_work()["pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not finished_work()["pending"]
    finally:
        server.stop()


def test_serve_on_loopback_without_tokens_round_trips_over_http(tmp_path):
    server = Served(tmp_path)
    try:
        with Sender(server.url) as sender:
            resp = sender.send(example_bytes())
            assert resp.status == 202 and resp.body["duplicate"] is False
            again = sender.send(example_bytes(), encoding="gzip")
            assert again.status == 202 and again.body["duplicate"] is True
        runs = requests.get(server.url + "/v1/runs", timeout=10).json()["runs"]
        assert [r["name"] for r in runs] == ["nightly-aggregate"]
        tasks = requests.get(f"{server.url}/v1/runs/{runs[0]['id']}/tasks", timeout=10).json()[
            "tasks"
        ]
        assert len(tasks) == 4
    finally:
        out = server.stop()
    assert f"{server.url}/v1/batches" in out
    assert "DISABLED" in out  # it says it runs without tokens
    assert (tmp_path / "index.db").exists() and (tmp_path / "blobs" / "v1").is_dir()


def test_serve_answers_408_to_a_body_shorter_than_its_content_length(tmp_path):
    """The embedded server, like gunicorn: a body that stops short of its Content-Length gets
    408 after HINDSIGHT_BODY_TIMEOUT (it held a thread until the client hung up), or at once
    when the connection is cut; nothing is stored, and the server goes on serving."""
    server = Served(tmp_path, environ=env(HINDSIGHT_BODY_TIMEOUT="1"))
    try:
        headers = {"Content-Type": "application/json"}
        for route, valid in (("/v1/batches", example_bytes()), ("/v1/ray/events", b"[]")):
            status, body, rest = short_body_answer(server.url, route, headers)
            assert (status, body["error"]["code"], rest) == (408, "body_timeout", b"")
            status, body, _ = short_body_answer(server.url, route, headers, valid,
                                                length=len(valid) + 100, close=True)  # fmt: skip
            assert (status, body["error"]["code"]) == (408, "body_incomplete")
        assert requests.get(server.url + "/v1/runs", timeout=10).json()["runs"] == []
        with Sender(server.url) as sender:
            assert sender.send(example_bytes()).status == 202
    finally:
        server.stop()


def test_the_first_token_of_an_index_that_recorded_without_auth_says_whose_runs_are_whose(
    tmp_path,
):
    """After recording with ``make run``, the first token said it had
    "created a new index" (it had not), and the runs vanished behind auth (they are the
    tenant default's). The note now says what is true."""
    assert run("db", "upgrade", "--data-dir", str(tmp_path), env=env()).returncode == 0
    created = run("tokens", "create", "--tenant", "acme", "--data-dir", str(tmp_path), env=env())
    assert created.returncode == 0, created.stderr
    assert "new index" not in created.stderr
    index = (tmp_path / "index.db").resolve()
    assert f"the first token of the index at {index}" in created.stderr
    assert "runs recorded without auth belong to tenant 'default', not to 'acme'" in created.stderr


def test_tokens_create_then_serve_with_auth_required(tmp_path):
    created = run(
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
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip().splitlines()[-1]
    assert token.startswith("hs_")
    # Run without the service's variables, it made an index of its
    # own in silence (the services answered 401). It says so; the next token, not.
    assert f"created a new index at {(tmp_path / 'index.db').resolve()}" in created.stderr
    again = run("tokens", "create", "--tenant", "acme", "--data-dir", str(tmp_path), env=env())
    assert again.returncode == 0 and "note:" not in again.stderr, again.stderr
    server = Served(tmp_path, environ=env(HINDSIGHT_AUTH="required"))
    try:
        assert Sender(server.url).send(example_bytes()).status == 401
        with Sender(server.url, token=token) as sender:
            assert sender.send(example_bytes()).status == 202
        h = {"Authorization": f"Bearer {token}"}
        assert len(requests.get(server.url + "/v1/runs", headers=h, timeout=10).json()["runs"]) == 1
    finally:
        server.stop()
    # only the hash is at rest
    assert token.encode() not in (tmp_path / "index.db").read_bytes()


def test_serve_refuses_a_public_address_without_auth(tmp_path):
    out = run(
        "serve",
        "--data-dir",
        str(tmp_path),
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        env=env(),
    )
    assert out.returncode != 0 and "no tokens exist" in out.stderr
    out = run("serve", "--data-dir", str(tmp_path), "--host", "0.0.0.0", "--port", str(free_port()),
              env=env(HINDSIGHT_AUTH="disabled"))  # fmt: skip
    assert out.returncode != 0 and "without auth" in out.stderr


def test_tokens_list_and_revoke(tmp_path):
    """A leaked token can be revoked, as the docs say: by its id from ``tokens list``, or by
    the token itself."""
    from storage.core.db import make_engine, make_sessionmaker
    from storage.core.tokens import hash_token, verify_token

    d = ["--data-dir", str(tmp_path)]
    made = [run("tokens", "create", "--tenant", t, "--name", n, *d, env=env()) for t, n in
            (("acme", "ci"), ("acme", "laptop"), ("other", "ops"))]  # fmt: skip
    assert all(m.returncode == 0 for m in made), [m.stderr for m in made]
    ci, laptop, ops = (m.stdout.strip().splitlines()[-1] for m in made)
    listed = run("tokens", "list", "--tenant", "acme", *d, env=env())
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("\t") for line in listed.stdout.strip().splitlines()[1:]]
    assert [(r[1], r[3], r[5]) for r in rows] == [("acme", "ci", "-"), ("acme", "laptop", "-")]
    assert [r[6] for r in rows] == [hash_token(ci)[:8], hash_token(laptop)[:8]]
    by_id = run("tokens", "revoke", rows[1][0], *d, env=env())
    by_token = run("tokens", "revoke", "--token", "-", *d, env=env(), input=ops + "\n")
    assert by_id.returncode == 0 and by_token.returncode == 0, (by_id.stderr, by_token.stderr)
    again = run("tokens", "revoke", "--token", ops, *d, env=env())
    assert again.returncode != 0 and "revoked already" in again.stderr
    engine = make_engine(f"sqlite:///{tmp_path / 'index.db'}")
    with make_sessionmaker(engine).begin() as db:
        assert verify_token(db, ci) is not None
        assert verify_token(db, laptop) is None and verify_token(db, ops) is None
    engine.dispose()
    listed = run("tokens", "list", *d, env=env()).stdout.strip().splitlines()[1:]
    assert [line.split("\t")[5] != "-" for line in listed] == [False, True, True]


def test_tokens_create_rejects_bad_input(tmp_path):
    bad_tenant = run("tokens", "create", "--tenant", "../x", "--data-dir", str(tmp_path), env=env())
    assert bad_tenant.returncode != 0 and "invalid tenant" in bad_tenant.stderr
    bad_scope = run(
        "tokens",
        "create",
        "--tenant",
        "a",
        "--scopes",
        "root",
        "--data-dir",
        str(tmp_path),
        env=env(),
    )
    assert bad_scope.returncode != 0 and "scopes" in bad_scope.stderr


def test_db_upgrade_and_reindex_rebuild_a_deleted_index(tmp_path):
    up = run("db", "upgrade", "--data-dir", str(tmp_path), env=env())
    from storage.core.db import head_revisions

    assert up.returncode == 0 and f"index at revision {head_revisions()[0]}" in up.stdout
    server = Served(tmp_path)
    try:
        with Sender(server.url) as sender:
            for seq in range(3):
                assert sender.send(example_json(seq)).status == 202
        before = requests.get(server.url + "/v1/runs", timeout=10).json()
    finally:
        server.stop()
    for f in tmp_path.glob("index.db*"):
        f.unlink()
    rebuilt = run("reindex", "--data-dir", str(tmp_path), env=env())
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "3 blobs: 3 indexed" in rebuilt.stdout
    # the backfill after revision 0017 has nothing left to move: the finishers moved it
    moved = run("reindex", "--detail", "--data-dir", str(tmp_path), env=env())
    assert moved.returncode == 0, moved.stderr
    assert "0 runs' detail moved into objects" in moved.stdout
    server = Served(tmp_path)
    try:
        after = requests.get(server.url + "/v1/runs", timeout=10).json()
    finally:
        server.stop()
    assert after == before


def example_json(seq: int) -> bytes:
    import json

    return json.dumps(example(seq=seq)).encode()


@pytest.mark.parametrize("module", ["hindsight.cli"])
def test_help(module):
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for command in ("serve", "db", "tokens", "reindex"):
        assert command in out.stdout


def test_commands_that_read_a_servers_data_refuse_a_data_dir_with_none(tmp_path):
    """A mistyped --data-dir (or the wrong working directory)
    made tokens list, reindex and retention create a fresh, empty index there and report
    an empty success. serve took any port number (85036 bound 19500; -5 a traceback)."""
    typo = tmp_path / "hindsight-dat"
    for args in (["tokens", "list"], ["tokens", "revoke", "1"], ["reindex"],
                 ["retention", "apply", "--tenant", "acme", "--max-runs", "1", "--dry-run"]):  # fmt: skip
        out = run(*args, "--data-dir", str(typo), env=env())
        assert out.returncode == 1 and f"nothing at {typo}" in out.stderr, (args, out.stderr)
        assert not typo.exists()
    out = run("serve", "--data-dir", str(tmp_path), "--host", "no-such-host.invalid", env=env())
    assert out.returncode == 1 and "cannot serve on no-such-host.invalid" in out.stderr
    for port in ("85036", "-5"):
        out = run("serve", "--data-dir", str(tmp_path), "--port", port, env=env())
        assert out.returncode == 2 and "Invalid value for '--port'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
