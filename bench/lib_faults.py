"""Pieces of the fault runs (bench/faults_run.py, tests/reliability/test_faults.py): a
fault-injecting S3 proxy, the real collector under gunicorn, real agents, and the audit that
checks "every acknowledged batch stored and indexed exactly once".

Everything runs on loopback, is bounded in count and time, and stops by itself.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import requests
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.lib_proc import rss_bytes
from bench.lib_workload import task_events
from hindsight.agent import Agent
from hindsight.config import Settings

ROOT = Path(__file__).resolve().parent.parent

BIN = Path(sys.executable).parent
logger = logging.getLogger(__name__)

S3_ERRORS = {
    500: b"<?xml version='1.0'?><Error><Code>InternalError</Code>"
    b"<Message>injected</Message></Error>",
    503: b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>injected</Message></Error>",
}


class FlakyS3Proxy:
    """An HTTP proxy in front of an S3 endpoint that fails ``fail_rate`` of the requests:

    - ``500`` / ``503``: answered with an S3 error, never forwarded;
    - ``reset``: the connection is closed before anything is forwarded;
    - ``lost``: forwarded (the write happens) and then the answer is dropped: the client
      sees a failure for a request that succeeded, the case that makes retries dangerous.
    """

    FAULTS = ("500", "503", "reset", "lost")

    def __init__(self, target: str, fail_rate: float = 0.7, seed: int = 0) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._draw()
                if fault in ("500", "503"):
                    payload = S3_ERRORS[int(fault)]
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if fault == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                if fault == "lost":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients dropping connections is what this proxy is for

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="flaky-s3"
        )
        self._thread.start()

    def _draw(self) -> str:
        with self._lock:
            fault = self.rng.choice(self.FAULTS) if self.rng.random() < self.fail_rate else "ok"
            self.counts[fault] += 1
            return fault

    def _forward(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.target, timeout=30)
        try:
            fwd = {k: v for k, v in headers.items() if k.lower() not in ("connection",)}
            conn.request(method, path, body=body or None, headers=fwd)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.05
) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(step)


def http_ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "faults",
    "AWS_SECRET_ACCESS_KEY": "faults",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server as a subprocess on loopback; yields its URL."""
    for k, v in AWS_ENV.items():  # this process's own S3 clients (the audit) need them too
        os.environ.setdefault(k, v)
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **AWS_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(url + "/moto-api/"), 60, "moto_server up")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def make_bucket(endpoint: str) -> str:
    name = f"faults-{secrets.token_hex(4)}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="faults",
        aws_secret_access_key="faults",
    ).create_bucket(Bucket=name)
    return name


@contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    """A new Postgres database migrated to head; dropped afterwards."""
    from storage.core.db import upgrade

    # pool_pre_ping: the pg-restart scenario breaks this pooled connection mid-run.
    admin = create_engine(make_url(admin_url), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    name = f"hindsight_faults_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()


def make_token(db_url: str, tenant: str) -> str:
    from storage.core.db import make_engine, make_sessionmaker
    from storage.core.tokens import create_token

    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine).begin() as db:
            return create_token(db, tenant, "ingest,read")
    finally:
        engine.dispose()


class Gunicorn:
    """A real service under gunicorn (``services/gunicorn_conf.py``) on loopback: the
    collector unless ``app`` names another."""

    def __init__(
        self,
        env: dict[str, str],
        workers: int = 2,
        threads: int = 4,
        app: str = "collector.app:create_app()",
        args: tuple[str, ...] = (),
        log: Any = None,
    ) -> None:
        """``log``: a file the server's stdout and stderr go to (else this process's)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                str(BIN / "gunicorn"),
                "--config",
                "python:services.gunicorn_conf",
                "--workers",
                str(workers),
                "--worker-class",
                "gthread",
                "--threads",
                str(threads),
                "--bind",
                f"127.0.0.1:{self.port}",
                "--log-level",
                "warning",
                "--graceful-timeout",
                "5",
                *args,
                app,
            ],
            env={**os.environ, **AWS_ENV, **env},
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
        wait_until(lambda: http_ok(self.url + "/readyz"), 60, f"{app} ready")

    def workers(self) -> list[int]:
        try:
            path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            return [int(c) for c in path.read_text().split()]
        except OSError:
            return []

    def kill_worker(self, rng: random.Random) -> int | None:
        """kill -9 one worker (gunicorn's master starts a new one)."""
        pids = self.workers()
        if not pids:
            return None
        pid = rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def rss(self) -> int:
        return rss_bytes([self.proc.pid, *self.workers()])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def collector_env(db_url: str, blob_url: str, s3_endpoint: str, **extra: str) -> dict[str, str]:
    return {
        "HINDSIGHT_DATABASE_URL": db_url,
        "HINDSIGHT_BLOB_URL": blob_url,
        "HINDSIGHT_S3_ENDPOINT_URL": s3_endpoint,
        "HINDSIGHT_AUTH": "required",
        "HINDSIGHT_AUTO_UPGRADE": "false",
        "HINDSIGHT_LOG_LEVEL": "WARNING",
        "HINDSIGHT_ACCESS_LOG": "false",
        "HINDSIGHT_RETRY_AFTER": "1",
        **extra,
    }


def event_pool(n: int = 5000, seed: int = 0) -> list[dict[str, Any]]:
    """Dask-shaped task events to add (reused: each batch encodes its own copy)."""
    return task_events(n, first=0, run="run-0", t0=1.8e9, rng=random.Random(seed))


@dataclass
class Load:
    """Several real agents (hindsight.agent.Agent), each adding ``events_each`` events."""

    url: str
    token: str
    agents: int
    events_each: int
    spool_dir: str
    cluster: str = "faults"
    flush_events: int = 5000
    made: list[Any] = field(default_factory=list)

    def run(self, timeout: float) -> dict[str, Any]:
        """Add everything, close every agent (final batch), return what each acknowledged."""
        pool = event_pool(self.flush_events)
        settings = Settings(
            url=self.url,
            token=self.token,
            cluster=self.cluster,
            spool_dir=self.spool_dir,
            flush_events=self.flush_events,
            flush_interval=0.5,
            buffer_events=4 * self.flush_events,
            close_timeout=timeout,
            request_timeout=10.0,
        )

        def produce(agent: Any) -> None:
            added = 0
            while added < self.events_each:
                # Keep the buffer from overflowing: wait (bounded) while the agent is behind.
                wait_until(
                    lambda: agent.pending() < 2 * self.flush_events,
                    timeout,
                    f"agent {agent.name} draining",
                    step=0.01,
                )
                for ev in pool[: min(len(pool), self.events_each - added)]:
                    agent.add(ev)
                    added += 1

        self.made = [
            Agent(settings, session="faults-session", name=f"agent{i}") for i in range(self.agents)
        ]
        threads = [threading.Thread(target=produce, args=(a,)) for a in self.made]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        closers = [threading.Thread(target=a.close, args=(timeout,)) for a in self.made]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout + 5)
        return {
            a.name: {
                "events": a.stats["sent_events"],
                "batches": a.stats["sent_batches"],
                "retries": a.stats["retries"],
                "pending": a.pending(),
                "dropped": {k: v for k, v in a._all_dropped().items() if v},
            }
            for a in self.made
        }


