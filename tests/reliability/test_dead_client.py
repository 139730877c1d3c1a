"""A collector killed mid-statement does not leave its locks held for the rest of the
statement: Postgres notices the client is gone (storage.core.db.make_engine)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
from sqlalchemy import text

from storage.core.db import make_engine


@pytest.mark.postgres
def test_a_killed_clients_locks_are_released_while_its_statement_would_still_run(pg_url):
    key = random.randrange(2**40)  # an advisory lock: no table of its own in the index
    # A client that takes the lock, then runs a minute-long statement, and is killed -9.
    code = textwrap.dedent(f"""
        from sqlalchemy import text
        from storage.core.db import make_engine
        with make_engine({pg_url!r}).connect() as c:
            c.execute(text("SELECT pg_advisory_lock({key})"))
            print("locked", flush=True)
            c.execute(text("SELECT pg_sleep(60)"))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    # Without the check its backend sleeps on, lock held, for the rest of the minute.
    engine = make_engine(pg_url)
    with engine.begin() as c:
        c.execute(text("SET LOCAL lock_timeout = '15s'"))
        c.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
    engine.dispose()
