"""The SQLAlchemy Core implementation of the repository port, for both engines."""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from trace_core.errors import ConfigurationError, DuplicateItem
from trace_core.model import TASKS, Fence, Holder, ItemState, Lease, QueueSpec
from trace_core.storage import schema
from trace_core.storage.engine import SQLITE_BEGIN, EngineSettings, create_engine
from trace_core.storage.protocol import (
    IdempotencyRecord,
    NewOutboxRow,
    NewTask,
    TaskCreated,
    TaskWakeup,
    Transaction,
)
from trace_core.storage.sql_api_keys import SqlApiKeyOps
from trace_core.storage.sql_attempts import (
    SqlAttemptOps,
    claim_opening_attempts,
    closing_params,
    finish_closing_attempts,
    held_by,
    holder_params,
)
from trace_core.storage.sql_catalog import SqlCatalogOps
from trace_core.storage.sql_concurrency import SqlConcurrencyOps
from trace_core.storage.sql_deploy import SqlDeployOps
from trace_core.storage.sql_errors import translate_errors
from trace_core.storage.sql_events import SqlEventOps
from trace_core.storage.sql_explain import SqlExplainOps
from trace_core.storage.sql_handoff import handoff_insert
from trace_core.storage.sql_handover import SqlHandoverOps
from trace_core.storage.sql_inbox import SqlInboxOps
from trace_core.storage.sql_inbox_credentials import SqlInboxCredentialOps
from trace_core.storage.sql_job_states import SqlJobStateOps
from trace_core.storage.sql_journal import SqlJournalOps
from trace_core.storage.sql_launch import SqlLaunchOps
from trace_core.storage.sql_leasing import (
    ClaimGate,
    LeaseStatements,
    fence_storable,
    status_in,
)
from trace_core.storage.sql_lineage import SqlLineageOps
from trace_core.storage.sql_operator_state import SqlOperatorStateOps
from trace_core.storage.sql_payload import SqlPayloadOps
from trace_core.storage.sql_people import SqlPeopleOps
from trace_core.storage.sql_reaper import SqlReaperOps
from trace_core.storage.sql_registry import SqlRegistryOps
from trace_core.storage.sql_routing import SqlRoutingOps
from trace_core.storage.sql_sources import SqlSourceOps
from trace_core.storage.sql_standalone import SqlStandaloneOps
from trace_core.storage.sql_status import SqlStatusOps
from trace_core.storage.sql_task_create import create_tasks_statement, new_task_batch
from trace_core.storage.sql_tasks import SqlTaskOps
from trace_core.storage.sql_webhook_delivery import SqlWebhookDeliveryOps
from trace_core.storage.sql_webhook_receipts import SqlWebhookReceiptOps
from trace_core.storage.url import DatabaseURL, parse_database_url
from trace_core.wakeup import Subscription, WakeupHub

if TYPE_CHECKING:
    from trace_core.storage.pg_direct import DirectPool
    from trace_core.storage.sqlite_direct import DirectScope, FollowUp, SqliteDirect

__all__ = ["SqlRepository", "SqlTransaction", "as_sql"]

ItemId = uuid.UUID | int


def as_sql(tx: Transaction) -> SqlTransaction:
    """``tx`` as the SQL transaction it is, for services that read and write
    their own tables (the Dispatcher's) inside a protocol transaction."""
    if not isinstance(tx, SqlTransaction):
        raise ConfigurationError(f"a SQL transaction is required here, got {type(tx).__name__}")
    return tx


def _distinct_keys(tasks: Sequence[NewTask]) -> bool:
    """Whether some of ``tasks`` have a dedupe key and no key repeats for one job."""
    keyed = [(t.job_id, t.dedupe_key) for t in tasks if t.dedupe_key is not None]
    return bool(keyed) and len(set(keyed)) == len(keyed)


