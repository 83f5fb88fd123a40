"""64-bit integers where values outgrow 32 bits: nanosecond times, byte sizes, token counts (SQLite's INTEGER is
64-bit already; Postgres's is not, and `time.time_ns()` overflows it)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 15:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

WIDENED = {
    "files": ("created_ns", "bytes"),
    "batches": (
        "created_ns",
        "input_tokens",
        "cached_tokens",
        "output_tokens",
        "reasoning_tokens",
        "output_bytes_done",
        "error_bytes_done",
    ),
}


def _retype(old: type, new: type) -> None:
    for table, columns in WIDENED.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            for column in columns:
                batch_op.alter_column(column, existing_type=old(), type_=new(), existing_nullable=False)


def upgrade() -> None:
    _retype(sa.Integer, sa.BigInteger)


def downgrade() -> None:
    _retype(sa.BigInteger, sa.Integer)
