"""Rows the protocol tests need: standalone jobs and one ready item per queue."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from trace_core.model import QueueSpec
from trace_core.standalone import ensure_standalone_job
from trace_core.storage import schema
from trace_core.storage.protocol import NewOutboxRow, NewTask
from trace_core.storage.sql import SqlRepository


async def make_job(
    repo: SqlRepository, now: datetime, *, max_attempts: int = 3, name: str = "noop"
) -> uuid.UUID:
    """A standalone job (org + DAG version + job); return its id."""
    return await ensure_standalone_job(repo, name, now=now, max_attempts=max_attempts)


async def make_items(
    repo: SqlRepository, queue: QueueSpec, now: datetime, count: int = 1, *, max_attempts: int = 3
) -> list[Any]:
    """Insert ``count`` ready items into ``queue``; return their ids in creation order."""
    if queue.name == "tasks":
        job = await make_job(repo, now)
        async with repo.transaction() as tx:
            created = await tx.create_tasks(
                [NewTask(job, max_attempts=max_attempts) for _ in range(count)], now=now
            )
        return [c.task_id for c in created]
    if queue.name == "outbox":
        async with repo.transaction() as tx:
            return list(
                await tx.insert_outbox(
                    [
                        NewOutboxRow("test", {"n": i}, max_attempts=max_attempts)
                        for i in range(count)
                    ],
                    now=now,
                )
            )
    ids = [uuid.uuid4() for _ in range(count)]
    async with repo.transaction() as tx:
        if queue.name == "inbox_jobs":
            await tx.connection.execute(
                sa.insert(schema.inbox_jobs),
                [
                    {
                        "id": i,
                        "requester_id": "req-1",
                        "request": {},
                        "available_at": now,
                        "max_attempts": max_attempts,
                        "created_at": now,
                        "updated_at": now,
                    }
                    for i in ids
                ],
            )
        else:
            job = uuid.uuid4()
            await tx.connection.execute(
                sa.insert(schema.inbox_jobs).values(
                    id=job,
                    requester_id="req-1",
                    request={},
                    available_at=now,
                    created_at=now,
                    updated_at=now,
                )
            )
            await tx.connection.execute(
                sa.insert(schema.job_outbox_events),
                [
                    {
                        "id": i,
                        "job_id": job,
                        "event_type": "status",
                        "payload": {},
                        "available_at": now,
                        "max_attempts": max_attempts,
                        "created_at": now,
                    }
                    for i in ids
                ],
            )
    return ids
