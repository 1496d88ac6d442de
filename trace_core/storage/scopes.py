"""Scopes chosen by engine, for callers outside storage that must not look at it."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from trace_core.storage.protocol import Repository, Transaction

__all__ = ["per_statement_reads"]


def per_statement_reads(repo: Repository) -> AbstractAsyncContextManager[Transaction]:
    """A scope for reads that need no snapshot across statements.

    On Postgres a statement scope: autocommit (no ``BEGIN``/``COMMIT`` round
    trips; READ COMMITTED takes a snapshot per statement in a transaction
    too), whose statements built once run on the driver directly and any
    other on an autocommit connection opened on demand; on SQLite a deferred
    read transaction (``autocommit()`` and ``statement()`` would take the
    write lock there).
    """
    return repo.statement() if repo.engine_name == "postgres" else repo.read()
