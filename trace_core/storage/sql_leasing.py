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
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from trace_core.model import Fence, ItemId, QueueSpec
from trace_core.storage.queue_tables import QUEUE_TABLES, QueueTable

__all__ = [
    "ClaimGate",
    "LeaseStatements",
    "fence_storable",
    "finishable",
    "random_token",
    "reply_accepted",
    "returned_by_claim",
    "status_in",
]


ClaimGate = Callable[[QueueTable], sa.ColumnElement[bool]]
"""An extra condition a ready row must meet to be claimed (a module-level
function, so the cached statement is built once): e.g. the webhook events'
"earlier events of the job are finished" (``sql_webhook_delivery``)."""


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


def random_token(engine_name: str) -> sa.ColumnElement[Any]:
    """A fresh random lease token, made by the database (one per row)."""
    if engine_name == "postgres":
        return sa.func.gen_random_uuid()
    # A Uuid column is 32 hex characters on SQLite.
    return sa.func.lower(sa.func.hex(sa.func.randomblob(16)))


def finishable(
    qt: QueueTable, queue: QueueSpec, sources: Collection[str]
) -> sa.ColumnElement[bool]:
    """The status test of a fenced completion from ``sources``: a leased
    status, or a late-reply status (tasks' ``Failed``/``Queued``) only
    while the row carries the timeout mark.

    interface-contracts.md "Worker → Dispatcher": a late reply of the
    current attempt is accepted after the task was *marked timed out*,
    as long as no newer attempt started; an attempt that ended otherwise
    (its own failure report, cancellation, a forced dead letter) is over.
    The timeout mark is the lease expiry the timeout left in place
    (:meth:`~trace_core.storage.sql.SqlTransaction.fail` with
    ``timed_out``); every other end of an attempt clears it, and the next
    claim replaces it.
    """
    c = qt.c
    live = set(sources) & queue.leased
    late = set(sources) - queue.leased
    tests = [status_in(c.status, live)] if live else []
    if late:
        tests.append(sa.and_(status_in(c.status, late), c.lease_expires_at.is_not(None)))
    if not tests:
        raise ValueError(f"{queue.name}: no source status to finish from")
    return tests[0] if len(tests) == 1 else sa.or_(*tests)


def reply_accepted(queue: QueueSpec) -> sa.ColumnElement[bool]:
    """Whether the row's current attempt may still report (heartbeat aside):
    :func:`finishable` from every status that can reach the done status."""
    return finishable(QUEUE_TABLES[queue.name], queue, queue.lifecycle.sources_of(queue.done))


def returned_by_claim(qt: QueueTable) -> tuple[sa.ColumnElement[Any], ...]:
    """The columns a claim returns (and a :class:`~trace_core.model.Lease` is made of)."""
    # Not lease_expires_at: the claim sets it to its ``expires_at`` parameter,
    # and the caller has that value already (decoding it per row cost more
    # than any other column on SQLite, where it comes back as text).
    c = qt.c
    return (c.id, qt.attempt, c.claim_version, c.lease_token, c.max_attempts, *qt.data)


