"""shards: a large batch run by several workers is cut into hidden shard batches, each pointing at its parent

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 04:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parent_id", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column("shard", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("shards", sa.Integer(), nullable=False, server_default="0"))
        batch_op.create_index(batch_op.f("ix_batches_parent_id"), ["parent_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_batches_parent_id"))
        batch_op.drop_column("shards")
        batch_op.drop_column("shard")
        batch_op.drop_column("parent_id")
