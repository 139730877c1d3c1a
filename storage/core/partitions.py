"""The per-run tables on Postgres, partitioned by ranges of run ids (decision 0038).

A run's summaries (``TABLES``) are most of what the index holds at rest, and retention
used to delete them row by row. Each of these tables is a partitioned table on Postgres,
``PARTITION BY RANGE (run_id)``, one partition a ``WIDTH`` of run ids
(``<table>_r<lo>``), and a default partition that takes any row no range holds.

Why run ids and not months: ids come from one sequence, so a range of them is the runs
first seen in one stretch of time, and a run never changes partition (its start time can
move earlier when a late batch arrives: by month it would move rows). And ``run_id``
is already the first column of every key of these tables, as Postgres wants of a
partitioned table's unique indexes.

- :func:`ensure` keeps at least a range's worth of run ids made beyond the newest run
  (the migration makes the first ranges, the finish workers keep them coming). A row that
  finds no range (the workers stopped for a million runs, say) lands in the default
  partition; the next range made over it takes its rows out of it.
- :func:`drop_expired` is retention's fast path: a range whose every run is in the
  sessions being removed is detached and dropped whole, in milliseconds, before the
  sessions' rows go (their cascade then finds nothing there).

SQLite (the embedded default) keeps plain tables: every function here is a no-op on it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError

logger = logging.getLogger(__name__)

#: The per-run tables partitioned by run id: ~4.2 KB of a run's ~6 KB in the index.
TABLES = (
    "run_prefix_actions",
    "run_prefixes",
    "run_metrics",
    "run_code",
    "run_worker_lists",
    "run_batch_lists",
    "run_status_counts",
)

#: Run ids a partition: at 2.8 M runs a month, a partition is ~11 days of runs.
WIDTH = 1 << 20
#: Room kept made beyond the newest run: ``AHEAD - 1`` widths of run ids.
AHEAD = 2
#: How long a partition change waits for ``runs`` before it gives up until the next pass:
#: the lock it takes there holds ingest back while it waits (see :func:`_lock`).
LOCK_TIMEOUT = "2s"

# Postgres's "lock not available" (NOWAIT, lock_timeout) and "deadlock detected"
_BUSY = ("55P03", "40P01")
# serialises the collectors' ensure passes (any constant; not the upgrade lock's)
_LOCK = 0x68733F5A
_BOUND = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")


def _lock(conn: Connection, table: str) -> None:
    """Lock ``runs``, then ``table``, for a change of its partitions; the caller owns the
    transaction. A partition's foreign key takes ``runs`` too, and ingest takes ``runs``
    (a run's row) before the per-run tables (its rows): taking them in the same order, and
    ``table`` without waiting once ``runs`` is held (a finisher may hold it and want
    ``runs`` next), no lock cycle can form. Raises :class:`Busy` instead of waiting long."""
    try:
        conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
        conn.execute(text("LOCK TABLE runs IN SHARE ROW EXCLUSIVE MODE"))
        conn.execute(text(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE NOWAIT'))
    except OperationalError as exc:
        if getattr(exc.orig, "pgcode", None) in _BUSY:
            raise Busy(table) from exc
        raise


class Busy(Exception):
    """A table's partitions could not be changed now: its locks are held."""


def partitioned(conn: Connection) -> bool:
    """Whether this index partitions its per-run tables (Postgres, migrated past 0023)."""
    if conn.dialect.name != "postgresql":
        return False
    kind = conn.execute(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"), {"t": TABLES[0]}
    ).scalar()
    return kind == "p"


def ranges(conn: Connection, table: str) -> list[tuple[str, int, int]]:
    """The range partitions of ``table``: (name, lo, hi), run ids lo <= id < hi, by lo."""
    out = []
    for name, bound in conn.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:t)"
        ),
        {"t": table},
    ):
        found = _BOUND.search(bound)
        if found:
            out.append((name, int(found.group(1)), int(found.group(2))))
    return sorted(out, key=lambda r: r[1])