class SqlTransaction:
    """One open transaction (or autocommit scope); the semantic operations of the port.

    In a Postgres :meth:`SqlRepository.statement` scope there is no
    SQLAlchemy connection up front: the protocol's reused statements run on
    the driver directly (:class:`~trace_core.storage.pg_direct.DirectPool`),
    and one autocommit connection is opened only if another statement needs it.
    In a SQLite one, every statement runs in the scope's write transaction on
    a sync connection (:class:`~trace_core.storage.sqlite_direct.DirectScope`).
    """

    def __init__(
        self,
        conn: AsyncConnection | None,
        repo: SqlRepository,
        *,
        direct: DirectPool | None = None,
        sqlite: DirectScope | None = None,
    ) -> None:
        self._conn = conn
        self._repo = repo
        self._direct = direct
        self._sqlite = sqlite
        self.engine_name: str = repo.engine_name
        self._stmts = repo.statements
        self.channels: set[str] = set()
        self.notified: set[str] = set()
        """Channels a statement already notified (``pg_notify`` inside it)."""

    @property
    def connection(self) -> AsyncConnection:
        """The SQLAlchemy connection, for tests and adapters that add their own
        tables to the same transaction (e.g. a completion ledger)."""
        if self._direct is not None or self._sqlite is not None or self._conn is None:
            raise ConfigurationError(
                "a statement() scope runs the protocol's statements only; "
                "use SqlRepository.autocommit() or transaction() for other SQL"
            )
        return self._conn

    async def _connection(self) -> AsyncConnection:
        """The SQLAlchemy connection, opened (autocommit) on first use in a direct scope."""
        if self._conn is None:
            self._conn = await self._repo.connect_autocommit()
        return self._conn

    async def _fetch(self, stmt: sa.Executable, params: Mapping[str, Any]) -> Sequence[Any]:
        """Rows of ``stmt``, a statement built once and reused (a cached builder's)."""
        if self._direct is not None:
            return await self._direct.fetch(stmt, params)
        rows: Sequence[Any] = (await self._execute(stmt, params)).all()
        return rows

    async def _fetch_many(
        self, calls: Sequence[tuple[sa.Executable, Mapping[str, Any]]]
    ) -> list[Sequence[Any]]:
        """Rows of each statement (each built once and reused), in order: in a
        Postgres statement scope in one round trip (pipelined), else one after
        the other."""
        if self._direct is not None:
            return await self._direct.fetch_many(calls)
        return [await self._fetch(stmt, params) for stmt, params in calls]

    async def _execute(self, stmt: sa.Executable, params: Any = None) -> Any:
        """``stmt`` through SQLAlchemy (any statement). In a SQLite statement
        scope its rows come back already fetched
        (:class:`~trace_core.storage.sqlite_direct.BufferedResult`)."""
        if self._sqlite is not None:
            return await self._sqlite.execute(stmt, params)
        conn = await self._connection()
        return await conn.execute(stmt, params)

    async def _execute_then(
        self, stmt: sa.Executable, params: Any, then: FollowUp, *, last: bool = False
    ) -> Sequence[Any]:
        """The rows of ``stmt``, after which the statement ``then`` builds from
        them (if any) runs in the same transaction. In a SQLite statement scope
        both go in one thread hop (:meth:`DirectScope.execute_then
        <trace_core.storage.sqlite_direct.DirectScope.execute_then>`); with
        ``last`` (nothing follows in the scope) the commit goes in it too."""
        if self._sqlite is not None:
            if last:
                return await self._sqlite.execute_then_commit(stmt, params, then)
            return (await self._sqlite.execute_then(stmt, params, then)).all()
        rows: Sequence[Any] = (await self._execute(stmt, params)).all()
        follow = then(rows)
        if follow is not None:
            await self._execute(*follow)
        return rows

    async def release(self) -> None:
        """Close a connection a direct scope opened on demand."""
        if self._direct is not None and self._conn is not None:
            with anyio.CancelScope(shield=True):
                await self._conn.close()
            self._conn = None

    def insert(self, table: sa.Table) -> Any:
        """A dialect INSERT (with ``on_conflict_do_nothing``) for ``table``."""
        dialect = postgresql if self.engine_name == "postgres" else sqlite
        return dialect.insert(table)

    # --- the areas of the port (created once per transaction, on first use) --

    @functools.cached_property
    def registry(self) -> SqlRegistryOps:
        """Orgs, datasets and dataset versions (:mod:`~trace_core.storage.sql_registry`)."""
        return SqlRegistryOps(self)

    @functools.cached_property
    def deploy(self) -> SqlDeployOps:
        """DAG versions, pointer sets and jobs (:mod:`~trace_core.storage.sql_deploy`)."""
        return SqlDeployOps(self)

    @functools.cached_property
    def tasks(self) -> SqlTaskOps:
        """Task lookups by job and runtime (:mod:`~trace_core.storage.sql_tasks`)."""
        return SqlTaskOps(self)

    @functools.cached_property
    def job_states(self) -> SqlJobStateOps:
        """Per-job state rows (:mod:`~trace_core.storage.sql_job_states`)."""
        return SqlJobStateOps(self)

    @functools.cached_property
    def concurrency(self) -> SqlConcurrencyOps:
        """Task counts and claim reads (:mod:`~trace_core.storage.sql_concurrency`)."""
        return SqlConcurrencyOps(self)

    @functools.cached_property
    def sources(self) -> SqlSourceOps:
        """Source runs and cron schedules (:mod:`~trace_core.storage.sql_sources`)."""
        return SqlSourceOps(self, self.job_states)

    @functools.cached_property
    def launch(self) -> SqlLaunchOps:
        """Startable tasks and their runtime (:mod:`~trace_core.storage.sql_launch`)."""
        return SqlLaunchOps(self)

    @functools.cached_property
    def operator_state(self) -> SqlOperatorStateOps:
        """Versioned per-job operator state (:mod:`~trace_core.storage.sql_operator_state`)."""
        return SqlOperatorStateOps(self)

    @functools.cached_property
    def payload(self) -> SqlPayloadOps:
        """What task payloads are built from (:mod:`~trace_core.storage.sql_payload`)."""
        return SqlPayloadOps(self)

    @functools.cached_property
    def standalone(self) -> SqlStandaloneOps:
        """Jobs outside any deployed DAG (:mod:`~trace_core.storage.sql_standalone`)."""
        return SqlStandaloneOps(self)

    @functools.cached_property
    def reaper(self) -> SqlReaperOps:
        """What the reaper reads (:mod:`~trace_core.storage.sql_reaper`)."""
        return SqlReaperOps(self)

    @functools.cached_property
    def handover(self) -> SqlHandoverOps:
        """Revoking a gone holder's leases (:mod:`~trace_core.storage.sql_handover`)."""
        return SqlHandoverOps(self)

    @functools.cached_property
    def explain(self) -> SqlExplainOps:
        """Reads for explain and metrics (:mod:`~trace_core.storage.sql_explain`)."""
        return SqlExplainOps(self)

    @functools.cached_property
    def status(self) -> SqlStatusOps:
        """What a DAG has done so far (:mod:`~trace_core.storage.sql_status`)."""
        return SqlStatusOps(self)

    @functools.cached_property
    def events(self) -> SqlEventOps:
        """Event rows and version progress (:mod:`~trace_core.storage.sql_events`)."""
        return SqlEventOps(self)

    @functools.cached_property
    def routing(self) -> SqlRoutingOps:
        """Routing reads and writes (:mod:`~trace_core.storage.sql_routing`)."""
        return SqlRoutingOps(self)

    @functools.cached_property
    def journal(self) -> SqlJournalOps:
        """The job journal (:mod:`~trace_core.storage.sql_journal`)."""
        return SqlJournalOps(self)

    @functools.cached_property
    def api_keys(self) -> SqlApiKeyOps:
        """Euterpe's requester API keys (:mod:`~trace_core.storage.sql_api_keys`)."""
        return SqlApiKeyOps(self)

    @functools.cached_property
    def people(self) -> SqlPeopleOps:
        """Users, org roles, memberships, read roles (:mod:`~trace_core.storage.sql_people`)."""
        return SqlPeopleOps(self)

    @functools.cached_property
    def catalog(self) -> SqlCatalogOps:
        """An org's DAGs, datasets, jobs and tasks (:mod:`~trace_core.storage.sql_catalog`)."""
        return SqlCatalogOps(self)

    @functools.cached_property
    def inbox_credentials(self) -> SqlInboxCredentialOps:
        """Inbox jobs' sealed credentials (:mod:`~trace_core.storage.sql_inbox_credentials`)."""
        return SqlInboxCredentialOps(self)

    @functools.cached_property
    def inbox(self) -> SqlInboxOps:
        """Euterpe's inbox jobs, history and events (:mod:`~trace_core.storage.sql_inbox`)."""
        return SqlInboxOps(self)

    @functools.cached_property
    def webhook_receipts(self) -> SqlWebhookReceiptOps:
        """A webhook receiver's nonces and event ids (``sql_webhook_receipts``)."""
        return SqlWebhookReceiptOps(self)

    @functools.cached_property
    def webhook_delivery(self) -> SqlWebhookDeliveryOps:
        """The deliverer's ordered claim and targets (``sql_webhook_delivery``)."""
        return SqlWebhookDeliveryOps(self, self.claim)

    @functools.cached_property
    def attempts(self) -> SqlAttemptOps:
        """Task attempts as records (:mod:`~trace_core.storage.sql_attempts`)."""
        return SqlAttemptOps(self)

    @functools.cached_property
    def lineage(self) -> SqlLineageOps:
        """Column lineage (:mod:`~trace_core.storage.sql_lineage`)."""
        return SqlLineageOps(self)

    # --- ownership protocol -------------------------------------------------

    async def claim(
        self,
        queue: QueueSpec,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime,
        limit: int = 1,
        item_id: ItemId | None = None,
        gate: ClaimGate | None = None,
    ) -> list[Lease]:
        # ``gate`` (SQL only, not in the port): an extra claim condition, for
        # areas that need the generic claim with one more test (webhook order).
        expires_at = now + timedelta(seconds=lease_seconds)
        params: dict[str, Any] = {"b_worker_id": worker_id, "now": now, "expires_at": expires_at}
        if item_id is not None:
            params["item_id"] = item_id
        else:
            params["limit"] = limit
        stmt: sa.Executable = self._stmts.claim(queue, item_id is not None, gate)
        rows, attempt_ids = await self._claiming(
            queue, stmt, params, worker_id=worker_id, now=now, what=f"claim {queue.name}"
        )
        return self._leases(
            queue, rows, worker_id=worker_id, expires_at=expires_at, ids=attempt_ids
        )

    async def _claiming(
        self,
        queue: QueueSpec,
        stmt: sa.Executable,
        params: Mapping[str, Any],
        *,
        worker_id: str,
        now: datetime,
        what: str,
        last: bool = False,
        fresh: bool = False,
    ) -> tuple[Sequence[Any], dict[uuid.UUID, uuid.UUID]]:
        """Run a claiming statement (it returns the claim's columns): the rows,
        and the ids of the attempts opened with a claim of tasks. ``last``: no
        statement follows in a statement scope (see :meth:`_execute_then`);
        ``fresh``: the statement created the tasks (their attempt rows are new)."""
        # A claimed task starts an execution attempt: its job_attempts row is
        # opened with the claim (see sql_attempts for how, per engine).
        records = queue.name == TASKS.name
        opens_in_claim = records and self.engine_name == "postgres"
        if opens_in_claim:
            assert isinstance(stmt, sa.Update | sa.Insert)
            stmt = _opening(stmt, fresh)
        attempt_ids: dict[uuid.UUID, uuid.UUID] = {}
        with translate_errors(what):
            if records and not opens_in_claim:
                # SQLite: the attempt rows (their ids made here) go in the claim's hop.
                def opening(claimed: Sequence[Any]) -> tuple[sa.Executable, Any] | None:
                    if not claimed:
                        return None
                    pairs = [(row[0], row[1]) for row in claimed]
                    stmt, rows, opened = self.attempts.opening(
                        pairs, worker_id=worker_id, now=now, fresh=fresh
                    )
                    attempt_ids.update(opened)
                    return stmt, rows

                rows = await self._execute_then(stmt, params, opening, last=last)
            else:
                rows = await self._fetch(stmt, params)
        if opens_in_claim:
            attempt_ids = {row[0]: row[-1] for row in rows}
            rows = [row[:-1] for row in rows]
        return rows, attempt_ids

    def _leases(
        self,
        queue: QueueSpec,
        rows: Sequence[Any],
        *,
        worker_id: str,
        expires_at: datetime,
        ids: Mapping[uuid.UUID, uuid.UUID],
    ) -> list[Lease]:
        """The leases of a claiming statement's rows."""
        qt = self._stmts.table(queue)
        data_keys = [col.key for col in qt.data]
        return [
            Lease(
                queue=queue.name,
                item_id=row[0],
                attempt=row[1],
                claim_version=row[2],
                lease_token=row[3],
                worker_id=worker_id,
                expires_at=expires_at,
                max_attempts=row[4],
                data=dict(zip(data_keys, row[5:], strict=True)),
                attempt_id=ids.get(row[0]),
            )
            for row in rows
        ]

    async def create_claimed_tasks(
        self, tasks: Sequence[NewTask], *, now: datetime, worker_id: str, lease_seconds: float
    ) -> list[Lease]:
        expires_at = now + timedelta(seconds=lease_seconds)
        stmt, params = handoff_insert(self.engine_name, tasks, now=now, expires_at=expires_at)
        params["b_worker_id"] = worker_id
        # In a statement scope it commits by itself on both engines (Postgres:
        # autocommit; SQLite: the commit in the insert's own thread hop).
        rows, attempt_ids = await self._claiming(
            TASKS,
            stmt,
            params,
            worker_id=worker_id,
            now=now,
            what="create claimed tasks",
            last=True,
            fresh=True,
        )
        return self._leases(
            TASKS, rows, worker_id=worker_id, expires_at=expires_at, ids=attempt_ids
        )

    async def inspect(self, queue: QueueSpec, item_id: ItemId) -> ItemState | None:
        with translate_errors(f"inspect {queue.name}"):
            rows = await self._fetch(self._stmts.inspect(queue), {"item_id": item_id})
        return ItemState(*rows[0]) if rows else None

    async def heartbeat(
        self,
        queue: QueueSpec,
        fence: Fence,
        *,
        now: datetime,
        expires_at: datetime,
        holder: Holder | None = None,
    ) -> datetime | None:
        if not fence_storable(fence):
            return None  # no row holds such a fence: stale
        stmt = self._stmts.heartbeat(queue)
        params = self._stmts.fence_params(fence) | {"now": now, "expires_at": expires_at}
        if holder is not None:
            stmt, params = _held(queue, stmt, params, holder)
        with translate_errors(f"heartbeat {queue.name}"):
            rows = await self._fetch(stmt, params)
        value: datetime | None = rows[0][0] if rows else None
        return value

    async def transition(
        self,
        queue: QueueSpec,
        fence: Fence,
        *,
        sources: Collection[str],
        target: str,
        now: datetime,
        values: Mapping[str, Any] | None = None,
        attempt_result: Mapping[str, Any] | None = None,
        holder: Holder | None = None,
    ) -> bool:
        if not fence_storable(fence):
            return False  # no row holds such a fence: stale
        values = values or {}
        # refund_attempt is a flag: it shapes the statement, it binds nothing.
        keys = tuple(sorted(k for k, v in values.items() if k != "refund_attempt" or v))
        stmt, bound = self._stmts.transition(queue, frozenset(sources), target, keys)
        params = self._stmts.fence_params(fence) | {f"v_{k}": values[k] for k in bound}
        if holder is not None:
            stmt, params = _held(queue, stmt, params, holder)
        if target == queue.done:
            params["now"] = now
        if queue.name != TASKS.name or target in queue.leased:
            with translate_errors(f"{queue.name} -> {target}"):
                return bool(await self._fetch(stmt, params))
        # The attempt ends: its record is closed with the task row.
        ending = closing_params(_ATTEMPT_END.get(target, "Failed"), now, None, attempt_result)
        with translate_errors(f"{queue.name} -> {target}"):
            if self.engine_name == "postgres":
                return bool(await self._fetch(_closing(stmt), params | ending))
            # SQLite: the attempt's record closes in the same hop as the task row.
            close_record = self.attempts.closing(
                [(_uuid(fence.item_id), fence.attempt)],
                status=ending["a_status"],
                now=now,
                result=attempt_result,
            )
            ended = await self._execute_then(
                stmt, params, lambda rows: close_record if rows else None
            )
        return bool(ended)

    async def complete_many(
        self,
        queue: QueueSpec,
        fences: Sequence[Fence],
        *,
        sources: Collection[str],
        now: datetime,
    ) -> set[ItemId]:
        if not fences:
            return set()
        stmt: sa.Executable = self._stmts.complete_many(queue, frozenset(sources))
        params, ids = self._stmts.fence_batch(fences)
        records = queue.name == TASKS.name
        if records and self.engine_name == "postgres":
            assert isinstance(stmt, sa.Update)
            stmt = _completing_many(stmt)
            params |= closing_params("Completed", now, None)

        def done_of(rows: Sequence[Any]) -> set[ItemId]:
            return {row[0] for row in rows} if ids is None else {ids[row[0]] for row in rows}

        def closing(rows: Sequence[Any]) -> tuple[sa.Executable, Any] | None:
            # Each row answers the attempt it completed (see complete_many).
            keys = [row[0] if ids is None else ids[row[0]] for row in rows]
            ended = [(_uuid(key), row[1]) for key, row in zip(keys, rows, strict=True)]
            return self.attempts.closing(ended, status="Completed", now=now) if ended else None

        with translate_errors(f"complete {queue.name}"):
            if records and self.engine_name != "postgres":
                # SQLite: the attempts' records close in the completion's hop.
                rows = await self._execute_then(stmt, params | {"now": now}, closing)
            else:
                rows = await self._fetch(stmt, params | {"now": now})
        return done_of(rows)

    async def fail(
        self,
        queue: QueueSpec,
        fence: Fence,
        *,
        now: datetime,
        retryable: bool,
        retry_at: datetime | None,
        error: str,
        expired_before: datetime | None = None,
        timed_out: bool = False,
    ) -> tuple[tuple[str, ...], bool] | None:
        if not fence_storable(fence):
            return None  # no row holds such a fence: stale
        qt = self._stmts.table(queue)
        c = qt.c
        # Where the lifecycle has no leased -> dead edge (inbox jobs:
        # euterpe-contract.md section 3 allows only failed -> dead_letter),
        # an exhausted failure first lands in the retry status and is then
        # dead-lettered from there by a second fenced write.
        via_retry = not any(queue.lifecycle.allows(s, queue.dead) for s in queue.leased)
        dead = queue.retry_to if via_retry else queue.dead
        dead_retry_at = None if qt.retry_at.nullable else qt.retry_at
        values: dict[Any, Any] = {qt.error: error, c.lease_expires_at: None}
        retrying: sa.ColumnElement[bool]
        if retryable and retry_at is not None:
            # The row's own budget decides, inside the statement.
            retrying = qt.attempt < c.max_attempts
            when = sa.bindparam("retry_at_value", retry_at, type_=qt.retry_at.type)
            values[c.status] = sa.case((retrying, queue.retry_to), else_=dead)
            values[qt.retry_at] = sa.case((retrying, when), else_=dead_retry_at)
            values[qt.finished_at] = sa.case((retrying, qt.finished_at), else_=now)
        else:
            retrying = sa.false()
            values[c.status] = dead
            values[qt.retry_at] = dead_retry_at
            values[qt.finished_at] = now
        where = [*self._stmts.fence(qt), status_in(c.status, queue.leased)]
        if expired_before is not None:
            where.append(c.lease_expires_at < expired_before)
        if expired_before is not None or timed_out:
            if queue.expiry_bumps_claim_version:
                values[c.claim_version] = c.claim_version + 1
            else:
                # The timeout mark: the lease expiry stays, and with it the
                # holder's right to a late reply (LeaseStatements.finishable).
                del values[c.lease_expires_at]
        stmt = (
            sa.update(qt.table)
            .where(*where)
            .values(values)
            .returning(c.status, retrying, c.claim_version)
        )
        with translate_errors(f"fail {queue.name}"):
            row = (await self._execute(stmt, self._stmts.fence_params(fence))).first()
        if row is None:
            return None
        status, retried, claim_version = row[0], bool(row[1]), row[2]
        if queue.name == TASKS.name:
            # Every caller fails in a transaction (LeaseQueue): the attempt's
            # record closes in it, with a structured error the reporter may
            # refine in the same transaction (tx.attempts.set_error_if_ended).
            if expired_before is not None:
                code, ended = "lease_expired", "Expired"
            elif timed_out:
                code, ended = "timed_out", "TimedOut"
            else:
                code, ended = "error", "Failed"
            await self.attempts.close(
                [(_uuid(fence.item_id), fence.attempt)],
                status=ended,
                now=now,
                error={"code": code, "message": error, "stack": None, "retryable": retryable},
            )
        if retried or not via_retry:
            return (status,), retried
        # failed -> dead_letter, in the caller's transaction and under the
        # whole fence: the claim_version is the one the failure left (a
        # reclaim bumped it).
        moved = await self.transition(
            queue,
            Fence(fence.item_id, fence.attempt, fence.lease_token, claim_version),
            sources=(queue.retry_to,),
            target=queue.dead,
            now=now,
        )
        if not moved:  # the row is locked by the update above: cannot happen
            raise RuntimeError(
                f"{queue.name} {fence.item_id}: failed -> {queue.dead} matched no row"
            )
        return (status, queue.dead), False

    async def expired(self, queue: QueueSpec, *, now: datetime, limit: int) -> list[Fence]:
        with translate_errors(f"expired {queue.name}"):
            rows = await self._fetch(self._stmts.expired(queue), {"now": now, "limit": limit})
        return [Fence(r[0], r[1], r[2], r[3]) for r in rows]

    async def requeue_due(self, queue: QueueSpec, *, now: datetime, limit: int) -> list[ItemId]:
        with translate_errors(f"requeue {queue.name}"):
            rows = await self._fetch(self._stmts.requeue_due(queue), {"now": now, "limit": limit})
        return [row[0] for row in rows]

    async def force_transition(
        self,
        queue: QueueSpec,
        item_ids: Sequence[ItemId],
        *,
        sources: Collection[str],
        target: str,
        now: datetime,
        error: str | None = None,
    ) -> set[ItemId]:
        if not item_ids:
            return set()
        qt = self._stmts.table(queue)
        c = qt.c
        values: dict[Any, Any] = {
            c.status: target,
            c.claim_version: c.claim_version + 1,
            c.lease_expires_at: None,
        }
        if target in queue.lifecycle.terminal:
            values[qt.finished_at] = now
        if error is not None:
            values[qt.error] = error
        where = [c.id.in_(list(item_ids)), status_in(c.status, sources)]
        if queue.dead == queue.retry_to and queue.dead in sources and target != queue.dead:
            # One status is both "waiting for a retry" and the dead letter
            # (tasks' Failed): only the first kind is unfinished and may move.
            where.append(sa.or_(c.status != queue.dead, qt.retry_at.is_not(None)))
        stmt = sa.update(qt.table).where(*where).values(values).returning(c.id)
        with translate_errors(f"{queue.name} -> {target}"):
            moved: set[ItemId] = set((await self._execute(stmt)).scalars().all())
        if queue.name == TASKS.name and moved:
            # Administrative moves run in a transaction (LeaseQueue): the
            # running attempts of the moved tasks end with them.
            ended = "Canceled" if target == "Canceled" else "Failed"
            await self.attempts.close_running(
                [_uuid(i) for i in moved],
                status=ended,
                now=now,
                error={
                    "code": ended.lower(),
                    "message": error or ended.lower(),
                    "stack": None,
                    "retryable": False,
                },
            )
        return moved

    # --- tasks and outbox ---------------------------------------------------

    async def create_tasks(
        self, tasks: Sequence[NewTask], *, now: datetime, wakeup: TaskWakeup | None = None
    ) -> list[TaskCreated]:
        if self.engine_name == "postgres":
            return await self._create_tasks_in_one(tasks, now, wakeup)
        t = schema.tasks
        ids = [uuid.uuid4() for _ in tasks]
        created: set[uuid.UUID] = set()
        with translate_errors("create tasks"):
            if tasks:
                rows = [
                    {
                        "id": task_id,
                        "job_id": task.job_id,
                        "dedupe_key": task.dedupe_key,
                        "status": "Queued",
                        "attempt": 1,
                        "claim_version": 0,
                        "partitions": (
                            list(task.partitions) if task.partitions is not None else None
                        ),
                        "input_versions": (
                            dict(task.input_versions) if task.input_versions is not None else None
                        ),
                        "max_attempts": task.max_attempts,
                        "created_at": now,
                        "queued_at": now + timedelta(seconds=task.handicap_seconds),
                    }
                    for task_id, task in zip(ids, tasks, strict=True)
                ]
                # executemany with RETURNING: SQLAlchemy batches it into
                # multi-row INSERTs ("insertmanyvalues") from one cached
                # statement, several times faster than compiling a VALUES list.
                stmt = self.insert(t).on_conflict_do_nothing().returning(t.c.id)
                created.update((await self._execute(stmt, rows)).scalars().all())
            # A row that was not inserted lost a dedupe race (or repeats a key):
            # answer with the id of the task that holds the key.
            existing = await self._existing_task_ids(
                [
                    (task.job_id, task.dedupe_key)
                    for task_id, task in zip(ids, tasks, strict=True)
                    if task_id not in created
                ]
            )
        if wakeup is not None:
            await self.wake_tasks([i for i in ids if i in created], wakeup, now=now)
        return [
            TaskCreated(task_id, True, task.dedupe_key)
            if task_id in created
            else TaskCreated(existing[(task.job_id, task.dedupe_key)], False, task.dedupe_key)
            for task_id, task in zip(ids, tasks, strict=True)
        ]

    async def _create_tasks_in_one(
        self, tasks: Sequence[NewTask], now: datetime, wakeup: TaskWakeup | None
    ) -> list[TaskCreated]:
        """Postgres: any number of tasks, their wake-up rows and the notify in
        one statement (:mod:`~trace_core.storage.sql_task_create`)."""
        if not tasks:
            return []
        batch = new_task_batch(tasks, now=now, wakeup=wakeup)
        with translate_errors("create tasks"):
            answer = None
            if batch.params["dedupe_keys"] is None:
                # No keys: every row is new (its id is).
                answer = await self._fetch(
                    create_tasks_statement(wakeup, all_new=True), batch.params
                )
            elif self._direct is not None and self._repo.keys_were_new and _distinct_keys(tasks):
                # Autocommit: a failed statement leaves nothing behind to roll back.
                try:
                    with translate_errors("create tasks"):
                        answer = await self._fetch(
                            create_tasks_statement(wakeup, all_new=True), batch.params
                        )
                except DuplicateItem:
                    self._repo.keys_were_new = False
            if answer is None:
                answer = await self._fetch(create_tasks_statement(wakeup), batch.params)
            ((inserted, _, missing),) = answer
            # The next keyed batch tries the plain insert again only after
            # one whose keys were all new: a stream of repeats pays no failures.
            self._repo.keys_were_new = not missing
            # A row that was not inserted lost a dedupe race (or repeats a key):
            # answer with the id of the task that holds the key.
            skipped = {n - 1 for n in missing or ()}
            existing = await self._existing_task_ids(
                [(tasks[i].job_id, tasks[i].dedupe_key) for i in sorted(skipped)]
            )
        if inserted and wakeup is not None:
            self.channels.update(wakeup.channels)
            self.notified.update(wakeup.channels)
        if not skipped:
            return list(map(TaskCreated, batch.ids, itertools.repeat(True), batch.keys))
        return [
            TaskCreated(existing[(task.job_id, task.dedupe_key)], False, task.dedupe_key)
            if i in skipped
            else TaskCreated(task_id, True, task.dedupe_key)
            for i, (task_id, task) in enumerate(zip(batch.ids, tasks, strict=True))
        ]

    async def wake_tasks(
        self, task_ids: Sequence[uuid.UUID], wakeup: TaskWakeup, *, now: datetime
    ) -> None:
        if not task_ids:
            return
        if wakeup.outbox_kind is not None:
            ids = [str(t) for t in task_ids]
            await self.insert_outbox(
                [
                    NewOutboxRow(wakeup.outbox_kind, {"task_ids": ids[k : k + wakeup.chunk]})
                    for k in range(0, len(ids), wakeup.chunk)
                ],
                now=now,
            )
        self.channels.update(wakeup.channels)

    async def _existing_task_ids(
        self, keys: list[tuple[uuid.UUID, str | None]]
    ) -> dict[tuple[uuid.UUID, str | None], uuid.UUID]:
        if not keys:
            return {}
        t = schema.tasks
        stmt = sa.select(t.c.job_id, t.c.dedupe_key, t.c.id).where(
            sa.tuple_(t.c.job_id, t.c.dedupe_key).in_(keys)
        )
        rows = (await self._execute(stmt)).all()
        return {(r[0], r[1]): r[2] for r in rows}

    async def insert_outbox(self, rows: Sequence[NewOutboxRow], *, now: datetime) -> list[int]:
        if not rows:
            return []
        t = schema.outbox
        values = [
            {
                "kind": row.kind,
                "payload": dict(row.payload),
                "status": "Pending",
                "available_at": row.available_at or now,
                "attempts": 0,
                "claim_version": 0,
                "max_attempts": row.max_attempts,
                "created_at": now,
            }
            for row in rows
        ]
        with translate_errors("insert outbox"):
            result = await self._execute(sa.insert(t).returning(t.c.id), values)
            return list(result.scalars().all())

    def notify(self, channel: str) -> None:
        self.channels.add(channel)

    # --- idempotency keys ---------------------------------------------------

    async def idempotency_claim(
        self,
        scope: str,
        key: str,
        request_hash: str,
        *,
        now: datetime,
        expires_at: datetime,
    ) -> IdempotencyRecord:
        t = schema.idempotency_keys
        fresh = {
            "request_hash": request_hash,
            "status": "in_flight",
            "response": None,
            "created_at": now,
            "completed_at": None,
            "expires_at": expires_at,
        }
        cols = (t.c.request_hash, t.c.status, t.c.response, t.c.created_at, t.c.expires_at)
        # One atomic statement: insert, or take over a key that has expired.
        # The conflict branch's WHERE makes a live key a no-op (no row back).
        stmt = (
            self.insert(t)
            .values(scope=scope, key=key, **fresh)
            .on_conflict_do_update(
                index_elements=[t.c.scope, t.c.key],
                set_=fresh,
                where=t.c.expires_at <= now,
            )
            .returning(*cols)
        )
        with translate_errors("idempotency claim"):
            row = (await self._execute(stmt)).first()
            claimed = row is not None
            if row is None:
                row = (
                    await self._execute(sa.select(*cols).where(t.c.scope == scope, t.c.key == key))
                ).one()
        return IdempotencyRecord(scope, key, row[0], row[1], row[2], row[3], row[4], claimed)

    async def idempotency_complete(
        self, scope: str, key: str, request_hash: str, response: Any, *, now: datetime
    ) -> bool:
        t = schema.idempotency_keys
        stmt = (
            sa.update(t)
            .where(
                t.c.scope == scope,
                t.c.key == key,
                t.c.request_hash == request_hash,
                t.c.status == "in_flight",
            )
            .values(status="completed", response=response, completed_at=now)
        )
        with translate_errors("idempotency complete"):
            return bool((await self._execute(stmt)).rowcount)

    async def idempotency_release(self, scope: str, key: str, request_hash: str) -> bool:
        t = schema.idempotency_keys
        stmt = sa.delete(t).where(
            t.c.scope == scope,
            t.c.key == key,
            t.c.request_hash == request_hash,
            t.c.status == "in_flight",
        )
        with translate_errors("idempotency release"):
            return bool((await self._execute(stmt)).rowcount)

    async def idempotency_sweep(self, *, now: datetime, limit: int) -> int:
        t = schema.idempotency_keys
        pick = sa.select(t.c.scope, t.c.key).where(t.c.expires_at <= now).limit(limit)
        stmt = sa.delete(t).where(sa.tuple_(t.c.scope, t.c.key).in_(pick))
        with translate_errors("idempotency sweep"):
            return int((await self._execute(stmt)).rowcount)