def audit(db_url: str, blobs: Any, tenant: str, sent: dict[str, Any]) -> dict[str, Any]:
    """Compare what the agents had acknowledged with the blob store and the index.

    Exactly once: one blob per (agent, seq), one manifest row per blob, the index's per-agent
    counters equal to what the agent sent, and every sequence complete (0..final, no gaps).
    """
    from storage.core.batches import decode_stored, parse_blob_key
    from storage.core.db import make_engine

    blob_events: Counter[str] = Counter()
    blob_batches: Counter[str] = Counter()
    seqs: dict[str, set[int]] = {}
    for key in blobs.list(f"v1/{tenant}/"):
        ident = parse_blob_key(key)
        assert ident is not None, key
        batch = decode_stored(blobs.get(key))
        blob_events[ident.agent] += len(batch.events)
        blob_batches[ident.agent] += 1
        seqs.setdefault(ident.agent, set()).add(ident.seq)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT a.name, a.batches, a.events, a.max_seq, a.final_seq, "
                    # the manifest's rows and its collapsed chunks (decision 0037)
                    "(SELECT count(*) FROM batches b WHERE b.agent_id = a.id) + "
                    "(SELECT coalesce(sum(c.batches), 0) FROM manifest_chunks c "
                    " WHERE c.agent_id = a.id), "
                    "(SELECT coalesce(sum(b.events), 0) FROM batches b WHERE b.agent_id = a.id) + "
                    "(SELECT coalesce(sum(c.events), 0) FROM manifest_chunks c "
                    " WHERE c.agent_id = a.id) "
                    "FROM agents a JOIN sessions s ON s.id = a.session_id "
                    "JOIN clusters c ON c.id = s.cluster_id JOIN tenants t ON t.id = c.tenant_id "
                    "WHERE t.name = :tenant"
                ),
                {"tenant": tenant},
            ).all()
    finally:
        engine.dispose()
    index = {r[0]: r[1:] for r in rows}
    problems = []
    for agent, acked in sent.items():
        n_batches, n_events, max_seq, final_seq, manifest, manifest_events = index.get(
            agent, (0, 0, -1, None, 0, 0)
        )
        expect = {
            "blob events": (blob_events[agent], acked["events"]),
            "blob batches": (blob_batches[agent], acked["batches"]),
            "index batches": (n_batches, acked["batches"]),
            "index events": (n_events, acked["events"]),
            "manifest rows": (manifest, acked["batches"]),
            "manifest events": (int(manifest_events), acked["events"]),
            "complete (max_seq + 1)": (max_seq + 1, acked["batches"]),
            "final seq": (final_seq, acked["batches"] - 1),
            "seqs 0..n-1": (sorted(seqs.get(agent, ())), list(range(acked["batches"]))),
            "nothing pending or dropped": ((acked["pending"], acked["dropped"]), (0, {})),
        }
        for what, (got, want) in expect.items():
            if got != want:
                problems.append(f"{agent}: {what}: {str(got)[:80]} != {str(want)[:80]}")
    return {
        "agents": len(sent),
        "events": sum(s["events"] for s in sent.values()),
        "batches": sum(s["batches"] for s in sent.values()),
        "retries": sum(s["retries"] for s in sent.values()),
        "problems": problems,
    }
