"""batch checkpoints: fsynced lengths of the result part files

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 21:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("output_bytes_done", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("error_bytes_done", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("error_bytes_done")
        batch_op.drop_column("output_bytes_done")
