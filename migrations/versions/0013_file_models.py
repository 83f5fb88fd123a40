"""file models: the model a batch input file's first line names, so a batch's model is known when it is created
and only a worker that serves it claims the batch

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-08 08:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("model")
