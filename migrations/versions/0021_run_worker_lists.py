"""run_worker_lists: a finished run's per-worker rows packed into one

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-29 11:10:00

Ingest upserts a ``run_workers`` row per run and worker; once the run has finished the
fold finisher moves them into one ``run_worker_lists`` row (``storage.runs.packed``), as
0018 did for histograms, fine metrics and batch lists. Runs indexed before keep their
rows until ``hindsight reindex --detail`` packs them; readers read both.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_worker_lists",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_run_worker_lists_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_worker_lists")),
    )


_SUMS = ("tasks", "errors", "compute", "transfer", "disk_read", "disk_write", "other")


def downgrade() -> None:
    # the packed rows back as run_workers rows (added to a late batch's) before the table
    # goes; the packing of storage.runs.packed.pack_worker_list: zstd of msgpack rows
    # [worker, tasks, errors, compute, transfer, disk_read, disk_write, other, first, last]
    import msgspec
    import zstandard

    conn = op.get_bind()
    cols = (*_SUMS, "first_start", "last_stop")
    for run_id, data in conn.execute(sa.text("SELECT run_id, data FROM run_worker_lists")).all():
        raw = zstandard.ZstdDecompressor().decompress(bytes(data))
        for worker, *values in msgspec.msgpack.decode(raw):
            packed = dict(zip(cols, values, strict=True))
            key = {"run_id": run_id, "worker": worker}
            row = conn.execute(
                sa.text(
                    f"SELECT {', '.join(cols)} FROM run_workers"
                    " WHERE run_id = :run_id AND worker = :worker"
                ),
                key,
            ).first()
            if row is None:
                conn.execute(
                    sa.text(
                        f"INSERT INTO run_workers (run_id, worker, {', '.join(cols)})"
                        f" VALUES (:run_id, :worker, {', '.join(':' + c for c in cols)})"
                    ),
                    {**key, **packed},
                )
                continue
            have = dict(row._mapping)
            new = {c: have[c] + packed[c] for c in _SUMS}
            starts = [t for t in (have["first_start"], packed["first_start"]) if t is not None]
            stops = [t for t in (have["last_stop"], packed["last_stop"]) if t is not None]
            new["first_start"] = min(starts) if starts else None
            new["last_stop"] = max(stops) if stops else None
            conn.execute(
                sa.text(
                    f"UPDATE run_workers SET {', '.join(f'{c} = :{c}' for c in cols)}"
                    " WHERE run_id = :run_id AND worker = :worker"
                ),
                {**key, **new},
            )
    op.drop_table("run_worker_lists")
