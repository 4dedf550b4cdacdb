"""Token expiry, and leases (one scheduler at a time among API replicas).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from api.db import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_at", UTCDateTime(), nullable=True))
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leases")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_at")
