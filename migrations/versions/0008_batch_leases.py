"""batch leases (which service runs a batch, until when, and the fencing token its writes carry) and the
services that run batches, as they last said (what API replicas read)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 19:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parts_token", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("lease_holder", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column("lease_expires_ns", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("lease_token", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("live_json", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
    op.create_table(
        "workers",
        sa.Column("holder", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("started_at", sa.Integer(), nullable=False),
        sa.Column("beat_ns", sa.BigInteger(), nullable=False),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("served_models_json", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("engine_config_json", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("scheduler_error", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("engine_deaths", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("holder"),
    )
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_workers_beat_ns"), ["beat_ns"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workers_beat_ns"))
    op.drop_table("workers")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("live_json")
        batch_op.drop_column("lease_token")
        batch_op.drop_column("lease_expires_ns")
        batch_op.drop_column("lease_holder")
        batch_op.drop_column("parts_token")