_ATTEMPT_END = {TASKS.done: "Completed", "Canceled": "Canceled"}
"""An attempt's final status by the task status a fenced transition moves it to."""


def _uuid(item_id: ItemId) -> uuid.UUID:
    return item_id if isinstance(item_id, uuid.UUID) else uuid.UUID(str(item_id))


def _held(
    queue: QueueSpec, stmt: sa.Update, params: dict[str, Any], holder: Holder
) -> tuple[sa.Update, dict[str, Any]]:
    """A fenced write of one task that also checks ``holder`` (its record's worker
    and message, :func:`~trace_core.storage.sql_attempts.held_by`)."""
    if queue.name != TASKS.name:
        raise ConfigurationError(f"a holder is checked on tasks only, not {queue.name}")
    return held_by(stmt), params | holder_params(holder)


@functools.cache
def _completing_many(complete_many: sa.Update) -> sa.Select[Any]:
    """Postgres: the cached batch completion of tasks closing their attempts
    (built once per cached statement, so the direct pool compiles it once)."""
    return finish_closing_attempts(complete_many)


@functools.cache
def _opening(claim: sa.Update | sa.Insert, fresh: bool = False) -> sa.Select[Any]:
    """Postgres: the cached tasks claim opening its attempts (built once per
    cached claim: built per call, it was compiled per call on the direct path
    and pushed the other statements out of its compiled cache)."""
    return claim_opening_attempts(claim, fresh=fresh)