def create_range(conn: Connection, table: str, lo: int, hi: int) -> None:
    """Add the partition of run ids ``lo <= id < hi`` to ``table``, moving into it any rows
    the default partition took for them. The caller owns the transaction."""
    name, default = f"{table}_r{lo}", f"{table}_default"
    stray = conn.execute(
        text(f'SELECT 1 FROM "{default}" WHERE run_id >= :lo AND run_id < :hi LIMIT 1'),
        {"lo": lo, "hi": hi},
    ).first()
    if stray is None:
        conn.execute(
            text(f'CREATE TABLE "{name}" PARTITION OF "{table}" FOR VALUES FROM ({lo}) TO ({hi})')
        )
        return
    # Postgres will not add a range over rows the default holds: take the default out,
    # add the range, move the rows, put the default back, all under the table's lock.
    conn.execute(text(f'ALTER TABLE "{table}" DETACH PARTITION "{default}"'))
    conn.execute(
        text(f'CREATE TABLE "{name}" PARTITION OF "{table}" FOR VALUES FROM ({lo}) TO ({hi})')
    )
    where = "run_id >= :lo AND run_id < :hi"
    conn.execute(
        text(f'INSERT INTO "{table}" SELECT * FROM "{default}" WHERE {where}'),
        {"lo": lo, "hi": hi},
    )
    conn.execute(text(f'DELETE FROM "{default}" WHERE {where}'), {"lo": lo, "hi": hi})
    conn.execute(text(f'ALTER TABLE "{table}" ATTACH PARTITION "{default}" DEFAULT'))


def ensure(engine: Engine, *, width: int = WIDTH, ahead: int = AHEAD) -> int:
    """Give every partitioned table ranges holding at least ``ahead - 1`` widths of run ids
    beyond the newest run; how many partitions were made. One partition a transaction,
    under :func:`_lock`: held for a statement's time, one table at a time. Locks not had
    at once (see :func:`_lock`) leave the rest to the next pass."""
    made = 0
    for table in TABLES:
        while True:
            try:
                with engine.begin() as conn:
                    if not partitioned(conn):
                        return made
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK})
                    top = conn.execute(text("SELECT coalesce(max(id), 0) + 1 FROM runs")).scalar()
                    hi = max((h for _, _, h in ranges(conn, table)), default=0)
                    if hi >= top + (ahead - 1) * width:
                        break
                    _lock(conn, table)
                    create_range(conn, table, hi, hi + width)
                    made += 1
            except Busy:
                logger.info("partitions: %s is busy; its next range waits for the next pass", table)
                return made
    return made


def drop_expired(engine: Engine, session_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Drop every range whose runs are all in ``session_ids`` (or gone), below the newest
    run; the (lo, hi) of each range dropped from every table. A table whose locks are not
    had at once (see :func:`_lock`) keeps its partition: the sessions' deletion removes its
    rows as it always did."""
    ids = sorted(set(session_ids))
    kept_sql = text(
        "SELECT 1 FROM runs WHERE id >= :lo AND id < :hi AND session_id <> ALL(:ids) LIMIT 1"
    )
    dropped: set[tuple[int, int]] = set()
    # a first look without the locks, once a range (the tables share them): a range with a
    # kept run is passed over at once
    expired: dict[tuple[int, int], bool] = {}
    with engine.connect() as conn:
        if not partitioned(conn):
            return []
        top = conn.execute(text("SELECT coalesce(max(id), 0) FROM runs")).scalar()
        parts = {table: ranges(conn, table) for table in TABLES}
        for lo, hi in {(lo, hi) for table_parts in parts.values() for _, lo, hi in table_parts}:
            expired[(lo, hi)] = (
                hi <= top
                and conn.execute(kept_sql, {"lo": lo, "hi": hi, "ids": ids}).first() is None
            )
    for table in TABLES:
        for name, lo, hi in parts[table]:
            if not expired[(lo, hi)]:
                continue
            try:
                with engine.begin() as conn:
                    # Under the locks no run is added nor written to: the look again is final.
                    _lock(conn, table)
                    if conn.execute(kept_sql, {"lo": lo, "hi": hi, "ids": ids}).first():
                        continue
                    conn.execute(text(f'ALTER TABLE "{table}" DETACH PARTITION "{name}"'))
                    conn.execute(text(f'DROP TABLE "{name}"'))
                dropped.add((lo, hi))
            except Busy:
                logger.info("retention: %s is busy; its rows go one by one", name)
    return sorted(dropped)


_PARTITION_NAME = re.compile(rf"^({'|'.join(TABLES)})_(r\d+|default)$")


def is_partition(name: str) -> bool:
    """Whether ``name`` is one of the partitions this module makes (not a table of the
    models: schema comparisons leave them out)."""
    return _PARTITION_NAME.match(name) is not None
