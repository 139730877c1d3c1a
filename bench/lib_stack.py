"""The full stack for a benchmark: moto's S3 server, a fresh Postgres database, and the
collector under gunicorn, all on one machine, torn down (database dropped) at the end."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.ingest import free_port, wait_ready
from storage.core.db import make_engine, upgrade

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEFAULT_DB = os.environ.get(
    "TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


@dataclass
class Stack:
    url: str  # the collector
    s3_url: str
    db_url: str
    engine: Any
    gunicorn: subprocess.Popen[bytes]
    moto: subprocess.Popen[bytes]

    def s3(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.s3_url,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )


@contextmanager
def full_stack(
    *,
    workers: int = 2,
    threads: int = 4,
    database_url: str = DEFAULT_DB,
    env: dict[str, str] | None = None,
    existing_db: str | None = None,
) -> Iterator[Stack]:
    """moto + a fresh database (migrated) + ``gunicorn collector.app:create_app()``; ``env``
    adds HINDSIGHT_* settings for the collector. ``existing_db`` (a URL): use that database
    as it is instead, and leave it in place."""
    aws = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    base = {**os.environ, **aws}
    procs: list[subprocess.Popen[bytes]] = []
    admin_url = make_url(database_url)
    dbname = f"hindsight_bench_{secrets.token_hex(4)}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    engine = None
    try:
        moto_port = free_port()
        procs.append(
            subprocess.Popen(
                [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(moto_port)],
                env=base,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        s3_url = f"http://127.0.0.1:{moto_port}"
        wait_ready(s3_url + "/moto-api/", procs[-1])
        boto3.client(
            "s3",
            endpoint_url=s3_url,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        ).create_bucket(Bucket="bench")
        if existing_db:
            db_url = existing_db
            engine = make_engine(db_url)
        else:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{dbname}"'))
            db_url = admin_url.set(database=dbname).render_as_string(hide_password=False)
            engine = make_engine(db_url)
            upgrade(engine)
        port = free_port()
        genv = {
            **base,
            "HINDSIGHT_DATABASE_URL": db_url,
            "HINDSIGHT_BLOB_URL": "s3://bench/hindsight",
            "HINDSIGHT_S3_ENDPOINT_URL": s3_url,
            "HINDSIGHT_AUTH": "required",
            "HINDSIGHT_AUTO_UPGRADE": "false",
            "HINDSIGHT_LOG_LEVEL": "WARNING",
            "HINDSIGHT_ACCESS_LOG": "false",
            **(env or {}),
        }
        gunicorn = subprocess.Popen(
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
                f"127.0.0.1:{port}",
                "--log-level",
                "warning",
                "collector.app:create_app()",
            ],
            env=genv,
            cwd=ROOT,
        )
        procs.append(gunicorn)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readyz", gunicorn)
        yield Stack(url, s3_url, db_url, engine, gunicorn, procs[0])
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if engine is not None:
            engine.dispose()
        if not existing_db:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
        admin.dispose()
