"""worker URLs: where each service answers online requests, and how many it has in flight, for the API replicas
that forward them

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 12:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("url", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column("online_in_flight", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("online_in_flight")
        batch_op.drop_column("url")
