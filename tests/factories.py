"""Rows the tests need: standalone jobs, ready items per queue, and DAG topologies.

``JobDef``/``build_dag`` insert a DAG topology directly (org, a ``current``
DAG version, datasets, jobs with their dataset edges); ``queue_tasks`` gives
a job queued tasks. The backpressure, concurrency and metrics tests use them.
``run_on_separate_repos`` runs concurrent actors, each with its own connections.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.errors import DatabaseUnavailable
from trace_core.model import QueueSpec
from trace_core.standalone import ensure_standalone_job
from trace_core.storage import schema
from trace_core.storage.protocol import NewOutboxRow, NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_testing.chaos_workers import wait_for


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


# --- DAG topologies -------------------------------------------------------------


def stable_id(*parts: str) -> uuid.UUID:
    """A UUID derived from ``parts``: the same names give the same ids in every run."""
    return uuid.uuid5(uuid.NAMESPACE_URL, "trace-test:" + "/".join(parts))


@dataclass(frozen=True)
class JobDef:
    """A job to insert: dataset names it reads and writes, and its settings."""

    name: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    tier: str = "normal"
    backpressure: dict[str, Any] | None = None
    scaling: dict[str, Any] | None = None
    operator: str = "noop"
    heartbeat_timeout_seconds: int | None = None


async def build_dag(
    repo: SqlRepository,
    now: datetime,
    jobs: Sequence[JobDef],
    *,
    dag: str = "dex",
    org: str = "acme",
    status: str = "current",
) -> dict[str, uuid.UUID]:
    """Insert ``jobs`` as one version of DAG ``dag``; return job ids by name.

    Datasets are named per org; one read but produced by no job here is
    registered with an ``external`` producer. Rows are inserted directly (not
    through :func:`trace_core.dag.deploy`) so tests can use any name and shape.
    """
    org_id = stable_id("org", org)
    version_id = stable_id("dag", org, dag, status)
    produced = {d: (j.name, i) for j in jobs for i, d in enumerate(j.outputs)}
    read = {d for j in jobs for d in j.inputs}
    ds_id = {d: stable_id("dataset", org, d) for d in {*produced, *read}}
    ids = {j.name: stable_id("job", org, dag, status, j.name) for j in jobs}
    async with repo.transaction() as tx:
        conn = tx.connection
        await conn.execute(
            tx.insert(schema.orgs)
            .values(id=org_id, name=org, slug=org, settings={}, created_at=now)
            .on_conflict_do_nothing()
        )
        await conn.execute(
            sa.insert(schema.dag_versions).values(
                id=version_id,
                org_id=org_id,
                dag_name=dag,
                yaml_hash=f"test-{status}",
                status=status,
                created_at=now,
            )
        )
        for name, dataset_id in ds_id.items():
            job_name, index = produced.get(name, (f"external-{name}", 0))
            await conn.execute(
                tx.insert(schema.datasets)
                .values(
                    id=dataset_id,
                    org_id=org_id,
                    name=name,
                    producer_dag_name=dag,
                    producer_job_name=job_name,
                    producer_output_index=index,
                    created_at=now,
                    updated_at=now,
                )
                .on_conflict_do_nothing()
            )
        # Each version writes its own dataset versions (a building version's
        # jobs are live only while they build a generation of their own).
        for name in produced:
            dsv = stable_id("dataset-version", org, dag, status, name)
            await conn.execute(
                sa.insert(schema.dataset_versions).values(
                    id=dsv,
                    dataset_uuid=ds_id[name],
                    created_at=now,
                    storage_location=f"mem://{name}/{status}/",
                    config_hash=f"{dag}-{status}-{name}",
                )
            )
            await conn.execute(
                sa.insert(schema.dag_version_datasets).values(
                    dag_version_id=version_id, dataset_uuid=ds_id[name], dataset_version=dsv
                )
            )
        for j in jobs:
            await conn.execute(
                sa.insert(schema.jobs).values(
                    id=ids[j.name],
                    org_id=org_id,
                    name=j.name,
                    dag_name=dag,
                    dag_version_id=version_id,
                    activation="reactive" if j.inputs else "source",
                    runtime="dispatcher",
                    operator=j.operator,
                    execution_strategy="PerUpdate" if j.inputs else None,
                    config={},
                    config_hash=f"hash-{j.name}",
                    input_datasets=[str(ds_id[d]) for d in j.inputs],
                    output_datasets=[str(ds_id[d]) for d in j.outputs],
                    update_strategy="replace",
                    scaling=j.scaling,
                    backpressure=j.backpressure,
                    priority_tier=j.tier,
                    heartbeat_timeout_seconds=j.heartbeat_timeout_seconds,
                    created_at=now,
                    updated_at=now,
                )
            )
    return ids


async def queue_tasks(tq: TaskQueue, job_id: uuid.UUID, count: int) -> list[uuid.UUID]:
    """Create ``count`` queued tasks of ``job_id``; their ids."""
    created = await tq.create([NewTask(job_id) for _ in range(count)])
    return [c.task_id for c in created]


# --- concurrent actors -----------------------------------------------------------


async def run_on_separate_repos(
    database_url: str, count: int, work: Callable[[SqlRepository, int], Coroutine[Any, Any, object]]
) -> None:
    """Run ``work(repo, n)`` for ``n`` in ``range(count)`` all at once, each on a
    :class:`SqlRepository` of its own (its own connections, as separate processes
    would have); close the repositories afterwards."""
    repos = [SqlRepository(database_url) for _ in range(count)]
    try:
        async with anyio.create_task_group() as tg:
            for n, r in enumerate(repos):
                tg.start_soon(work, r, n)
    finally:
        for r in repos:
            await r.close()


def relay_partition(ctx: Any) -> Any:
    """A synchronous test operator: marks the partition it was given materialized
    on its own first output, and reports the input version it read."""
    from trace_core.authoring.context import OperatorResult
    from trace_core.authoring.events import DatasetEvent

    unit = ctx.inputs[0]
    out = ctx.outputs[0]
    event = DatasetEvent(
        uuid.UUID(out["dataset_uuid"]),
        uuid.UUID(out["dataset_version"]),
        partition_key=unit["partition_key"],
        start=unit["start"],
        end=unit["end"],
    )
    return OperatorResult(events=[event], outputs=[{"read": unit["dataset_version"]}])


async def set_progress(
    repo: SqlRepository,
    version: uuid.UUID,
    dataset: uuid.UUID,
    ranges: list[list[int]],
    cursor: int | None,
    clock: ManualClock,
) -> None:
    """Replace the recorded coverage of a dataset version (ranges, max cursor)."""
    g = schema.dataset_version_progress
    async with repo.transaction() as tx:
        await tx.connection.execute(sa.delete(g).where(g.c.dataset_version == version))
        await tx.connection.execute(
            sa.insert(g).values(
                dataset_version=version,
                dataset_uuid=dataset,
                ranges=ranges,
                max_cursor=cursor,
                events=1,
                updated_at=clock.now(),
            )
        )


async def wait_until(
    what: str, condition: Callable[[], Any], deadline: float, *, describe: Callable[[], Any]
) -> None:
    """Poll ``condition`` (sync or async) until true; fail with ``describe()`` at ``deadline``."""
    # The kit's poll, with a test failure instead of its TimeoutError.
    try:
        await wait_for(what, condition, deadline, describe=describe)
    except TimeoutError as exc:
        pytest.fail(str(exc))


def claims_locked_first(monkeypatch: pytest.MonkeyPatch, control: Any, times: int) -> list[Any]:
    """Make ``control.claim`` raise :class:`DatabaseUnavailable` ("locked")
    ``times`` times before it claims; the failures not raised yet (a list
    that empties as they are)."""
    real = control.claim
    failures: list[Any] = [DatabaseUnavailable("locked") for _ in range(times)]

    async def claim(task_id: uuid.UUID, worker_id: str) -> Any:
        if failures:
            raise failures.pop()
        return await real(task_id, worker_id)

    monkeypatch.setattr(control, "claim", claim)
    return failures


# --- Euterpe inbox jobs -----------------------------------------------------------


async def insert_inbox_job(
    tx: Any,
    *,
    job_id: uuid.UUID,
    requester_id: str,
    now: datetime,
    request: dict[str, Any] | None = None,
    status_webhook_url: str | None = None,
    refresh_url: str | None = None,
    sealed: Any = None,
    max_attempts: int = 5,
) -> None:
    """Insert one ``queued`` inbox job row directly, with its sealed credentials
    (a ``SealedCredentials`` or None), in the SQL transaction ``tx``. Tests
    only: the inbox area's own enqueue is the production path."""
    await tx.connection.execute(
        sa.insert(schema.inbox_jobs).values(
            id=job_id,
            requester_id=requester_id,
            request=request or {},
            status_webhook_url=status_webhook_url,
            refresh_url=refresh_url,
            max_attempts=max_attempts,
            storage_creds_encrypted=sealed.encrypted if sealed else None,
            storage_creds_dek_wrapped=sealed.dek_wrapped if sealed else None,
            storage_creds_kek_id=sealed.kek_id if sealed else None,
            storage_creds_encryption_version=sealed.encryption_version if sealed else None,
            available_at=now,
            created_at=now,
            updated_at=now,
        )
    )


