"""batch cut answers: how each batch's answers ended, for estimates (issue 38)

Batches from before have zeros: their answers are taken as ended on their own, as estimates took them before.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-11 08:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"  # 0015 is the workers' url_proof (committed first)
branch_labels = None
depends_on = None

COLUMNS = (
    ("cut_lines", sa.Integer()),
    ("cut_output_tokens", sa.BigInteger()),
    ("shortest_cut_output", sa.Integer()),
    ("longest_uncut_output", sa.Integer()),
)


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        for name, kind in COLUMNS:
            batch_op.add_column(sa.Column(name, kind, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        for name, _ in reversed(COLUMNS):
            batch_op.drop_column(name)
