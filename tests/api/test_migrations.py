"""The migrations build the schema the models declare: a store upgraded from empty to
head has every table, column, type, index and constraint of api/db.py, and no other,
on SQLite and PostgreSQL alike. A column added to a model without its migration (or
the reverse) fails here rather than on the first deployment that upgrades."""

from __future__ import annotations

import warnings

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from api.db import Base, make_engine
from api.migrate import upgrade


def test_head_matches_the_models(database_url):
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        with engine.connect() as connection, warnings.catch_warnings():
            # SQLite cannot reflect the expression index on lower(name) (migration 0005).
            warnings.filterwarnings("ignore", "autogenerate skipping metadata-specified")
            warnings.filterwarnings("ignore", "Skipped unsupported reflection")
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()
