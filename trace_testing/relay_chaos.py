"""The outbox relay as a process that can be SIGKILLed, and the scenario
that does so mid-batch (:func:`relay_kill_drain`).

:func:`run_relay` is a :class:`~trace_testing.faults.WorkerFleet` target: the
real :class:`~trace_core.outbox.OutboxRelay` service loop (what a Dispatcher
runs), whose handler for the kind :data:`KIND` records each delivery in
:class:`DeliveryLedger` (its own transaction: a delivery is a side effect
outside the row's, like a webhook call). Delivery is at-least-once: a relay
killed after a delivery and before marking the row done delivers it again
once the row's lease expires, so the ledger counts deliveries per row, with
no unique key, and the report counts the duplicates.

An embedder's own handler can run instead of the ledger's
(``RelayProcessConfig(handler="my_package.outbox:send")``, an async
``(payload)``; its deliveries are still recorded after it returns).
"""

from __future__ import annotations

import importlib
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import anyio
import sqlalchemy as sa

from trace_core.leasing import LeaseQueue
from trace_core.model import OUTBOX, Fence, ItemId
from trace_core.outbox import OutboxHandler, OutboxRelay, RelayConfig, write_outbox
from trace_core.storage.protocol import NewOutboxRow
from trace_core.storage.sql import SqlRepository
from trace_core.storage.sql_errors import translate_errors
from trace_testing.chaos_workers import (
    Progress,
    read_reports,
    survivors_exited_cleanly,
    wait_for,
)
from trace_testing.faults import WorkerFleet
from trace_testing.history import Effect, HistoryReport, check_history, committed_fences
from trace_testing.process_target import ProcessConfig, run_process, wait_until_stopped

__all__ = [
    "KIND",
    "RELAY_STATS",
    "DeliveryLedger",
    "RelayKillReport",
    "RelayProcessConfig",
    "relay_kill_drain",
    "run_relay",
]

KIND = "trace-testing-delivery"
"""The outbox kind the relay process handles."""

RELAY_STATS = ("started", "delivered")
"""A relay process's counters: 1 once running; deliveries recorded."""

_METADATA = sa.MetaData()

DELIVERIES = sa.Table(
    "trace_deliveries",
    _METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("item_id", sa.Text, nullable=False),
    sa.Column("holder", sa.Text, nullable=False),
)
"""One row per delivery: several for a row delivered more than once."""


class DeliveryLedger:
    """The ``trace_deliveries`` table of one database: at-least-once effects."""

    def __init__(self, repo: SqlRepository) -> None:
        """The ledger in ``repo``'s database (call :meth:`create` once)."""
        self.repo = repo

    async def create(self) -> None:
        """Create the ledger table if it does not exist yet."""
        async with self.repo.transaction() as tx:
            await tx.connection.run_sync(_METADATA.create_all, checkfirst=True)

    async def record(self, item_id: str, holder: str) -> None:
        """Record one delivery of ``item_id`` by ``holder``, in a transaction of its own."""
        async with self.repo.transaction() as tx:
            with translate_errors("delivery ledger insert"):
                await tx.connection.execute(
                    sa.insert(DELIVERIES).values(item_id=item_id, holder=holder)
                )

    async def effects(self) -> list[Effect]:
        """Every delivery as an :class:`~trace_testing.history.Effect` (no attempt)."""
        t = DELIVERIES
        async with self.repo.read() as tx:
            rows = (
                await tx.connection.execute(sa.select(t.c.item_id, t.c.holder).order_by(t.c.id))
            ).all()
        return [Effect(str(r[0]), 0, "", str(r[1])) for r in rows]

    async def check(self, item_ids: Iterable[str]) -> HistoryReport:
        """Lost and duplicated deliveries of ``item_ids`` (fences are not checked)."""
        # Keyed by the payload's key, a string: the checker compares keys as text.
        expected = cast(Mapping[ItemId, Fence | None], dict.fromkeys(item_ids))
        return check_history(await self.effects(), expected)


@dataclass(frozen=True)
class RelayProcessConfig(ProcessConfig):
    """What one relay process does; picklable. Its report file gets crashes."""

    seed: int = 0
    batch_size: int = 50
    concurrency: int = 10
    lease_seconds: float = 1.0
    poll_min_seconds: float = 0.05
    poll_max_seconds: float = 0.2
    handler_seconds: float = 0.0
    """Each delivery's own work before it is recorded (a webhook call's time)."""
    handler: str | None = None
    """``"module:function"``: an async ``(payload)`` run before each record."""


def run_relay(config: RelayProcessConfig, stats: Any, stop: Any) -> None:
    """Process entry point (a :class:`~trace_testing.faults.WorkerFleet`
    target): relay until ``stop`` is set; exit 1 on any crash."""
    run_process(_relay, config, stats, stop)


def _load(spec: str) -> OutboxHandler:
    module_name, _, attribute = spec.partition(":")
    handler = getattr(importlib.import_module(module_name), attribute, None)
    if not module_name or not callable(handler):
        raise ValueError(f"handler {spec!r} is not an importable 'module:function'")
    return cast(OutboxHandler, handler)


