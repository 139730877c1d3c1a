"""profile frames stored once per tenant; run_profiles trees refer to them by id

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 00:30:00

A tree that carried its frames' names, files and source lines was ~40 KB at rest for
2,000 frames, and merging a prefix over 100 runs spent most of its time decoding those
strings. Trees are now integers (parent, frame id, samples); frames are stored once per
tenant. Rows written before (tag without the "p3/" format prefix) are rebuilt on read.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "profile_frames",
        sa.Column("id", _id, nullable=False),
        sa.Column("tenant_id", _id, nullable=False),
        sa.Column("digest", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=1024), nullable=False),
        sa.Column("filename", sa.String(length=1024), nullable=False),
        sa.Column("first_line", sa.BigInteger(), nullable=False),
        sa.Column("line_number", sa.BigInteger(), nullable=False),
        sa.Column("line", sa.String(length=1024), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_profile_frames_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profile_frames")),
        sa.UniqueConstraint("tenant_id", "digest", name=op.f("uq_profile_frames_tenant_id_digest")),
    )


def downgrade() -> None:
    op.drop_table("profile_frames")
