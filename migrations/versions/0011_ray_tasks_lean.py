"""ray_tasks: no foreign key to sessions, and partial indexes over unwritten tasks only

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23 02:20:00

``ray_tasks`` takes every Ray task attempt twice or more (its definition and its end come
in different bodies) and flips ``emitted`` once. Its foreign key checked the session row
for each inserted row (a shared lock on that one row, taken by every concurrent merge of
the session: ~40% of an insert's cost with three at once); retention deletes a session's
tasks itself now. Its indexes only ever served "tasks not yet written", so they hold only
those: flipping ``emitted`` then adds no entry to them, and they stay as small as the work
in flight instead of growing with every task ever seen.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

PENDING = {"postgresql_where": sa.text("emitted IS false"), "sqlite_where": sa.text("emitted IS 0")}


def upgrade() -> None:
    # SQLite cannot drop a constraint: batch mode copies the table (once).
    with op.batch_alter_table("ray_tasks") as batch:
        batch.drop_constraint("fk_ray_tasks_session_id_sessions", type_="foreignkey")
    op.drop_index("ix_ray_tasks_job", "ray_tasks")
    op.drop_index("ix_ray_tasks_pending", "ray_tasks")
    op.create_index("ix_ray_tasks_job", "ray_tasks", ["session_id", "job_id"], **PENDING)
    op.create_index("ix_ray_tasks_pending", "ray_tasks", ["end_seen"], **PENDING)


def downgrade() -> None:
    op.drop_index("ix_ray_tasks_pending", "ray_tasks")
    op.drop_index("ix_ray_tasks_job", "ray_tasks")
    op.create_index("ix_ray_tasks_job", "ray_tasks", ["session_id", "job_id", "emitted"])
    op.create_index("ix_ray_tasks_pending", "ray_tasks", ["emitted", "end_seen"])
    with op.batch_alter_table("ray_tasks") as batch:
        batch.create_foreign_key(
            "fk_ray_tasks_session_id_sessions",
            "sessions",
            ["session_id"],
            ["id"],
            ondelete="CASCADE",
        )
