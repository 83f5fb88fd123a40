"""webhook outbox: one row per batch that reached a final state, sent at least once

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 17:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "webhook_events",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("type", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("batch_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Integer(), nullable=True),
        sa.Column("given_up_at", sa.Integer(), nullable=True),
        sa.Column("last_error", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_webhook_events_batch_id"), ["batch_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_webhook_events_next_attempt_at"), ["next_attempt_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_webhook_events_next_attempt_at"))
        batch_op.drop_index(batch_op.f("ix_webhook_events_batch_id"))
    op.drop_table("webhook_events")
