"""batch gpu seconds: the engine time each batch's requests used, kept at each checkpoint (issue 31)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-10 08:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_seconds", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("gpu_seconds")
