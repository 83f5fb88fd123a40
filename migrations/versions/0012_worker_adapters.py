"""worker adapters: the LoRA adapters each service serves, with their base models, for the API replicas' /v1/models

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 08:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("adapters_json", sqlmodel.sql.sqltypes.AutoString(), nullable=False, server_default="[]")
        )


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("adapters_json")
