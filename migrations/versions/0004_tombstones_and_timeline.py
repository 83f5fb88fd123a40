"""deleted objects (list cursors that name a deleted file page on) and each batch's timeline

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 13:30:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deleted_objects",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("deleted_objects", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_deleted_objects_owner"), ["owner"], unique=False)
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("timeline_json", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("timeline_json")
    with op.batch_alter_table("deleted_objects", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_deleted_objects_owner"))
    op.drop_table("deleted_objects")
