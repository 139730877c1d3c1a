"""runs.detail_digest: a finished run's detail lives in one object in the blob store

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-29 03:50:00

When a run finishes, its replay samples (``run_states``) and its profile
(``run_profiles``) move into one immutable object next to its compacted copy
(``storage.runs.detail``), named by the digest of its content; the column holds that
digest (NULL: the rows are in the index, as for every run indexed before this revision
until ``hindsight reindex --detail`` moves them; readers read either).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("detail_digest", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "detail_digest")
