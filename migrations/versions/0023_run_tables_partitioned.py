"""the per-run tables partitioned by ranges of run ids (Postgres)

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29 17:00:00

``storage.core.partitions`` (decision 0038): each of the per-run tables becomes
``PARTITION BY RANGE (run_id)``: the table as it is becomes the partition of every run id
up to the end of the newest run's range of 2**20 (attached, not copied), then ranges
holding at least 2**20 run ids beyond the newest run, and a default partition. Names (the
table, its primary key, its foreign key) stay, so the code and the models do not change.
SQLite keeps plain tables. The downgrade copies the rows back into plain tables.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# as storage.core.partitions has them when this was written
TABLES = (
    "run_prefix_actions",
    "run_prefixes",
    "run_metrics",
    "run_code",
    "run_worker_lists",
    "run_batch_lists",
    "run_status_counts",
)
WIDTH = 1 << 20
AHEAD = 2


def _keys(table: str) -> str:
    cols = sa.inspect(op.get_bind()).get_pk_constraint(table)["constrained_columns"]
    return ", ".join(f'"{c}"' for c in cols)


def _new_table(table: str, like: str, partitioned: bool) -> None:
    """``table`` made like ``like``, with the primary and foreign keys of the models' names."""
    ex = op.execute
    how = " PARTITION BY RANGE (run_id)" if partitioned else ""
    ex(f'CREATE TABLE "{table}" (LIKE "{like}" INCLUDING DEFAULTS INCLUDING STORAGE){how}')
    ex(f'ALTER TABLE "{table}" ADD CONSTRAINT "pk_{table}" PRIMARY KEY ({_keys(like)})')
    ex(
        f'ALTER TABLE "{table}" ADD CONSTRAINT "fk_{table}_run_id_runs" FOREIGN KEY (run_id) '
        "REFERENCES runs (id) ON DELETE CASCADE"
    )


def _partition(table: str, top: int) -> None:
    """``table`` partitioned, its rows left where they are: the table becomes the partition
    of every run id up to the newest run's range (attached, not copied: Postgres only reads
    it to check the bound, and its primary key index is taken as it is)."""
    ex = op.execute
    first = f"{table}_r0"
    hi = -(-top // WIDTH) * WIDTH  # the newest run's range's end
    ex(f'ALTER TABLE "{table}" RENAME TO "{first}"')
    ex(f'ALTER INDEX "pk_{table}" RENAME TO "{first}_pkey"')
    _new_table(table, first, partitioned=True)
    # its foreign key, the same as the parent's, becomes the parent's (no second check)
    ex(f'ALTER TABLE "{table}" ATTACH PARTITION "{first}" FOR VALUES FROM (0) TO ({hi})')
    while hi < top + (AHEAD - 1) * WIDTH:
        ex(
            f'CREATE TABLE "{table}_r{hi}" PARTITION OF "{table}" '
            f"FOR VALUES FROM ({hi}) TO ({hi + WIDTH})"
        )
        hi += WIDTH
    ex(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT')


def _unpartition(table: str) -> None:
    """``table`` a plain table again, its rows copied."""
    ex = op.execute
    old = f"{table}_old"
    ex(f'ALTER TABLE "{table}" RENAME TO "{old}"')
    ex(f'ALTER INDEX "pk_{table}" RENAME TO "pk_{old}"')
    _new_table(table, old, partitioned=False)
    ex(f'INSERT INTO "{table}" SELECT * FROM "{old}"')
    ex(f'DROP TABLE "{old}"')


def _lock_runs() -> None:
    """``runs`` first, as ingest takes it before the per-run tables: taking a table first
    and ``runs`` for its foreign key next deadlocks against a collector still ingesting.
    Held, it also keeps run ids from being handed out while the ranges are drawn."""
    op.execute("LOCK TABLE runs IN SHARE ROW EXCLUSIVE MODE")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _lock_runs()
    # one past the highest run id handed out (the sequence's, as storage.core.partitions.top)
    top = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT greatest((SELECT coalesce(max(id), 0) FROM runs), "
                "(SELECT last_value - (NOT is_called)::int FROM runs_id_seq)) + 1"
            )
        )
        .scalar()
    )
    for table in TABLES:
        _partition(table, top)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _lock_runs()
    for table in TABLES:
        _unpartition(table)