async def _relay(config: RelayProcessConfig, stats: Any, stop: Any) -> None:
    repo = SqlRepository(config.url)
    ledger = DeliveryLedger(repo)
    own = _load(config.handler) if config.handler else None

    async def deliver(payload: Mapping[str, Any]) -> None:
        if config.handler_seconds:
            await anyio.sleep(config.handler_seconds)  # the delivery's own work
        if own is not None:
            await own(payload)
        await ledger.record(str(payload["key"]), config.name)
        stats[1] += 1

    relay = OutboxRelay(
        repo,
        {KIND: deliver},
        config=RelayConfig(
            batch_size=config.batch_size,
            concurrency=config.concurrency,
            lease_seconds=config.lease_seconds,
            poll_min_seconds=config.poll_min_seconds,
            poll_max_seconds=config.poll_max_seconds,
        ),
        worker_id=config.name,
        rng=random.Random(config.seed),
    )
    try:
        async with anyio.create_task_group() as tg:
            await relay.start(tg)
            stats[0] = 1
            await anyio.to_thread.run_sync(wait_until_stopped, stop)
            await relay.stop()
    finally:
        await repo.close()


@dataclass(frozen=True)
class RelayKillReport:
    """What :func:`relay_kill_drain` saw."""

    rows: int
    not_done: int
    """Rows not ``Done`` at the end (0: every row was marked handled)."""
    killed: tuple[str, ...]
    open_at_kill: tuple[int, ...]
    """Rows still open (pending or in flight) at each kill."""
    seconds: float
    history: HistoryReport
    """Lost and duplicated deliveries, per row."""
    deliveries: int
    exit_codes: dict[str, int | None]
    worker_reports: str

    def survivors_exited_cleanly(self) -> bool:
        """Every relay not SIGKILLed stopped with exit code 0."""
        return survivors_exited_cleanly(self.exit_codes, self.killed)


async def _open_rows(repo: SqlRepository) -> int:
    async with repo.read() as tx:
        return await tx.status.open_outbox_count()


async def relay_kill_drain(
    url: str,
    *,
    rows: int,
    report_path: Path,
    kills: int = 3,
    seed: int = 5,
    bound_seconds: float = 120.0,
    progress: Progress | None = None,
    relay_options: Mapping[str, Any] | None = None,
) -> RelayKillReport:
    """Write ``rows`` outbox rows of kind :data:`KIND` to database ``url`` and
    drain them with one relay process, SIGKILLed ``kills`` times in the
    middle of its batches (at evenly spaced shares of the deliveries) and
    restarted at once. ``relay_options`` are fields of
    :class:`RelayProcessConfig`."""
    if rows < 1 or kills < 0:
        raise ValueError("rows must be >= 1, kills >= 0")
    repo = SqlRepository(url)
    try:
        ledger = DeliveryLedger(repo)
        await ledger.create()
        async with repo.transaction() as tx:
            ids = await write_outbox(
                tx, [NewOutboxRow(KIND, {"key": f"r{i}"}) for i in range(rows)], datetime.now(UTC)
            )
        fleet = WorkerFleet(run_relay, RELAY_STATS, rng=random.Random(seed))
        seen = 0
        open_at_kill: list[int] = []

        def delivered() -> int:
            nonlocal seen
            total = fleet.total("delivered")
            if progress is not None and total > seen:
                progress.done(total - seen)
            seen = max(seen, total)
            return total

        def describe() -> str:
            return f"delivered={delivered()}, killed={fleet.killed}"

        started = time.monotonic()
        deadline = started + bound_seconds
        try:
            current = fleet.start(
                RelayProcessConfig(
                    url=url,
                    name="relay",
                    report_path=str(report_path),
                    seed=seed,
                    **dict(relay_options or {}),
                )
            )
            for k in range(kills):
                mark = rows * (k + 1) // (kills + 2)

                def reached(mark: int = mark) -> bool:
                    return delivered() >= mark

                await wait_for(
                    f"kill {k + 1} at {mark} deliveries",
                    reached,
                    deadline,
                    describe=describe,
                )
                if k == 0 and progress is not None:
                    progress.fault_started()
                fleet.kill(current)
                open_at_kill.append(await _open_rows(repo))
                current = fleet.restart(current, seed=seed + k + 1)
            if progress is not None:
                progress.fault_ended()

            async def drained() -> bool:
                delivered()
                return await _open_rows(repo) == 0

            await wait_for(
                "every row to be handled", drained, deadline, describe=describe, interval=0.1
            )
            seconds = time.monotonic() - started
            if progress is not None:
                progress.finished()
        finally:
            codes = fleet.shutdown()
        delivered()
        done = await committed_fences(LeaseQueue(repo, OUTBOX), ids)
        return RelayKillReport(
            rows=rows,
            not_done=rows - len(done),
            killed=tuple(fleet.killed),
            open_at_kill=tuple(open_at_kill),
            seconds=seconds,
            history=await ledger.check(f"r{i}" for i in range(rows)),
            deliveries=fleet.total("delivered"),
            exit_codes=codes,
            worker_reports=read_reports(report_path),
        )
    finally:
        await repo.close()
