"""SQL statements of the ownership protocol, for any queue and either engine.

Every statement here is built once per (queue, shape) and cached; values go
in as bind parameters, status names as literals (see :func:`status_in`).
The dialect differences: Postgres locks the claim's candidate rows with
``FOR UPDATE SKIP LOCKED`` (SQLite's ``BEGIN IMMEDIATE`` already serializes
writers); the fresh lease token is ``gen_random_uuid()`` on Postgres and 16
random bytes in hex on SQLite; a batch of fences is joined as ``unnest``
arrays on Postgres and ``json_each`` on SQLite.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from trace_core.model import Fence, ItemId, QueueSpec
from trace_core.storage.queue_tables import QUEUE_TABLES, QueueTable

__all__ = ["LeaseStatements", "status_in"]


def _status(value: str) -> sa.ColumnElement[str]:
    # Status names are constants of the lifecycle tables, never input. As SQL
    # literals they let Postgres match the partial indexes (WHERE status =
    # 'Queued') from a generic prepared plan, which a bind parameter hides.
    if not value.replace("_", "").isalnum():
        raise ValueError(f"not a status name: {value!r}")
    return sa.literal_column(f"'{value}'", sa.Text())


def status_in(column: sa.ColumnElement[str], values: Any) -> sa.ColumnElement[bool]:
    """``column = 'a'`` or ``column IN ('a', 'b')`` with literal status names."""
    names = sorted({values} if isinstance(values, str) else set(values))
    if len(names) == 1:
        return column == _status(names[0])
    return column.in_([_status(n) for n in names])


def _random_token(engine_name: str) -> sa.ColumnElement[Any]:
    if engine_name == "postgres":
        return sa.func.gen_random_uuid()
    # A Uuid column is 32 hex characters on SQLite.
    return sa.func.lower(sa.func.hex(sa.func.randomblob(16)))


class LeaseStatements:
    """Builds (and caches) the protocol's statements for one engine."""

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name

    def table(self, queue: QueueSpec) -> QueueTable:
        """The physical table of ``queue``."""
        return QUEUE_TABLES[queue.name]

    def _returning(self, qt: QueueTable) -> tuple[sa.ColumnElement[Any], ...]:
        # Not lease_expires_at: the claim sets it to its ``expires_at`` parameter,
        # and the caller has that value already (decoding it per row cost more
        # than any other column on SQLite, where it comes back as text).
        c = qt.c
        return (
            c.id,
            qt.attempt,
            c.claim_version,
            c.lease_token,
            c.max_attempts,
            *qt.data,
        )

    @functools.cache  # noqa: B019 - one instance per engine, lives as long as the process
    def claim(self, queue: QueueSpec, by_id: bool) -> sa.Update:
        """Lease ready items: by id, or the oldest ``:limit`` ones."""
        qt = self.table(queue)
        c = qt.c
        ready = [status_in(c.status, queue.ready)]
        if qt.ready_at is not None:
            ready.append(qt.ready_at <= sa.bindparam("now"))
        if queue.first_claim_keeps_attempt:
            attempt: sa.ColumnElement[Any] = sa.case(
                (c.claim_version == 0, qt.attempt), else_=qt.attempt + 1
            )
        else:
            attempt = qt.attempt + 1
        values: dict[Any, Any] = {
            c.status: queue.claimed,
            c.worker_id: sa.bindparam("b_worker_id"),
            c.lease_token: _random_token(self.engine_name),
            c.lease_expires_at: sa.bindparam("expires_at"),
            qt.heartbeat: sa.bindparam("now"),
            c.claim_version: c.claim_version + 1,
            qt.attempt: attempt,
        }
        if qt.started_at is not None:
            values[qt.started_at] = sa.bindparam("now")
        stmt = sa.update(qt.table)
        if by_id:
            stmt = stmt.where(c.id == sa.bindparam("item_id"), *ready)
        else:
            pick = sa.select(c.id).where(*ready).order_by(*qt.order_by).limit(sa.bindparam("limit"))
            # The status test is repeated outside the pick so a row that a
            # concurrent claim took between pick and update is not re-taken.
            stmt = self._where_picked(stmt, qt, pick).where(status_in(c.status, queue.ready))
        return stmt.values(values).returning(*self._returning(qt))

    def _where_picked(self, stmt: sa.Update, qt: QueueTable, pick: sa.Select[Any]) -> sa.Update:
        """Restrict ``stmt`` to the rows ``pick`` selects, evaluated exactly once.

        Postgres may re-run an ``IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)``
        subplan per outer row, which updates more than ``n`` rows; a locking CTE
        is always materialized once. SQLite evaluates ``IN (SELECT …)`` once
        into a temporary table and needs no lock (``BEGIN IMMEDIATE``). It picks
        by ``rowid``, which every index holds: the pick reads no table row and
        the update finds each row directly, without a search of the id index.
        """
        if self.engine_name == "postgres":
            picked = pick.with_for_update(skip_locked=True).cte("picked")
            return stmt.where(qt.c.id == picked.c.id)
        rowid = sa.literal_column(f"{qt.table.name}.rowid", sa.Integer())
        return stmt.where(rowid.in_(pick.with_only_columns(rowid).scalar_subquery()))

    @functools.cache  # noqa: B019
    def inspect(self, queue: QueueSpec) -> sa.Select[Any]:
        """The ownership columns of one item."""
        qt = self.table(queue)
        c = qt.c
        return sa.select(
            c.id,
            c.status,
            qt.attempt,
            c.claim_version,
            c.lease_token,
            c.lease_expires_at,
            c.max_attempts,
            qt.retry_at,
            qt.error,
        ).where(c.id == sa.bindparam("item_id"))

    def fence(self, qt: QueueTable, with_claim_version: bool) -> list[sa.ColumnElement[bool]]:
        """The ``WHERE`` of a fenced write: item, attempt, token (and claim_version)."""
        c = qt.c
        cond = [
            c.id == sa.bindparam("item_id"),
            qt.attempt == sa.bindparam("f_attempt"),
            c.lease_token == sa.bindparam("f_lease_token", type_=c.lease_token.type),
        ]
        if with_claim_version:
            cond.append(c.claim_version == sa.bindparam("f_claim_version"))
        return cond

    @functools.cache  # noqa: B019
    def heartbeat(self, queue: QueueSpec, with_claim_version: bool) -> sa.Update:
        """Extend a live, matching lease."""
        qt = self.table(queue)
        c = qt.c
        return (
            sa.update(qt.table)
            .where(*self.fence(qt, with_claim_version), status_in(c.status, queue.leased))
            .values(
                {c.lease_expires_at: sa.bindparam("expires_at"), qt.heartbeat: sa.bindparam("now")}
            )
            .returning(c.lease_expires_at)
        )

    @functools.cache  # noqa: B019
    def expired(self, queue: QueueSpec) -> sa.Select[Any]:
        """Leased items whose lease ran out."""
        qt = self.table(queue)
        c = qt.c
        stmt = (
            sa.select(c.id, qt.attempt, c.lease_token, c.claim_version)
            .where(
                status_in(c.status, queue.leased),
                c.lease_expires_at < sa.bindparam("now"),
            )
            .order_by(c.lease_expires_at)
            .limit(sa.bindparam("limit"))
        )
        if self.engine_name == "postgres":
            stmt = stmt.with_for_update(skip_locked=True)
        return stmt

    @functools.cache  # noqa: B019
    def requeue_due(self, queue: QueueSpec) -> sa.Update:
        """Failures whose retry time came: back to ready."""
        qt = self.table(queue)
        c = qt.c
        pick = (
            sa.select(c.id)
            .where(
                status_in(c.status, queue.retry_to),
                qt.retry_at.is_not(None),
                qt.retry_at <= sa.bindparam("now"),
            )
            .limit(sa.bindparam("limit"))
        )
        values: dict[Any, Any] = {c.status: queue.ready}
        if qt.ready_at is None:
            values[qt.retry_at] = None
        return (
            self._where_picked(sa.update(qt.table), qt, pick)
            .where(status_in(c.status, queue.retry_to))
            .values(values)
            .returning(c.id)
        )

    @functools.cache  # noqa: B019
    def complete_many(self, queue: QueueSpec, sources: frozenset[str]) -> sa.Update:
        """A fenced batch completion joined to its fences (see :meth:`fence_batch`),
        returning the ids it completed.

        The fences travel as one parameter (arrays for ``unnest`` on Postgres,
        a JSON array of strings for ``json_each`` on SQLite), so the statement
        text is the same for every batch size: compiled and prepared once, and
        each row is found through the primary key.
        """
        qt = self.table(queue)
        c = qt.c
        returned: sa.ColumnElement[Any] = c.id
        if self.engine_name == "postgres":
            keys = (
                sa.func.unnest(
                    sa.cast(sa.bindparam("f_ids"), postgresql.ARRAY(c.id.type)),
                    sa.cast(sa.bindparam("f_tokens"), postgresql.ARRAY(sa.Uuid())),
                    sa.cast(sa.bindparam("f_attempts"), postgresql.ARRAY(sa.Integer())),
                )
                .table_valued("id", "tok", "att")
                .render_derived()
                .alias("f")
            )
            fenced = [c.id == keys.c.id, c.lease_token == keys.c.tok, qt.attempt == keys.c.att]
        else:
            # One string per fence (see fence_batch): the lease token (32 hex
            # digits), the attempt (10 digits), then the id. Cutting fixed fields
            # out with substr() is cheaper than json_extract, which parses its
            # JSON argument again for every field of every row.
            value = sa.func.json_each(sa.bindparam("f_keys")).table_valued("value").alias("f")
            item_id = sa.func.substr(value.c.value, 43)
            if isinstance(c.id.type, sa.Uuid):
                # On SQLite a Uuid column holds 32 hex characters: compare as text.
                returned = sa.type_coerce(c.id, sa.Text())
                same_item = returned == item_id
            else:
                same_item = c.id == sa.cast(item_id, sa.Integer())
            fenced = [
                same_item,
                sa.type_coerce(c.lease_token, sa.Text()) == sa.func.substr(value.c.value, 1, 32),
                qt.attempt == sa.cast(sa.func.substr(value.c.value, 33, 10), sa.Integer()),
            ]
        return (
            sa.update(qt.table)
            .where(*fenced, status_in(c.status, sources))
            .values(
                {
                    c.status: queue.done,
                    qt.finished_at: sa.bindparam("now"),
                    c.lease_expires_at: None,
                }
            )
            .returning(returned)
        )

    def fence_batch(
        self, fences: Sequence[Fence]
    ) -> tuple[dict[str, Any], Mapping[Any, ItemId] | None]:
        """The parameters of :meth:`complete_many` for ``fences``; on SQLite also
        the fences' ids by the value the statement returns for each (a Uuid id
        comes back as its 32 hex digits: mapping it back is cheaper than parsing)."""
        if self.engine_name == "postgres":
            params = {
                "f_ids": [f.item_id for f in fences],
                "f_tokens": [f.lease_token for f in fences],
                "f_attempts": [f.attempt for f in fences],
            }
            return params, None
        ids: dict[Any, ItemId] = {}
        encoded: list[str] = []
        for f in fences:
            key = f.item_id.hex if isinstance(f.item_id, uuid.UUID) else f.item_id
            ids[key] = f.item_id
            encoded.append(f"{f.lease_token.hex}{f.attempt:010d}{key}")
        return {"f_keys": json.dumps(encoded)}, ids
