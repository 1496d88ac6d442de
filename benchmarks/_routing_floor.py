"""The routing benchmark's floor: the bare writes its tasks need, on Postgres.

However routing decides, ``events x dependents`` tasks must end up in
``tasks`` (with the schema's five indexes and its foreign key to ``jobs``)
and as many ``task_inputs`` rows (with their two foreign keys). This writes
exactly those rows on a freshly deployed database of the same DAG, and
nothing else: no events stored, no coverage, no outbox rows, no dedupe
decisions, no round trip per request. The rows have the shapes routing
gives them (time-ordered ids, the same dedupe keys, partition arrays and
``input_versions`` documents), generated on the server by ``INSERT ... SELECT``
over ``generate_series`` and split over ``parts`` concurrent statements (the
relay's concurrency), so both cores work as they do when routing.

The time it takes bounds the benchmark: ``events / seconds`` is a ceiling on
``events_per_s`` that no routing code on this machine and server can pass.

:func:`write_required_floor` is the second floor: every row the
specification requires of accepting and routing the same events, written
bare. Per part, one accept transaction inserts the part's events (each once,
``deliveries`` = its copies, ``pending``), its ``route_event`` outbox rows
(500 event ids each) and bumps the version's progress row; one routing
transaction then writes the tasks and ``task_inputs`` as above, each event's
outcome (``routed``, counts, ``route_detail``), the ``enqueue_task`` wake-up
rows (500 task ids each) and marks the ``route_event`` rows ``Done``. No
dedupe probe, no range merge, no producer check, no locks taken explicitly,
no per-request round trips: the rows and their indexes, constraints and
foreign keys only. What routing costs above this floor is logic; what this
floor costs above the first is the required rows besides the tasks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import sqlalchemy as sa

from benchmarks._common import server_cpu_s, utcnow
from trace_core.storage.bulk import id_block, uuid_array
from trace_core.storage.sql import SqlRepository

__all__ = ["write_floor", "write_required_floor"]

# One part: units [lo, hi) of ``block_span`` blocks, times every dependent job.
_FLOOR = sa.text(
    """
WITH j AS (
    SELECT id AS job_id FROM jobs WHERE id = ANY(CAST(:jobs AS uuid[]))
), u AS MATERIALIZED (  -- per unit, as routing builds them per event, not per task
    SELECT p.partition_key,
           'partition:' || :dataset || ':' || :version || ':' || p.partition_key AS dedupe_key,
           jsonb_build_object(
               'inputs', jsonb_build_array(jsonb_build_object(
                   'dataset_uuid', :dataset, 'dataset_version', :version,
                   'partition_key', p.partition_key, 'start', p.first, 'end', p.last)),
               'trigger_event_id', CAST(CAST(:prefix || '00000000' AS uuid) AS text)
           ) AS input_versions
    FROM (SELECT g * :span AS first, g * :span + :span - 1 AS last,
                 (g * :span) || '-' || (g * :span + :span - 1) AS partition_key
          FROM generate_series(:lo, :hi - 1) AS g) AS p
), ins AS (
    INSERT INTO tasks (id, job_id, dedupe_key, status, attempt, claim_version, partitions,
                       input_versions, max_attempts, created_at, queued_at)
    SELECT CAST(:prefix || lpad(to_hex(row_number() OVER ()), 8, '0') AS uuid), j.job_id,
           u.dedupe_key, 'Queued', 1, 0, ARRAY[u.partition_key], u.input_versions,
           3, :now, :now
    FROM u CROSS JOIN j
    ORDER BY 1
    RETURNING id, partitions[1] AS partition_key
)
INSERT INTO task_inputs (task_id, input_dataset_uuid, input_partition_key, input_version)
SELECT id, CAST(:dataset AS uuid), partition_key, :now FROM ins ORDER BY id
"""
)


# Accept, bare: one part's events (ids: :prefix + ordinal), its progress row
# bumped, its route_event rows; answers the outbox ids.
_ACCEPT = sa.text(
    """
