"""worker URL proofs: each service's beat proves where it answers with the fleet's secret, so that an API replica
forwards online requests only to a worker that holds it (issue 37)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 16:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("url_proof", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("url_proof")
