"""ended console sessions: a logout ends its session in every process that shares the database

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 10:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ended_console_sessions",
        sa.Column("nonce", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("expires_at", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("nonce"),
    )
    with op.batch_alter_table("ended_console_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ended_console_sessions_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ended_console_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ended_console_sessions_expires_at"))
    op.drop_table("ended_console_sessions")