WITH u AS (
    SELECT :lo + c.n - 1 AS g, c.copies FROM unnest(CAST(:copies AS integer[]))
        WITH ORDINALITY AS c(copies, n)
), ev AS (
    INSERT INTO events (id, dataset_uuid, dataset_version, unit_key, cursor, partition_key,
                        range_start, range_end, origin, received_at, last_received_at,
                        deliveries, route_status, tasks_created, tasks_existing)
    SELECT CAST(:prefix || lpad(to_hex(u.g - :lo + 1), 8, '0') AS uuid),
           CAST(:dataset AS uuid), CAST(:version AS uuid),
           'partition:' || (u.g * :span) || '-' || (u.g * :span + :span - 1), NULL,
           (u.g * :span) || '-' || (u.g * :span + :span - 1), u.g * :span,
           u.g * :span + :span - 1, 'manual', :now, :now, u.copies, 'pending', 0, 0
    FROM u ORDER BY u.g
    RETURNING id
), progress AS (
    INSERT INTO dataset_version_progress AS p
           (dataset_version, dataset_uuid, ranges, max_cursor, events, updated_at)
    VALUES (CAST(:version AS uuid), CAST(:dataset AS uuid), '[]', NULL, :units, :now)
    ON CONFLICT (dataset_version) DO UPDATE
        SET events = p.events + excluded.events, updated_at = excluded.updated_at
)
INSERT INTO outbox (kind, payload, status, available_at, attempts, claim_version,
                    max_attempts, created_at)
SELECT 'route_event', jsonb_build_object('event_ids', jsonb_agg(CAST(id AS text) ORDER BY id)),
       'Pending', :now, 0, 0, 10, :now
FROM (SELECT id, (row_number() OVER (ORDER BY id) - 1) / 500 AS chunk FROM ev) AS s
GROUP BY chunk ORDER BY chunk
RETURNING id
"""
)

# Route, bare: the part's events (a primary-key range: their ids share
# :prefix) become tasks of every job, with inputs, outcomes and wake-ups.
_ROUTE = sa.text(
    """
WITH e AS MATERIALIZED (
    SELECT id, partition_key, range_start, range_end, received_at FROM events
    WHERE id BETWEEN CAST(:prefix || '00000000' AS uuid) AND CAST(:prefix || 'ffffffff' AS uuid)
), j AS (
    SELECT id AS job_id FROM jobs WHERE id = ANY(CAST(:jobs AS uuid[]))
), u AS MATERIALIZED (
    SELECT e.partition_key, e.received_at,
           'partition:' || :dataset || ':' || :version || ':' || e.partition_key AS dedupe_key,
           jsonb_build_object(
               'inputs', jsonb_build_array(jsonb_build_object(
                   'dataset_uuid', :dataset, 'dataset_version', :version,
                   'partition_key', e.partition_key, 'start', e.range_start, 'end', e.range_end)),
               'trigger_event_id', CAST(e.id AS text)) AS input_versions
    FROM e
), ins AS (
    INSERT INTO tasks (id, job_id, dedupe_key, status, attempt, claim_version, partitions,
                       input_versions, max_attempts, created_at, queued_at)
    SELECT CAST(:task_prefix || lpad(to_hex(row_number() OVER ()), 8, '0') AS uuid), j.job_id,
           u.dedupe_key, 'Queued', 1, 0, ARRAY[u.partition_key], u.input_versions, 3, :now, :now
    FROM u CROSS JOIN j
    ORDER BY 1
    RETURNING id, partitions[1] AS partition_key
), inputs AS (
    INSERT INTO task_inputs (task_id, input_dataset_uuid, input_partition_key, input_version)
    SELECT id, CAST(:dataset AS uuid), partition_key, :now FROM ins ORDER BY id
), outcomes AS (
    UPDATE events SET route_status = 'routed', routed_at = :now, tasks_created = :jobs_n,
                      route_detail = CAST(:detail AS jsonb)
    FROM e WHERE events.id = e.id
), done AS (
    UPDATE outbox SET status = 'Done', processed_at = :now
    WHERE id = ANY(CAST(:outbox_ids AS bigint[]))
)
INSERT INTO outbox (kind, payload, status, available_at, attempts, claim_version,
                    max_attempts, created_at)
SELECT 'enqueue_task', jsonb_build_object('task_ids', jsonb_agg(CAST(id AS text) ORDER BY id)),
       'Pending', :now, 0, 0, 10, :now
