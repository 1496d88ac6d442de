"""Alembic environment: runs on the connection handed over by ``migrate.py``."""

from __future__ import annotations

from alembic import context

from trace_core.storage.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
