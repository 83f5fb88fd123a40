"""batch turns and the fleet's indexes (issue 41): each batch's turn in the round robin claims go by over keys, an
index that serves claims in that order (over active batches only), one for a new batch's turn, and one a page of a
key's batches or files newest first is read from (which serves every look-up by key: the key's own index goes).

Batches from before have turn 0: those still waiting are claimed first, oldest first, as before.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-12 08:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

ACTIVE_ROWS = sa.text("status IN ('cancelling', 'finalizing', 'in_progress', 'validating')")


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("turn", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_index("ix_batches_owner_created", "batches", ["owner", "created_ns", "id"])
    op.drop_index("ix_batches_owner", table_name="batches")
    partial = {"postgresql_where": ACTIVE_ROWS, "sqlite_where": ACTIVE_ROWS}
    op.create_index("ix_batches_claim_order", "batches", ["turn", "created_ns"], **partial)
    op.create_index("ix_batches_owner_turn", "batches", ["owner", "turn"], **partial)
    op.create_index("ix_files_owner_created", "files", ["owner", "created_ns", "id"])
    op.drop_index("ix_files_owner", table_name="files")


def downgrade() -> None:
    op.create_index("ix_files_owner", "files", ["owner"])
    op.drop_index("ix_files_owner_created", table_name="files")
    op.drop_index("ix_batches_owner_turn", table_name="batches")
    op.drop_index("ix_batches_claim_order", table_name="batches")
    op.create_index("ix_batches_owner", "batches", ["owner"])
    op.drop_index("ix_batches_owner_created", table_name="batches")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("turn")
