"""the per-run tables partitioned by ranges of run ids (Postgres)

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29 17:00:00

``storage.core.partitions`` (decision 0038): each of the per-run tables becomes
``PARTITION BY RANGE (run_id)``, with ranges of 2**20 run ids up to two beyond the newest
run and a default partition; its rows are copied over once. Names (the table, its primary
key, its foreign key) stay, so the code and the models do not change. SQLite keeps plain
tables. The downgrade copies the rows back into plain tables.
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


def _rebuild(table: str, partitioned: bool) -> None:
    """``table`` as a new table (partitioned or not), its rows copied, its names kept."""
    ex = op.execute
    keys = _keys(table)
    old = f"{table}_old"
    ex(f'ALTER TABLE "{table}" RENAME TO "{old}"')
    ex(f'ALTER TABLE "{old}" RENAME CONSTRAINT "pk_{table}" TO "pk_{old}"')
    ex(f'ALTER TABLE "{old}" RENAME CONSTRAINT "fk_{table}_run_id_runs" TO "fk_{old}_run_id_runs"')
    how = " PARTITION BY RANGE (run_id)" if partitioned else ""
    ex(f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS INCLUDING STORAGE){how}')
    ex(f'ALTER TABLE "{table}" ADD CONSTRAINT "pk_{table}" PRIMARY KEY ({keys})')
    ex(
        f'ALTER TABLE "{table}" ADD CONSTRAINT "fk_{table}_run_id_runs" FOREIGN KEY (run_id) '
        "REFERENCES runs (id) ON DELETE CASCADE"
    )
    if partitioned:
        top = op.get_bind().execute(sa.text("SELECT coalesce(max(id), 0) + 1 FROM runs")).scalar()
        hi = 0
        while hi < top + (AHEAD - 1) * WIDTH:
            ex(
                f'CREATE TABLE "{table}_r{hi}" PARTITION OF "{table}" '
                f"FOR VALUES FROM ({hi}) TO ({hi + WIDTH})"
            )
            hi += WIDTH
        ex(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT')
    ex(f'INSERT INTO "{table}" SELECT * FROM "{old}"')
    ex(f'DROP TABLE "{old}"')


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        _rebuild(table, partitioned=True)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        _rebuild(table, partitioned=False)