# --- Euterpe webhook events ------------------------------------------------------


async def make_webhook_events(
    repo: SqlRepository,
    now: datetime,
    *,
    jobs: int = 1,
    events_per_job: int = 3,
    requester_id: str = "req-1",
    url: str | None = "http://127.0.0.1:9/hook",
    max_attempts: int = 5,
) -> dict[uuid.UUID, list[uuid.UUID]]:
    """Insert ``jobs`` inbox jobs (with ``url`` as their webhook) and
    ``events_per_job`` pending webhook events each, with sequences 1, 2, …
    and bodies from :func:`trace_core.euterpe.events.event_body`; return each
    job's event ids in sequence order. Rows are inserted directly: the job
    lifecycle that writes them in production is another module's."""
    from trace_core.euterpe.events import event_body

    stages = ("queued", "claimed", "fetching", "processing", "uploading", "succeeded")
    made: dict[uuid.UUID, list[uuid.UUID]] = {}
    async with repo.transaction() as tx:
        for _ in range(jobs):
            job = uuid.uuid4()
            await tx.connection.execute(
                sa.insert(schema.inbox_jobs).values(
                    id=job,
                    requester_id=requester_id,
                    request={},
                    status_webhook_url=url,
                    available_at=now,
                    created_at=now,
                    updated_at=now,
                )
            )
            ids = [uuid.uuid4() for _ in range(events_per_job)]
            rows = []
            for seq, event_id in enumerate(ids, start=1):
                status = stages[min(seq - 1, len(stages) - 1)]
                body = event_body(
                    event_id=event_id,
                    job_id=job,
                    sequence=seq,
                    status=status,
                    occurred_at=now,
                    attempt_count=1,
                    metadata={"note": "é"},
                )
                rows.append(
                    {
                        "id": event_id,
                        "job_id": job,
                        "event_type": body["event_type"],
                        "sequence": seq,
                        "payload": body,
                        "available_at": now,
                        "max_attempts": max_attempts,
                        "created_at": now,
                    }
                )
            await tx.connection.execute(sa.insert(schema.job_outbox_events), rows)
            made[job] = ids
    return made
