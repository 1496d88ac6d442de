"""Storage: the repository port and its SQLAlchemy implementation for SQLite and Postgres."""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.storage.engine import EngineSettings
    from trace_core.storage.migrate import current_revision, head_revision, schema_diff, upgrade
    from trace_core.storage.protocol import (
        IdempotencyRecord,
        NewOutboxRow,
        NewTask,
        Repository,
        TaskCreated,
        TaskWakeup,
        Transaction,
    )
    from trace_core.storage.sql import SqlRepository, SqlTransaction
    from trace_core.storage.url import DatabaseURL, parse_database_url

__all__ = [
    "DatabaseURL",
    "EngineSettings",
    "IdempotencyRecord",
    "NewOutboxRow",
    "NewTask",
    "Repository",
    "SqlRepository",
    "SqlTransaction",
    "TaskCreated",
    "TaskWakeup",
    "Transaction",
    "current_revision",
    "head_revision",
    "parse_database_url",
    "schema_diff",
    "upgrade",
]

__getattr__, __dir__ = attach(__name__, __file__)
