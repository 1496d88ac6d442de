"""The batch enqueue's floor: the same task rows, one bare insert per batch, on Postgres.

Whatever ``TaskQueue.create`` does, N tasks must end up in ``tasks`` with the
schema's indexes (the primary key, ``idx_tasks_status``, ``idx_tasks_claim``,
``idx_tasks_job_dedupe`` for rows with a key) and the foreign-key check on
``jobs``. This writes exactly those rows, in the same batches, each batch one
multi-row ``INSERT … SELECT`` over ``unnest`` of the batch's dedupe keys
(NULLs without keys) on psycopg in autocommit (one durable commit per batch,
as ``create`` commits per call): no wake-up outbox rows, no notify, no
``ON CONFLICT``, no task objects on the client. The ids are time-ordered
blocks made on the server, as ``create`` makes them.

``tasks / seconds`` is a ceiling on ``benchmarks.enqueue``'s ``tasks_per_s``
that no enqueue code on this machine and server can pass.

With ``foreign_key=False`` the same rows go into a copy of ``tasks`` with
every index, default and check but without the foreign key on ``jobs``
(``CREATE TABLE … (LIKE tasks INCLUDING ALL)``): what the specification's
``job_id … REFERENCES jobs(id)``, checked by Postgres row by row, costs a
batch insert (a queue table such as PgQueuer's has no foreign key).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import psycopg

from benchmarks._common import load_average, server_cpu_s, utcnow
from trace_core.storage.bulk import id_block
from trace_core.storage.url import parse_database_url

__all__ = ["write_floor"]

_NO_FK_TABLE = "CREATE TABLE tasks_no_fk (LIKE tasks INCLUDING ALL)"

_INSERT = """
INSERT INTO {table} (id, job_id, dedupe_key, status, attempt, claim_version, max_attempts,
                   created_at, queued_at)
SELECT CAST(%(prefix)s || lpad(to_hex(k.n), 8, '0') AS uuid), %(job_id)s, k.key, 'Queued', 1, 0,
       3, %(now)s, %(now)s
FROM unnest(CAST(%(keys)s AS text[])) WITH ORDINALITY AS k(key, n)"""


def write_floor(
    url: str,
    job_id: uuid.UUID,
    *,
    tasks: int,
    batch: int,
    dedupe_keys: bool,
    postmaster: int | None,
    foreign_key: bool = True,
) -> dict[str, Any]:
    """Insert ``tasks`` rows of ``job_id`` in batches of ``batch``; the row of
    figures. Without ``foreign_key``, into a copy of ``tasks`` without it."""
    table = "tasks" if foreign_key else "tasks_no_fk"
    insert = _INSERT.format(table=table)
    with psycopg.connect(parse_database_url(url).conninfo(), autocommit=True) as conn:
        if not foreign_key:
            conn.execute(_NO_FK_TABLE)
        load = load_average()
        pg0 = server_cpu_s(postmaster) if postmaster else 0.0
        cpu0 = os.times()
        started = time.monotonic()
        for start in range(0, tasks, batch):
            stop = min(start + batch, tasks)
            keys = [f"t{i}" for i in range(start, stop)] if dedupe_keys else [None] * (stop - start)
            params = {"prefix": id_block(), "job_id": job_id, "keys": keys, "now": utcnow()}
            conn.execute(insert, params, prepare=True)
        seconds = time.monotonic() - started
        cpu1 = os.times()
        pg1 = server_cpu_s(postmaster) if postmaster else 0.0
        stored = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    client_cpu = cpu1.user - cpu0.user + cpu1.system - cpu0.system
    return {
        "seconds": round(seconds, 3),
        "tasks_per_s": round(tasks / seconds, 1),
        "verified": stored is not None and stored[0] == tasks,
        "client_cpu_us_per_task": round(1e6 * client_cpu / tasks, 1),
        "postgres_cpu_us_per_task": round(1e6 * (pg1 - pg0) / tasks, 1) if postmaster else None,
        "load_average_before": load,
    }
