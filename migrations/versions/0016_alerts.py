"""alert_rules and alert_deliveries: webhooks for runs judged slower or with failures

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29 01:00:00

A tenant's rules say which runs (a job, a cluster) to alert on and where to post; each
alert is a delivery row, retried until the receiver takes it, one per (rule, run).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "alert_rules",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column(
            "tenant_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.ForeignKey(
                "tenants.id", ondelete="CASCADE", name="fk_alert_rules_tenant_id_tenants"
            ),
            nullable=False,
        ),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("cluster", sa.String(256), nullable=True),
        sa.Column("job", sa.String(1024), nullable=True),
        sa.Column("on_slower", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.Column("min_change", sa.Float(), server_default=sa.text("0.2"), nullable=False),
        sa.Column("on_failures", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_alert_rules"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_alert_rules_tenant_id_name"),
    )
    op.create_table(
        "alert_deliveries",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column(
            "rule_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.ForeignKey(
                "alert_rules.id", ondelete="CASCADE", name="fk_alert_deliveries_rule_id_alert_rules"
            ),
            nullable=False,
        ),
        sa.Column("run", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=False),
        sa.Column("reasons", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("body", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", sa.Float(), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_alert_deliveries"),
        sa.UniqueConstraint("rule_id", "run", name="uq_alert_deliveries_rule_id_run"),
    )
    op.create_index("ix_alert_deliveries_status_next_at", "alert_deliveries", ["status", "next_at"])


def downgrade() -> None:
    op.drop_index("ix_alert_deliveries_status_next_at", table_name="alert_deliveries")
    op.drop_table("alert_deliveries")
    op.drop_table("alert_rules")