@functools.cache
def _closing(finish: sa.Update) -> sa.Select[Any]:
    """Postgres: the cached fenced finish of a task closing its attempt (built
    once per cached transition, so the direct pool compiles it once)."""
    return finish_closing_attempts(finish)


@functools.cache
def _notify_all(channels: tuple[str, ...]) -> sa.Select[Any]:
    """``SELECT pg_notify(ch, '')`` for each channel, in one statement."""
    return sa.select(*(sa.func.pg_notify(ch, "") for ch in channels))


async def _rollback_quietly(conn: AsyncConnection) -> None:
    """Roll back after an error; a rollback that fails too (the server is gone)
    must not hide the error that caused it: the connection is invalidated
    instead, so that the pool never hands it out again."""
    try:
        await conn.rollback()
    except sa.exc.DBAPIError:
        await conn.invalidate()


class SqlRepository:
    """A Trace database on SQLite or Postgres, reached through SQLAlchemy."""

    def __init__(
        self,
        url: str | DatabaseURL,
        settings: EngineSettings | None = None,
        *,
        hub: WakeupHub | None = None,
    ) -> None:
        self.url = url if isinstance(url, DatabaseURL) else parse_database_url(url)
        self.engine_name: str = self.url.engine
        self.engine: AsyncEngine = create_engine(self.url, settings)
        self.statements = LeaseStatements(self.engine_name)
        self.keys_were_new = True
        """Whether the last batch of tasks created on Postgres inserted every
        row: the next keyed batch then tries the plain insert first."""
        self.hub = hub or WakeupHub()
        self.identity: str = self.url.render()
        # SQLite has one writer. Writers of this process queue here, on an
        # async lock, instead of spinning in SQLite's busy handler.
        self._write_lock = anyio.Lock() if self.engine_name == "sqlite" else None
        self._listener: Any = None
        self._direct: DirectPool | None = None
        self._sqlite: SqliteDirect | None = None
        if self.engine_name == "postgres":
            from trace_core.storage.pg_direct import DirectPool as Direct

            self._direct = Direct(
                self.url, self.engine.dialect, max_idle=(settings or EngineSettings()).pool_size
            )
        else:
            from trace_core.storage.sqlite_direct import SqliteDirect as Sqlite

            self._sqlite = Sqlite(self.url, settings or EngineSettings())

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SqlTransaction]:
        """A write transaction; its channels are notified after commit.

        Like every scope of this class, a driver error raised in its body (a
        statement of the caller's own, outside the protocol operations) leaves
        it translated (:func:`~trace_core.storage.sql_errors.translate_errors`):
        an outage as :class:`~trace_core.errors.DatabaseUnavailable`, a
        constraint violation as :class:`~trace_core.errors.DuplicateItem`.
        """
        if self._write_lock is not None:
            async with self._write_lock, self._open(write=True) as tx:
                yield tx
        else:
            async with self._open(write=True) as tx:
                yield tx

    @asynccontextmanager
    async def statement(self) -> AsyncIterator[SqlTransaction]:
        """For one statement that is atomic by itself (a batch claim, a batch
        completion, a heartbeat). Postgres: autocommit, sparing the BEGIN and
        COMMIT round trips, with the protocol's statements run on the driver
        directly (:mod:`~trace_core.storage.pg_direct`). SQLite: a write
        transaction whose statements each take one thread hop
        (:mod:`~trace_core.storage.sqlite_direct`). ``tx.connection`` is not
        available in either (see :meth:`autocommit`)."""
        if self._sqlite is not None:
            async with self._sqlite_statement() as tx:
                yield tx
            return
        assert self._direct is not None  # Postgres: made with the repository
        tx = SqlTransaction(None, self, direct=self._direct)
        with translate_errors("statement"):
            try:
                yield tx
                pending = tx.channels - tx.notified
                if pending:
                    with translate_errors("notify"):
                        await self._direct.fetch(_notify_all(tuple(sorted(pending))), {})
            finally:
                await tx.release()
        for channel in tx.channels:
            self.hub.fire(channel)

    @asynccontextmanager
    async def _sqlite_statement(self) -> AsyncIterator[SqlTransaction]:
        """SQLite :meth:`statement`: under the in-process write lock, like
        :meth:`transaction`, but on the sync engine (one hop per statement,
        one for the commit)."""
        assert self._sqlite is not None and self._write_lock is not None
        async with self._write_lock:
            scope = self._sqlite.scope()
            tx = SqlTransaction(None, self, sqlite=scope)
            with translate_errors("statement"):
                try:
                    yield tx
                    # A scope cancelled before its commit rolls back, as on the
                    # async path, even if the cancellation came while a statement
                    # ran on its thread (it is only delivered at the next checkpoint).
                    await anyio.lowlevel.checkpoint_if_cancelled()
                except BaseException:
                    await scope.finish(commit=False)
                    raise
                with translate_errors("commit"):
                    await scope.finish(commit=True)
        for channel in tx.channels:
            self.hub.fire(channel)

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[SqlTransaction]:
        """Statements that each commit by themselves, through SQLAlchemy with
        ``tx.connection`` available (services reading their own tables without
        a snapshot across statements). SQLite: a write transaction."""
        if self.engine_name != "postgres":
            async with self.transaction() as tx:
                yield tx
            return
        conn = await self.connect_autocommit()
        with translate_errors("autocommit"):
            try:
                tx = SqlTransaction(conn, self)
                yield tx
                await self._notify(conn, tx)
            finally:
                with anyio.CancelScope(shield=True):
                    await conn.close()
        for channel in tx.channels:
            self.hub.fire(channel)

    async def connect_autocommit(self) -> AsyncConnection:
        """A pooled SQLAlchemy connection in autocommit mode (Postgres)."""
        with translate_errors("connect"):
            conn = await self.engine.connect()
            try:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await conn.close()
                raise
        return conn

    async def _notify(self, conn: AsyncConnection, tx: SqlTransaction) -> None:
        """Postgres: ``pg_notify`` the channels no statement notified yet (delivered
        at commit; one per channel however many rows, all in one trip)."""
        pending = tx.channels - tx.notified
        if pending and self.engine_name == "postgres":
            await conn.execute(_notify_all(tuple(sorted(pending))))

    @asynccontextmanager
    async def read(self) -> AsyncIterator[SqlTransaction]:
        """A read-only transaction (SQLite: deferred, takes no write lock)."""
        async with self._open(write=False) as tx:
            yield tx

    @asynccontextmanager
    async def _open(self, *, write: bool) -> AsyncIterator[SqlTransaction]:
        with translate_errors("connect"):
            conn = await self.engine.connect()
        # The whole scope, its body included: a failing statement of the
        # caller's, or a rollback on a connection the server dropped, leaves
        # as a core error, never as the driver's.
        with translate_errors("transaction" if write else "read"):
            try:
                if self.engine_name == "sqlite":
                    mode = "IMMEDIATE" if write else "DEFERRED"
                    await conn.execution_options(**{SQLITE_BEGIN: mode})
                with translate_errors("begin"):
                    await conn.begin()
                tx = SqlTransaction(conn, self)
                try:
                    yield tx
                    await self._notify(conn, tx)
                    with translate_errors("commit"):
                        await conn.commit()
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await _rollback_quietly(conn)
                    raise
            finally:
                with anyio.CancelScope(shield=True):
                    await conn.close()
        for channel in tx.channels:
            self.hub.fire(channel)

    async def ping(self) -> None:
        """One round trip to the database (``SELECT 1``), for readiness checks;
        :class:`~trace_core.errors.DatabaseUnavailable` when it cannot be reached."""
        async with self.read() as tx:
            await tx.connection.execute(sa.select(sa.literal(1)))

    async def listen(self, channel: str, max_wait: float = 10.0) -> bool:
        """Make commits on ``channel`` in other processes wake this one.

        On Postgres, returns once ``LISTEN`` is in effect (False if that took
        longer than ``max_wait``); on SQLite, wake-ups are in-process only and
        this returns True at once.
        """
        if self.engine_name != "postgres":
            return True
        if self._listener is None:
            from trace_core.storage.pg_listener import PgListener

            self._listener = PgListener(self.url, self.hub)
        active = self._listener.listen(channel)
        if active.is_set():
            # Already in effect (every claim's long-poll subscribes): no thread hop.
            return True
        return await anyio.to_thread.run_sync(active.wait, max_wait)

    async def subscribe(self, channel: str) -> Subscription:
        """Wake-ups of ``channel`` for a consumer loop; on Postgres, once LISTEN
        is in effect, commits in other processes wake it too."""
        await self.listen(channel)
        return self.hub.subscribe(channel)

    async def close(self) -> None:
        """Dispose of the pools and stop the listener; :meth:`statement` scopes
        are refused afterwards."""
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        if self._direct is not None:
            await self._direct.close()
        if self._sqlite is not None:
            await self._sqlite.close()
        await self.engine.dispose()
