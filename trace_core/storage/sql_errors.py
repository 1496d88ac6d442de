"""Driver errors translated into core errors at the adapter edge."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import exc as sa_exc

from trace_core.errors import DatabaseUnavailable, DuplicateItem, StorageError, TraceError

__all__ = ["translate_errors"]

# psycopg SQLSTATE classes: 08 connection exception, 57P admin shutdown,
# 53 insufficient resources, 40001/40P01 serialization failure / deadlock.
_UNAVAILABLE_STATES = ("08", "57P", "53", "40001", "40P01")


@contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Re-raise SQLAlchemy/driver errors from the block as :class:`TraceError`s.

    SQLAlchemy's wrapped errors and the raw DB-API errors of sqlite3 and
    psycopg alike: an outage is :class:`DatabaseUnavailable`, a constraint
    violation :class:`DuplicateItem`, anything else :class:`StorageError`.

    The message names the operation and the driver's reason, never bound
    parameter values (they may hold payloads or tokens).
    """
    try:
        yield
    except TraceError:
        raise
    except sa_exc.IntegrityError as exc:
        raise DuplicateItem(f"{what}: constraint violated: {_reason(exc)}") from exc
    except sa_exc.DBAPIError as exc:
        state = str(getattr(exc.orig, "sqlstate", "") or "")
        reason = _reason(exc)
        if (
            exc.connection_invalidated
            or isinstance(exc, sa_exc.OperationalError)
            or state.startswith(_UNAVAILABLE_STATES)
        ):
            raise DatabaseUnavailable(f"{what}: database unavailable: {reason}") from exc
        raise StorageError(f"{what}: {reason}") from exc
    except sa_exc.SQLAlchemyError as exc:
        raise StorageError(f"{what}: {exc.__class__.__name__}: {exc}") from exc
    except _driver_errors() as exc:
        # A driver error SQLAlchemy did not wrap (a connection used directly).
        raise _translated_driver_error(what, exc) from exc


def _driver_errors() -> tuple[type[Exception], ...]:
    """The DB-API base errors of the drivers loaded in this process.

    psycopg is looked up, not imported: it is an optional extra, and an error
    of a driver that was never imported cannot occur.
    """
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:
        return (sqlite3.Error,)
    return (sqlite3.Error, psycopg.Error)


def _translated_driver_error(what: str, exc: Exception) -> StorageError:
    state = str(getattr(exc, "sqlstate", "") or "")
    text = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    # By the DB-API class names, which both drivers' hierarchies share.
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if "IntegrityError" in kinds or state.startswith("23"):
        return DuplicateItem(f"{what}: constraint violated: {reason}")
    if "OperationalError" in kinds or state.startswith(_UNAVAILABLE_STATES):
        return DatabaseUnavailable(f"{what}: database unavailable: {reason}")
    return StorageError(f"{what}: {reason}")


def _reason(exc: sa_exc.DBAPIError) -> str:
    orig = exc.orig
    text = str(orig).strip().splitlines()[0] if orig is not None else str(exc)
    return f"{type(orig).__name__}: {text}" if orig is not None else text