FROM (SELECT id, (row_number() OVER (ORDER BY id) - 1) / 500 AS chunk FROM ins) AS s
GROUP BY chunk
"""
)


async def _timed_parts(
    repo: SqlRepository,
    bounds: Sequence[tuple[int, int]],
    part: Callable[[int, int], Coroutine[Any, Any, None]],
    postmaster: int | None,
) -> tuple[float, float | None]:
    """Run ``part`` over ``bounds`` concurrently: wall seconds and server CPU seconds."""
    server0 = server_cpu_s(postmaster) if postmaster is not None else None
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for lo, hi in bounds:
            tg.start_soon(part, lo, hi)
    seconds = time.perf_counter() - started
    server = None
    if postmaster is not None and server0 is not None:
        server = round(server_cpu_s(postmaster) - server0, 2)
    return seconds, server


async def _count(repo: SqlRepository, table: str) -> int:
    async with repo.read() as tx:
        # table: one of this module's fixed names, never input
        found = await tx.connection.execute(sa.text(f"SELECT count(*) FROM {table}"))
        return int(found.scalar_one())


async def write_required_floor(
    repo: SqlRepository,
    *,
    jobs: dict[str, uuid.UUID],
    dataset: uuid.UUID,
    version: uuid.UUID,
    copies: Sequence[int],
    span: int,
    parts: int,
    postmaster: int | None,
) -> dict[str, Any]:
    """Write every row accepting and routing ``len(copies)`` units needs (unit
    ``i`` delivered ``copies[i]`` times) for ``jobs`` (name -> id), bare, in
    ``parts`` concurrent accept-then-route pairs of transactions."""
    units = len(copies)
    bounds = [(units * k // parts, units * (k + 1) // parts) for k in range(parts)]
    detail = json.dumps(dict.fromkeys(sorted(jobs), "created"))
    job_ids = uuid_array(jobs.values())

    async def part(lo: int, hi: int) -> None:
        prefix, now = id_block(), utcnow()
        async with repo.transaction() as tx:
            outbox_ids = [
                int(row[0])
                for row in await tx.connection.execute(
                    _ACCEPT,
                    {
                        "copies": "{" + ",".join(str(c) for c in copies[lo:hi]) + "}",
                        "lo": lo,
                        "units": hi - lo,
                        "span": span,
                        "prefix": prefix,
                        "dataset": str(dataset),
                        "version": str(version),
                        "now": now,
                    },
                )
            ]
        async with repo.transaction() as tx:
            await tx.connection.execute(
                _ROUTE,
                {
                    "prefix": prefix,
                    "task_prefix": id_block(),
                    "jobs": job_ids,
                    "jobs_n": len(jobs),
                    "detail": detail,
                    "outbox_ids": "{" + ",".join(map(str, outbox_ids)) + "}",
                    "dataset": str(dataset),
                    "version": str(version),
                    "now": now,
                },
            )

    seconds, server = await _timed_parts(repo, bounds, part, postmaster)
    return {
        "seconds": seconds,
        "server_cpu_s": server,
        "rows": await _count(repo, "task_inputs"),
        "events": await _count(repo, "events"),
    }


async def write_floor(
    repo: SqlRepository,
    *,
    jobs: list[uuid.UUID],
    dataset: uuid.UUID,
    version: uuid.UUID,
    units: int,
    span: int,
    parts: int,
    postmaster: int | None,
) -> dict[str, Any]:
    """Write ``units x len(jobs)`` tasks and inputs in ``parts`` concurrent statements."""
    bounds = [(units * k // parts, units * (k + 1) // parts) for k in range(parts)]

    async def part(lo: int, hi: int) -> None:
        async with repo.transaction() as tx:
            await tx.connection.execute(
                _FLOOR,
                {
                    "jobs": uuid_array(jobs),
                    "span": span,
                    "lo": lo,
                    "hi": hi,
                    "prefix": id_block(),
                    "dataset": str(dataset),
                    "version": str(version),
                    "now": utcnow(),
                },
            )

    seconds, server = await _timed_parts(repo, bounds, part, postmaster)
    return {"seconds": seconds, "rows": await _count(repo, "task_inputs"), "server_cpu_s": server}
