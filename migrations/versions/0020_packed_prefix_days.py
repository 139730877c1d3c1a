"""prefix_days.hist: a day's duration histogram packed

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-29 11:00:00

``prefix_days`` held each histogram as a JSON object of bucket → count (~10 bytes a
bucket); ingest and the fold now write it packed (``storage.analysis.sketch.pack_hist``,
~2 bytes a bucket) with ``buckets`` left ``{}``. Rows written before keep their JSON
until a fold of the same (cluster, prefix, action, day) rewrites them; readers add both.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("prefix_days", sa.Column("hist", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    # the packed histograms back into JSON before the column goes (the packing of
    # storage.analysis.sketch.pack_hist: msgpack of the first bucket and its count, then
    # each further bucket's step from the previous and its count)
    import msgspec

    conn = op.get_bind()
    t = sa.table(
        "prefix_days",
        sa.column("cluster_id"),
        sa.column("prefix"),
        sa.column("action"),
        sa.column("day"),
        sa.column("batch_id"),
        sa.column("buckets", sa.JSON()),
        sa.column("hist", sa.LargeBinary()),
    )
    keys = ("cluster_id", "prefix", "action", "day", "batch_id")
    rows = conn.execute(
        sa.select(*(t.c[k] for k in keys), t.c.buckets, t.c.hist).where(t.c.hist.is_not(None))
    ).all()
    for *key, buckets, hist in rows:
        h = {int(b): int(c) for b, c in (buckets or {}).items()}
        seq, b = msgspec.msgpack.decode(hist), 0
        for i in range(0, len(seq), 2):
            b += seq[i]
            h[b] = h.get(b, 0) + seq[i + 1]
        conn.execute(
            t.update()
            .where(*(t.c[k] == v for k, v in zip(keys, key, strict=True)))
            .values(buckets={str(b): c for b, c in sorted(h.items())})
        )
    with op.batch_alter_table("prefix_days") as batch:
        batch.drop_column("hist")
