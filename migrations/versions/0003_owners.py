"""owners: every file and batch belongs to the API key that made it

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 05:30:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("files", "batches"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(), nullable=False, server_default="")
            )
            batch_op.create_index(batch_op.f(f"ix_{table}_owner"), ["owner"], unique=False)


def downgrade() -> None:
    for table in ("files", "batches"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f"ix_{table}_owner"))
            batch_op.drop_column("owner")
