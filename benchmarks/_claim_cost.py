"""Claim-cost mode: does a claim get slower as the queue gets deeper?

For each depth D a fresh database is filled with D queued tasks by one
``INSERT … SELECT`` (a fixture, not the measured path), then ``rounds`` rounds
of ``claim_batch(B)`` + ``complete_many`` are timed through the public API.
After every round B new tasks are enqueued through ``TaskQueue.create``
(untimed), so the depth stays at D for the whole measurement.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
import sqlalchemy as sa

from benchmarks._common import (
    Databases,
    count_tasks,
    load_average,
    log,
    median,
    percentile,
    utcnow,
)
from trace_core.standalone import ensure_standalone_job
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.storage.url import create_sync_engine, parse_database_url
from trace_core.tasks import TaskQueue

__all__ = ["fill_queued", "run_claim_cost"]

_WARMUP_ROUNDS = 10
_FIXTURE_EPOCH = datetime(2020, 1, 1, tzinfo=UTC)


def fill_queued(url: str, job_id: uuid.UUID, count: int, status: str = "Queued") -> float:
    """Insert ``count`` tasks in ``status`` with one statement; the seconds it took.

    Their ``created_at`` and ``queued_at`` lie in 2020, before any task the benchmark creates.
    On Postgres the table is then ``VACUUM ANALYZE``d, the state autovacuum
    reaches shortly after a bulk insert.
    """
    db = parse_database_url(url)
    engine = create_sync_engine(db)
    started = time.monotonic()
    try:
        if db.engine == "postgres":
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "INSERT INTO tasks (id, job_id, status, attempt, claim_version,"
                        " max_attempts, created_at, queued_at, completed_at)"
                        " SELECT gen_random_uuid(), :job, :status, 1, 0, 3,"
                        "  :t0 + g * interval '1 microsecond', :t0 + g * interval '1 microsecond',"
                        "  CAST(:done_at AS timestamptz)"
                        " FROM generate_series(1, :n) AS g"
                    ),
                    {
                        "job": job_id,
                        "status": status,
                        "t0": _FIXTURE_EPOCH,
                        "done_at": _FIXTURE_EPOCH if status == "Completed" else None,
                        "n": count,
                    },
                )
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(sa.text("VACUUM ANALYZE tasks"))
        else:
            epoch = int(_FIXTURE_EPOCH.timestamp())
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "WITH RECURSIVE s(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM s LIMIT :n)"
                        " INSERT INTO tasks (id, job_id, status, attempt, claim_version,"
                        "  max_attempts, created_at, queued_at, completed_at)"
                        " SELECT lower(hex(randomblob(16))), :job, :status, 1, 0, 3, t, t,"
                        "  CASE WHEN :status = 'Completed' THEN '2020-01-01 00:00:00.000000' END"
                        " FROM (SELECT strftime('%Y-%m-%d %H:%M:%S', :epoch + x / 1000000,"
                        "  'unixepoch') || printf('.%06d', x % 1000000) AS t FROM s)"
                    ),
                    {"job": job_id.hex, "status": status, "epoch": epoch, "n": count},
                )
    finally:
        engine.dispose()
    return time.monotonic() - started


async def _job(url: str) -> uuid.UUID:
    repo = SqlRepository(url)
    try:
        return await ensure_standalone_job(repo, "bench", now=utcnow())
    finally:
        await repo.close()


async def _measure(url: str, job_id: uuid.UUID, batch: int, rounds: int) -> dict[str, list[float]]:
    repo = SqlRepository(url)
    queue = TaskQueue(repo)
    claim_ms: list[float] = []
    complete_ms: list[float] = []
    round_ms: list[float] = []
    short = 0
    try:
        for i in range(_WARMUP_ROUNDS + rounds):
            t0 = time.perf_counter()
            leases = await queue.claim_batch("bench-claim-cost", batch)
            t1 = time.perf_counter()
            done = await queue.complete_many([lease.fence for lease in leases])
            t2 = time.perf_counter()
            if len(leases) < batch or len(done) != len(leases):
                short += 1
            await queue.create([NewTask(job_id) for _ in range(batch)])
            if i >= _WARMUP_ROUNDS:
                claim_ms.append((t1 - t0) * 1000)
                complete_ms.append((t2 - t1) * 1000)
                round_ms.append((t2 - t0) * 1000)
    finally:
        await repo.close()
    return {"claim": claim_ms, "complete": complete_ms, "round": round_ms, "short": [short]}


def run_claim_cost(
    dbs: Databases,
    depths: Sequence[int],
    batch: int,
    rounds: int,
    emit: Callable[[dict[str, Any]], None],
    *,
    history: int = 0,
) -> list[dict[str, Any]]:
    """Measure each depth on a fresh database; emits one object per depth and a summary."""
    rows: list[dict[str, Any]] = []
    for depth in depths:
        url = dbs.fresh(f"cost{depth}")
        job_id = anyio.run(_job, url, backend="asyncio")
        fill_s = 0.0
        if history:
            fill_s += fill_queued(url, job_id, history, status="Completed")
        log.info("claim-cost: filling %d queued tasks", depth)
        fill_s += fill_queued(url, job_id, depth)
        log.info("claim-cost: depth %d filled in %.1fs; measuring %d rounds", depth, fill_s, rounds)
        load = load_average()
        m = anyio.run(_measure, url, job_id, batch, rounds, backend="asyncio")
        counts = count_tasks(url)
        row = {
            "engine": dbs.engine,
            "mode": "claim-cost",
            "depth": depth,
            "history_completed_rows": history,
            "batch": batch,
            "rounds": rounds,
            "claim_median_ms": round(median(m["round"]), 3),
            "claim_p99_ms": round(percentile(m["round"], 99), 3),
            "claim_only_median_ms": round(median(m["claim"]), 3),
            "claim_only_p99_ms": round(percentile(m["claim"], 99), 3),
            "complete_median_ms": round(median(m["complete"]), 3),
            "complete_p99_ms": round(percentile(m["complete"], 99), 3),
            "short_rounds": m["short"][0],
            "queued_after": counts.get("Queued", 0),
            "fill_seconds": round(fill_s, 2),
            "load_average_before": load,
        }
        emit(row)
        rows.append(row)
        dbs.drop(url)
    base = next((r for r in rows if r["depth"] == min(depths)), None)
    if base is not None and len(rows) > 1:
        emit(
            {
                "engine": dbs.engine,
                "mode": "claim-cost",
                "summary": True,
                "batch": batch,
                "base_depth": base["depth"],
                "depths": [r["depth"] for r in rows],
                "claim_median_ms": [r["claim_median_ms"] for r in rows],
                "claim_p99_ms": [r["claim_p99_ms"] for r in rows],
                "ratio_median_vs_base": [
                    round(r["claim_median_ms"] / base["claim_median_ms"], 2) for r in rows
                ],
                "ratio_p99_vs_base": [
                    round(r["claim_p99_ms"] / base["claim_p99_ms"], 2) for r in rows
                ],
            }
        )
    return rows
