"""Errors of the core, independent of any driver.

Storage adapters translate driver exceptions (sqlalchemy, psycopg, sqlite3)
into these at their edge, so callers never catch driver types.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailable",
    "DuplicateItem",
    "IdempotencyConflict",
    "IdempotencyInFlight",
    "InvalidInput",
    "InvalidTransition",
    "NotFound",
    "StaleClaim",
    "StorageError",
    "TraceError",
]


class TraceError(Exception):
    """Base class of every error Trace raises on purpose."""


class ConfigurationError(TraceError, ValueError):
    """A setting or argument is invalid; the message names it and the rule."""


class InvalidInput(ConfigurationError):
    """A request field is malformed; ``field`` names it (``events[2].cursor``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotFound(TraceError, LookupError):
    """The named item does not exist."""


class StaleClaim(TraceError):
    """A fenced write matched no row: the caller's lease is no longer current.

    Nothing was changed. The holder must abort its work: another claim (a newer
    attempt, a reclaim after expiry, or a cancellation) owns the item now.
    """

    def __init__(self, queue: str, item_id: object, detail: str) -> None:
        super().__init__(f"stale claim on {queue} item {item_id}: {detail}")
        self.queue = queue
        self.item_id = item_id
        self.detail = detail


class InvalidTransition(TraceError):
    """A state change outside the lifecycle table was attempted; nothing changed."""

    def __init__(self, lifecycle: str, source: str, target: str, item_id: object = None) -> None:
        where = f" for item {item_id}" if item_id is not None else ""
        super().__init__(f"{lifecycle}: transition {source!r} -> {target!r} is not allowed{where}")
        self.lifecycle = lifecycle
        self.source = source
        self.target = target
        self.item_id = item_id


class IdempotencyConflict(TraceError):
    """The idempotency key was used before with a different request hash."""


class IdempotencyInFlight(TraceError):
    """The first request with this idempotency key has not finished yet."""


class StorageError(TraceError):
    """The database failed in a way the caller cannot fix by changing input."""


class DatabaseUnavailable(StorageError):
    """The database could not be reached or is locked beyond the busy timeout."""


class DuplicateItem(StorageError):
    """A uniqueness constraint rejected the write (the item already exists)."""
