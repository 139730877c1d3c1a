"""manifest_chunks: an agent's older manifest rows packed into one

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29 14:20:00

The batch manifest cost ~180 bytes a batch (~5.2 KB a run) for rows read a session at a
time. A collapse (``storage.core.manifest``, run by the collectors' finish workers) moves
an agent's rows older than ``HINDSIGHT_MANIFEST_COLLAPSE_SECONDS`` into a packed chunk;
``agents.collapsed_lo``/``collapsed_hi`` bound the sequence numbers it holds, so ingest
still finds a duplicate. ``run_batches`` gains an index by batch: a collapse asks whether
a batch is still a run's. Nothing is collapsed by the upgrade: the finish workers do it.
The downgrade writes the chunks back as rows. The agent columns are added and dropped in
place (a table rebuild on SQLite would cascade to every batch of the agent).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("agents", sa.Column("collapsed_lo", sa.BigInteger(), nullable=True))
    op.add_column("agents", sa.Column("collapsed_hi", sa.BigInteger(), nullable=True))
    op.create_table(
        "manifest_chunks",
        sa.Column("agent_id", Id, nullable=False),
        sa.Column("seq_lo", sa.BigInteger(), nullable=False),
        sa.Column("seq_hi", sa.BigInteger(), nullable=False),
        sa.Column("id_lo", sa.BigInteger(), nullable=False),
        sa.Column("id_hi", sa.BigInteger(), nullable=False),
        sa.Column("batches", sa.Integer(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("received_lo", sa.Float(), nullable=False),
        sa.Column("received_hi", sa.Float(), nullable=False),
        sa.Column("t_min", sa.Float(), nullable=True),
        sa.Column("t_max", sa.Float(), nullable=True),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["agent_id"],
            ["agents.id"],
            name=op.f("fk_manifest_chunks_agent_id_agents"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("agent_id", "seq_lo", name=op.f("pk_manifest_chunks")),
    )
    op.create_index("ix_run_batches_batch_id", "run_batches", ["batch_id"])


def downgrade() -> None:
    # the chunks back as rows; the packing of storage.core.manifest.pack: zstd of msgpack,
    # eight values a batch: id step, seq step, events, bytes, then received, t_min and
    # t_max as their distance from received_lo (or [time]), blob key
    import msgspec
    import zstandard

    def at(v: float | list[float] | None, t0: float) -> float | None:
        return None if v is None else v[0] if isinstance(v, list) else t0 + v

    conn = op.get_bind()
    chunks = conn.execute(
        sa.text("SELECT agent_id, seq_lo, id_lo, received_lo, data FROM manifest_chunks")
    ).all()
    for agent_id, seq, b, t0, data in chunks:
        flat = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(bytes(data)))
        rows = []
        for i in range(0, len(flat), 8):
            db_, ds, events, size, recv, t_min, t_max, key = flat[i : i + 8]
            b, seq = b + db_, seq + ds
            rows.append(
                {
                    "id": b,
                    "agent_id": agent_id,
                    "seq": seq,
                    "blob_key": key,
                    "events": events,
                    "bytes": size,
                    "received_at": at(recv, t0),
                    "t_min": at(t_min, t0),
                    "t_max": at(t_max, t0),
                }
            )
        conn.execute(
            sa.text(
                "INSERT INTO batches (id, agent_id, seq, blob_key, events, bytes, received_at,"
                " t_min, t_max) VALUES (:id, :agent_id, :seq, :blob_key, :events, :bytes,"
                " :received_at, :t_min, :t_max)"
            ),
            rows,
        )
    op.drop_index("ix_run_batches_batch_id", table_name="run_batches")
    op.drop_table("manifest_chunks")
    for column in ("collapsed_hi", "collapsed_lo"):
        op.execute(f"ALTER TABLE agents DROP COLUMN {column}")