class LeaseStatements:
    """Builds (and caches) the protocol's statements for one engine."""

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name

    def table(self, queue: QueueSpec) -> QueueTable:
        """The physical table of ``queue``."""
        return QUEUE_TABLES[queue.name]

    @functools.cache  # noqa: B019 - one instance per engine, lives as long as the process
    def claim(self, queue: QueueSpec, by_id: bool, gate: ClaimGate | None = None) -> sa.Update:
        """Lease ready items: by id, or the oldest ``:limit`` ones; with
        ``gate``, only ready items that also meet its condition."""
        qt = self.table(queue)
        c = qt.c
        ready = [status_in(c.status, queue.ready)]
        if qt.ready_at is not None:
            ready.append(qt.ready_at <= sa.bindparam("now"))
        if gate is not None:
            ready.append(gate(qt))
        if queue.first_claim_keeps_attempt:
            attempt: sa.ColumnElement[Any] = sa.case(
                (c.claim_version == 0, qt.attempt), else_=qt.attempt + 1
            )
        else:
            attempt = qt.attempt + 1
        values: dict[Any, Any] = {
            c.status: queue.claimed,
            c.worker_id: sa.bindparam("b_worker_id"),
            c.lease_token: random_token(self.engine_name),
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
        return stmt.values(values).returning(*returned_by_claim(qt))

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

    def fence_where(
        self,
        qt: QueueTable,
        *,
        same_item: sa.ColumnElement[bool],
        attempt: sa.ColumnElement[Any],
        lease_token: sa.ColumnElement[Any],
        claim_version: sa.ColumnElement[Any],
        token_as_text: bool = False,
    ) -> list[sa.ColumnElement[bool]]:
        """The ``WHERE`` of every fenced write, single or batch: the item, its
        attempt, its lease token and its claim_version (euterpe-contract.md §4).

        The presented values are expressions: bind parameters for one fence
        (:meth:`fence`), the columns of the joined fence list for a batch
        (:meth:`complete_many`). A ``NULL`` claim_version means the caller does
        not know it (an HTTP task caller presents attempt + lease token, which
        is as strong: the token is fresh random per claim); any other value
        must equal the row's. One shape for both cases keeps one statement
        text per write, prepared once.
        """
        c = qt.c
        token = sa.type_coerce(c.lease_token, sa.Text()) if token_as_text else c.lease_token
        return [
            same_item,
            qt.attempt == attempt,
            token == lease_token,
            c.claim_version == sa.func.coalesce(claim_version, c.claim_version),
        ]

    def fence(self, qt: QueueTable) -> list[sa.ColumnElement[bool]]:
        """:meth:`fence_where` of one fence, from the parameters of :meth:`fence_params`."""
        c = qt.c
        return self.fence_where(
            qt,
            same_item=c.id == sa.bindparam("item_id"),
            attempt=sa.bindparam("f_attempt", type_=sa.Integer()),
            lease_token=sa.bindparam("f_lease_token", type_=c.lease_token.type),
            claim_version=sa.bindparam("f_claim_version", type_=sa.Integer()),
        )

    @staticmethod
    def fence_params(fence: Fence) -> dict[str, Any]:
        """The parameters of :meth:`fence` for ``fence``."""
        return {
            "item_id": fence.item_id,
            "f_attempt": fence.attempt,
            "f_lease_token": fence.lease_token,
            "f_claim_version": fence.claim_version,
        }

    @functools.cache  # noqa: B019
    def heartbeat(self, queue: QueueSpec) -> sa.Update:
        """Extend a live, matching lease."""
        qt = self.table(queue)
        c = qt.c
        return (
            sa.update(qt.table)
            .where(*self.fence(qt), status_in(c.status, queue.leased))
            .values(
                {c.lease_expires_at: sa.bindparam("expires_at"), qt.heartbeat: sa.bindparam("now")}
            )
            .returning(c.lease_expires_at)
        )

    @functools.cache  # noqa: B019
    def transition(
        self, queue: QueueSpec, sources: frozenset[str], target: str, keys: tuple[str, ...]
    ) -> tuple[sa.Update, tuple[str, ...]]:
        """A fenced status change from ``sources`` to ``target`` that also sets
        the value columns named in ``keys``, returning the row's id; and the
        keys whose values it binds (``v_<key>``).

        Built once per shape, so that the statement is compiled once (and runs
        on the direct path in a statement scope) instead of per call. Reaching
        ``queue.done`` stamps ``finished_at`` with the ``now`` parameter,
        clears the lease expiry (and a scheduled retry: a late reply
        supersedes it) and accepts a late reply only as :func:`finishable`
        says; leaving the leased statuses otherwise clears the lease expiry.
        ``refund_attempt`` in ``keys`` gives the attempt back (only where
        claims count attempts from 0: queues with an availability gate); a
        key whose role the queue lacks (``ready_at`` without an availability
        gate) sets nothing.
        """
        qt = self.table(queue)
        c = qt.c
        new: dict[Any, Any] = {c.status: _status(target)}
        status = status_in(c.status, sources)
        if target == queue.done:
            status = finishable(qt, queue, sources)
            new[qt.finished_at] = sa.bindparam("now", type_=qt.finished_at.type)
            new[c.lease_expires_at] = None
            if qt.retry_at.nullable:
                new[qt.retry_at] = None
        elif target not in queue.leased:
            new[c.lease_expires_at] = None
        roles = {"error": qt.error, "ready_at": qt.ready_at}
        bound: list[str] = []
        for key in keys:
            if key == "refund_attempt":
                if qt.ready_at is not None:
                    new[qt.attempt] = qt.attempt - 1
                continue
            column = roles[key] if key in roles else c[key]
            if column is not None:
                new[column] = sa.bindparam(f"v_{key}", type_=column.type)
                bound.append(key)
        stmt = sa.update(qt.table).where(*self.fence(qt), status).values(new).returning(c.id)
        return stmt, tuple(bound)

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
        returning the ids it completed (on SQLite with the attempt of each).

        The fences travel as one parameter (arrays for ``unnest`` on Postgres,
        a JSON array of strings for ``json_each`` on SQLite), so the statement
        text is the same for every batch size: compiled and prepared once, and
        each row is found through the primary key. Each row is fenced by the
        same :meth:`fence_where` as a single write, claim_version included.
        """
        qt = self.table(queue)
        c = qt.c
        returned: sa.ColumnElement[Any] = c.id
        # SQLite also answers each row's attempt: the caller closes the record
        # of exactly that attempt (a batch may hold a stale fence of the same
        # task); Postgres closes it inside the statement.
        answered: tuple[sa.ColumnElement[Any], ...] = ()
        if self.engine_name == "postgres":
            keys = (
                sa.func.unnest(
                    sa.cast(sa.bindparam("f_ids"), postgresql.ARRAY(c.id.type)),
                    sa.cast(sa.bindparam("f_tokens"), postgresql.ARRAY(sa.Uuid())),
                    sa.cast(sa.bindparam("f_attempts"), postgresql.ARRAY(sa.Integer())),
                    sa.cast(sa.bindparam("f_versions"), postgresql.ARRAY(sa.Integer())),
                )
                .table_valued("id", "tok", "att", "ver")
                .render_derived()
                .alias("f")
            )
            fenced = self.fence_where(
                qt,
                same_item=c.id == keys.c.id,
                attempt=keys.c.att,
                lease_token=keys.c.tok,
                claim_version=keys.c.ver,
            )
        else:
            # One string per fence (see fence_batch): the lease token (32 hex
            # digits), the attempt (10 characters), the claim_version (10
            # characters, dashes when not presented), then the id. Cutting
            # fixed fields out with substr() is cheaper than json_extract,
            # which parses its JSON argument again for every field of every row.
            value = sa.func.json_each(sa.bindparam("f_keys")).table_valued("value").alias("f")
            item_id = sa.func.substr(value.c.value, _ID_AT)
            if isinstance(c.id.type, sa.Uuid):
                # On SQLite a Uuid column holds 32 hex characters: compare as text.
                returned = sa.type_coerce(c.id, sa.Text())
                same_item = returned == item_id
            else:
                same_item = c.id == sa.cast(item_id, sa.Integer())
            answered = (qt.attempt,)
            version = sa.func.nullif(sa.func.substr(value.c.value, 43, 10), _NO_VERSION)
            fenced = self.fence_where(
                qt,
                same_item=same_item,
                attempt=sa.cast(sa.func.substr(value.c.value, 33, 10), sa.Integer()),
                lease_token=sa.func.substr(value.c.value, 1, 32),
                claim_version=sa.cast(version, sa.Integer()),
                token_as_text=True,
            )
        return (
            sa.update(qt.table)
            .where(*fenced, finishable(qt, queue, sources))
            .values(
                {
                    c.status: queue.done,
                    qt.finished_at: sa.bindparam("now"),
                    c.lease_expires_at: None,
                }
            )
            .returning(returned, *answered)
        )

    def fence_batch(
        self, fences: Sequence[Fence]
    ) -> tuple[dict[str, Any], Mapping[Any, ItemId] | None]:
        """The parameters of :meth:`complete_many` for ``fences``; on SQLite also
        the fences' ids by the value the statement returns for each (a Uuid id
        comes back as its 32 hex digits: mapping it back is cheaper than parsing).

        A fence no row can hold (:func:`fence_storable`) is stale by
        definition and left out: it could not match, and would break the
        fixed-width encoding and the Postgres integer arrays.
        """
        fences = [f for f in fences if fence_storable(f)]
        if self.engine_name == "postgres":
            params = {
                "f_ids": [f.item_id for f in fences],
                "f_tokens": [f.lease_token for f in fences],
                "f_attempts": [f.attempt for f in fences],
                "f_versions": [f.claim_version for f in fences],
            }
            return params, None
        ids: dict[Any, ItemId] = {}
        encoded: list[str] = []
        for f in fences:
            key = f.item_id.hex if isinstance(f.item_id, uuid.UUID) else f.item_id
            ids[key] = f.item_id
            version = _NO_VERSION if f.claim_version is None else f"{f.claim_version:010d}"
            encoded.append(f"{f.lease_token.hex}{f.attempt:010d}{version}{key}")
        return {"f_keys": json.dumps(encoded)}, ids


_STORABLE = range(-999_999_999, 2**31)
"""Values both a 32-bit column and the 10-character SQLite encoding hold."""
_NO_VERSION = "-" * 10
"""The SQLite batch encoding of a fence that presents no claim_version."""
_ID_AT = 53
"""Where the id starts in the SQLite batch encoding (1-based, after 32 + 10 + 10)."""


def fence_storable(fence: Fence) -> bool:
    """Whether ``fence``'s attempt and claim_version are values a row can hold.

    One that is not (a forged ``2**40``) is stale by definition: a fenced
    write skips it instead of sending it, where Postgres would refuse the
    bind (integer out of range) and the refusal would surface as an error.
    """
    return fence.attempt in _STORABLE and (
        fence.claim_version is None or fence.claim_version in _STORABLE
    )
