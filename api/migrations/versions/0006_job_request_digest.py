"""A job keeps the digest of the request that submitted it, so that a submission_id
reused for a different request is refused instead of answered with the first job.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("request_digest", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "request_digest")
