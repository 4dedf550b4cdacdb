"""Tenant names differ by more than letter case: a unique index on the lower-cased name.

A tenant's name is a directory (checkpoints, ``{tenant}`` data roots) and an object
prefix; on a file system that ignores case (macOS, SMB mounts) ``TeamA`` and
``teama`` would share one. A store that already holds two such names is not changed:
the upgrade stops and names them, for an operator to rename one.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

INDEX = "uq_tenants_name_folded"


def upgrade() -> None:
    tenants = sa.table("tenants", sa.column("name", sa.String))
    folded = sa.func.lower(tenants.c.name)
    clashes = op.get_bind().execute(
        sa.select(folded, sa.func.count()).group_by(folded).having(sa.func.count() > 1)
    )
    names = sorted(row[0] for row in clashes)
    if names:
        raise RuntimeError(
            "tenants: names that differ only in letter case share a directory on a "
            f"case-insensitive file system; rename all but one of each of {names} "
            "(UPDATE tenants SET name = ...) and start the service again"
        )
    op.create_index(INDEX, "tenants", [sa.text("lower(name)")], unique=True)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="tenants")
