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

- :func:`ensure` keeps the ranges of the next ``WIDTH`` run ids to be handed out made
  (the migration makes the first ranges, the finish workers keep them coming). A row that
  finds no range (the workers stopped for a million runs, say) lands in the default
  partition; the next range made over it takes its rows out of it.
- :func:`drop_expired` is retention's fast path: a range whose every run is in the
  sessions being removed is detached and dropped whole, a catalog change, before the
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

from storage.core import locks

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
_BOUND = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")


def _lock(conn: Connection, tables: Iterable[str]) -> None:
    """Lock ``runs``, then ``tables``, for a change of their partitions; the caller owns the
    transaction. A partition's foreign key takes ``runs`` too, and ingest takes ``runs``
    (a run's row) before the per-run tables (its rows): taking them in the same order, and
    the tables without waiting once ``runs`` is held (a finisher may hold one and want
    ``runs`` next), no lock cycle can form. Raises :class:`Busy` instead of waiting long."""
    try:
        conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
        conn.execute(text("LOCK TABLE runs IN SHARE ROW EXCLUSIVE MODE"))
        for table in tables:
            conn.execute(text(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE NOWAIT'))
    except OperationalError as exc:
        if getattr(exc.orig, "pgcode", None) in _BUSY:
            raise Busy(", ".join(tables)) from exc
        raise


def top(conn: Connection) -> int:
    """One past the highest run id handed out: the sequence's (a run being inserted has
    taken its id before anyone sees its row), or the rows' if ids were placed by hand."""
    return conn.execute(
        text(
            "SELECT greatest((SELECT coalesce(max(id), 0) FROM runs), "
            "(SELECT last_value - (NOT is_called)::int FROM runs_id_seq)) + 1"
        )
    ).scalar_one()


class Busy(Exception):
    """A table's partitions could not be changed now: its locks are held."""


def partitioned(conn: Connection) -> bool:
    """Whether this index partitions its per-run tables (Postgres, migrated past 0023).
    False too while a migration runs: the tables may be changing under it, and the
    migration waits for the caller's transaction to end before it starts."""
    if conn.dialect.name != "postgresql":
        return False
    if not conn.execute(
        text("SELECT pg_try_advisory_xact_lock_shared(:k)"), {"k": locks.UPGRADE}
    ).scalar():
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


def _gap(parts: list[tuple[str, int, int]], run_id: int, width: int) -> tuple[int, int] | None:
    """The range to make for ``run_id``: its ``width``-aligned stretch, clipped to the
    ranges beside it; None if a range holds it already."""
    lo, hi = run_id - run_id % width, run_id - run_id % width + width
    for _, a, b in parts:
        if a <= run_id < b:
            return None
        if b <= run_id:
            lo = max(lo, b)
        else:
            hi = min(hi, a)
    return lo, hi


def _make(conn: Connection, table: str, made: list[tuple[int, int]]) -> None:
    """Add the partitions ``made`` (lo, hi) to ``table``, moving into them any rows the
    default partition took for them. The caller owns the transaction and the locks."""
    default = f"{table}_default"
    where = " OR ".join(f"(run_id >= {lo} AND run_id < {hi})" for lo, hi in made)
    stray = conn.execute(text(f'SELECT 1 FROM "{default}" WHERE {where} LIMIT 1')).first()
    if stray is not None:
        # Postgres will not add a range over rows the default holds (and reads the whole
        # default for each range it adds): take the default out once, add the ranges, move
        # the rows, put the default back (one more read of it).
        conn.execute(text(f'ALTER TABLE "{table}" DETACH PARTITION "{default}"'))
    for lo, hi in made:
        conn.execute(
            text(
                f'CREATE TABLE "{table}_r{lo}" PARTITION OF "{table}" '
                f"FOR VALUES FROM ({lo}) TO ({hi})"
            )
        )
    if stray is not None:
        conn.execute(text(f'INSERT INTO "{table}" SELECT * FROM "{default}" WHERE {where}'))
        conn.execute(text(f'DELETE FROM "{default}" WHERE {where}'))
        conn.execute(text(f'ALTER TABLE "{table}" ATTACH PARTITION "{default}" DEFAULT'))


def ensure(engine: Engine, *, width: int = WIDTH, ahead: int = AHEAD) -> int:
    """Give every partitioned table the ranges it needs: those of the next
    ``(ahead - 1) * width`` run ids to be handed out, and those of the rows its default
    partition took; how many partitions were made. A stretch of ids no run took (the
    sequence set ahead, say) gets no partition. A table a transaction, under
    :func:`_lock`; one whose locks are not had at once (see :func:`_lock`) waits for
    the next pass."""
    made = 0
    for table in TABLES:
        try:
            with engine.begin() as conn:
                if not partitioned(conn):
                    return made
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": locks.PARTITIONS})
                first = top(conn)
                end = first + (ahead - 1) * width  # the ids to keep made: first <= id < end
                wanted = {first, max(first, end - 1)}
                wanted.update(range(first - first % width + width, end, width))
                # the lowest row of each stretch the default holds
                wanted.update(
                    conn.execute(
                        text(f'SELECT min(run_id) FROM "{table}_default" GROUP BY run_id / :w'),
                        {"w": width},
                    ).scalars()
                )
                parts = ranges(conn, table)
                new: list[tuple[int, int]] = []
                for run_id in sorted(wanted):
                    gap = _gap(parts, run_id, width)
                    if gap is not None:
                        new.append(gap)
                        parts = sorted([*parts, ("", *gap)], key=lambda r: r[1])
                if not new:
                    continue
                _lock(conn, [table])
                _make(conn, table, new)
                made += len(new)
        except Busy:
            logger.info("partitions: %s is busy; its next ranges wait for the next pass", table)
    return made


def drop_expired(engine: Engine, session_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Drop every range whose runs are all in ``session_ids`` (or gone), below the newest
    run, from every table; the (lo, hi) of each range dropped. A range whose locks are not
    had at once (see :func:`_lock`) stays: the sessions' deletion removes its rows as it
    always did."""
    ids = sorted(set(session_ids))
    # Read under ``runs``'s lock, the top is final: every insert that took an id below it
    # has ended (an insert holds a lock that excludes this one from its start), and no run
    # can join a range below it. So the look that follows holds no lock: ingest goes on.
    try:
        with engine.begin() as conn:
            if not partitioned(conn):
                return []
            _lock(conn, [])
            below = top(conn)
    except Busy:
        logger.info("retention: runs is busy; expired ranges' rows go one by one")
        return []
    kept_sql = text(
        "SELECT 1 FROM runs WHERE id >= :lo AND id < :hi AND session_id <> ALL(:ids) LIMIT 1"
    )
    with engine.connect() as conn:
        bounds = sorted({(lo, hi) for table in TABLES for _, lo, hi in ranges(conn, table)})
        expired = [
            (lo, hi)
            for lo, hi in bounds
            if hi <= below
            and conn.execute(kept_sql, {"lo": lo, "hi": hi, "ids": ids}).first() is None
        ]
    dropped = []
    for lo, hi in expired:
        try:
            with engine.begin() as conn:
                if not partitioned(conn):  # a migration under way, or done meanwhile
                    break
                _lock(conn, TABLES)
                for table in TABLES:
                    # another retention pass may have dropped it meanwhile
                    name = next((n for n, a, b in ranges(conn, table) if (a, b) == (lo, hi)), None)
                    if name is not None:
                        conn.execute(text(f'ALTER TABLE "{table}" DETACH PARTITION "{name}"'))
                        conn.execute(text(f'DROP TABLE "{name}"'))
            dropped.append((lo, hi))
        except Busy:
            logger.info("retention: range %s-%s is busy; its rows go one by one", lo, hi)
    return dropped


_PARTITION_NAME = re.compile(rf"^({'|'.join(TABLES)})_(r\d+|default)$")


def is_partition(name: str) -> bool:
    """Whether ``name`` is one of the partitions this module makes (not a table of the
    models: schema comparisons leave them out)."""
    return _PARTITION_NAME.match(name) is not None
