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
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import sqlalchemy as sa

from benchmarks._common import server_cpu_s, utcnow
from trace_core.storage.bulk import id_block, uuid_array
from trace_core.storage.sql import SqlRepository

__all__ = ["write_floor"]

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

    server0 = server_cpu_s(postmaster) if postmaster is not None else None
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for lo, hi in bounds:
            tg.start_soon(part, lo, hi)
    seconds = time.perf_counter() - started
    server = None
    if postmaster is not None and server0 is not None:
        server = round(server_cpu_s(postmaster) - server0, 2)
    async with repo.read() as tx:
        written = (
            await tx.connection.execute(sa.text("SELECT count(*) FROM task_inputs"))
        ).scalar_one()
    return {"seconds": seconds, "rows": int(written), "server_cpu_s": server}
