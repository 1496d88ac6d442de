"""``job_states``: the one per-job row every Dispatcher service writes.

Helpers shared by the services that keep per-job state there (sources, cron,
the manual trigger, the idle scaler, the concurrency gate, backpressure):
creating the row on first use, locking rows, the upsert with an optional
compare-and-set, and :class:`RaceLost` for a compare-and-set that lost. The
statements are the ``tx.job_states`` area of the port
(:mod:`trace_core.storage.ports.job_states`).

**Lock order (Postgres).** A transaction that locks several ``job_states``
rows takes them in job id order (:func:`by_job_id`), and ``job_states`` rows
before task rows, as the concurrency gate and the backpressure monitor do; so
none of them deadlock. SQLite has a single writer and needs no row locks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime

from trace_core.storage.ports.job_states import by_job_id
from trace_core.storage.protocol import Transaction

__all__ = [
    "RaceLost",
    "by_job_id",
    "ensure_job_states",
    "lock_job_states",
    "read_pause",
    "upsert_job_state",
]


class RaceLost(Exception):
    """Raised inside a transaction whose compare-and-set on ``job_states`` lost
    to another Dispatcher: the caller rolls back and does nothing."""


async def ensure_job_states(
    tx: Transaction, job_ids: Iterable[uuid.UUID], *, now: datetime
) -> None:
    """Create the missing ``job_states`` rows (defaults) for ``job_ids``."""
    await tx.job_states.ensure(by_job_id(job_ids), now=now)


async def lock_job_states(tx: Transaction, job_ids: Iterable[uuid.UUID]) -> None:
    """Lock the existing ``job_states`` rows of ``job_ids`` until commit, in
    lock order (Postgres; SQLite's single writer needs no row locks)."""
    await tx.job_states.lock(by_job_id(job_ids))


async def upsert_job_state(
    tx: Transaction,
    job_id: uuid.UUID,
    values: Mapping[str, object],
    *,
    now: datetime,
    expected: Mapping[str, object] | None = None,
) -> bool:
    """Set ``values`` on the job's ``job_states`` row, creating it first.

    ``expected`` makes the update a compare-and-set: every named field must
    hold its value (``None``: unset), else nothing is set and the answer is
    False. The update also locks the row until commit, which serializes
    services deciding about the same job (on Postgres; SQLite has one writer).
    """
    return await tx.job_states.update_if_matches(job_id, values, now=now, expected=expected)


async def read_pause(tx: Transaction, job_id: uuid.UUID) -> tuple[bool, str | None]:
    """Whether the job is paused (backpressure or by hand) and why; not paused
    when it has no ``job_states`` row yet."""
    return await tx.job_states.pause_state(job_id)
