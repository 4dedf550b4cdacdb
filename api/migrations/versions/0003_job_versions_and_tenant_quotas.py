"""Job row versions (every status change is checked against the version read), and
per-tenant priority ceilings and quotas.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

QUOTAS = ("max_ranks", "max_gpus", "max_queued_jobs")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("version", sa.Integer, nullable=False, server_default="1"))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_priority", sa.Integer, nullable=False, server_default="0"))
        for name in QUOTAS:
            batch.add_column(sa.Column(name, sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        for name in ("max_priority", *QUOTAS):
            batch.drop_column(name)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("version")
