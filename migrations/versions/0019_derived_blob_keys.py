"""batches.blob_key: stored only where the batch's names do not give it

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29 10:40:00

A batch's blob key is ``v1/{tenant}/{cluster}/{session}/{agent}/{seq:012d}.json.zst``
(``storage.core.batches.blob_key``), all of which the manifest already names through its
agent row: storing it cost ~100 bytes of each row's ~250. An empty key now means the key
the names give; the upgrade empties every stored key equal to it (a key written
otherwise, e.g. a sequence number of more than 12 digits, stays). Readers go through
``storage.runs.packed.keyed``. The downgrade writes the keys back. The column stays NOT
NULL: making it nullable rebuilds the table on SQLite, and dropping the old table there
cascades to every row that references a batch.
"""

from __future__ import annotations

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _derived() -> str:
    """The key the names give, in SQL, for the row of ``batches`` in the outer query (a
    sequence number of more than 12 digits is cut by either padding: never equal)."""
    if op.get_bind().dialect.name == "postgresql":
        seq = "lpad(CAST(batches.seq AS TEXT), 12, '0')"
    else:
        seq = "substr('000000000000' || batches.seq, -12, 12)"
    return f"""(SELECT 'v1/' || t.name || '/' || c.name || '/' || s.name || '/' || a.name
                || '/' || {seq} || '.json.zst'
            FROM agents a
            JOIN sessions s ON s.id = a.session_id
            JOIN clusters c ON c.id = s.cluster_id
            JOIN tenants t ON t.id = c.tenant_id
            WHERE a.id = batches.agent_id)"""


def upgrade() -> None:
    op.execute(f"UPDATE batches SET blob_key = '' WHERE blob_key = {_derived()}")


def downgrade() -> None:
    op.execute(f"UPDATE batches SET blob_key = {_derived()} WHERE blob_key = ''")
