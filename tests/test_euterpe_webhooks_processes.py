"""Delivery idempotence across processes (euterpe-contract.md §13), on both engines.

Several deliverer OS processes (``tests/euterpe_webhook_proc.py``) claim
``job_outbox_events`` from one SQLite file or one Postgres database and post
over real HTTP to a receiver served by uvicorn in a thread of this process.
The receiver is what a requester runs: the receiver helper verifies each
delivery and records it in the same transaction as the requester's own
"processing" (a ledger row whose primary key is the event id). Deliverers
are SIGKILLed while they hold leases and replaced; the receiver also loses
the answer of some deliveries it processed (it answers 503 after
committing), so duplicates do reach the wire. At the end every event is
delivered, each event id was processed exactly once, and each job's events
were processed in stage order.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from tests import euterpe_webhook_proc as proc
from tests.factories import make_webhook_events, wait_until
from trace_core.errors import DuplicateItem
from trace_core.euterpe.receiver import WebhookReceiver, read_request_body
from trace_core.security.webhook_signing import WebhookRejected, WebhookSigner
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

JOBS = 8
EVENTS_PER_JOB = 4
DELIVERERS = 3
KILLED = 2
DEADLINE_SECONDS = 60.0
"""Bound on the whole run; it needs a few seconds."""
REQUESTER = "acme"

LEDGER_DDL = (
    "CREATE TABLE webhook_ledger ("
    " event_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, sequence INTEGER NOT NULL)"
)


class Receiver:
    """A requester's webhook endpoint: uvicorn in a thread with its own loop and repository."""

    def __init__(self, url: str) -> None:
        import uvicorn

        self.url = url
        self.lock = threading.Lock()
        self.wire: Counter[str] = Counter()
        """Deliveries that reached the endpoint, by event id (duplicates included)."""
        self.processed: list[tuple[str, int]] = []
        """(job id, sequence) of each event processed, in commit order."""
        self.errors: list[str] = []
        self.lose_answer: set[str] = set()
        """Event ids whose first processing is answered 503 (the answer is "lost")."""
        secrets = WebhookSigner([proc.MASTER]).requester_secrets(REQUESTER)
        self._secrets = secrets
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=0,
                log_level="warning",
                lifespan="off",
                interface="asgi3",
            )
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self.repo: SqlRepository | None = None
        self.receiver: WebhookReceiver | None = None

    async def _serve(self) -> None:
        self.repo = SqlRepository(self.url)
        self.receiver = WebhookReceiver(self.repo, self._secrets)
        try:
            await self.server.serve()
        finally:
            await self.repo.close()

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the receiver did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/hook"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = await read_request_body(receive)
        if body is None:
            return  # the client left mid-request: nothing to verify or answer
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        status = await self.handle(headers, body)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def handle(self, headers: dict[str, str], body: bytes) -> int:
        assert self.repo is not None and self.receiver is not None
        event_id = headers.get("x-euterpe-event-id", "?")
        with self.lock:
            self.wire[event_id] += 1
        await asyncio.sleep(0.03)  # a little work, so deliverers get killed mid-post
        try:
            async with self.repo.transaction() as tx:
                accepted = await self.receiver.verify_and_record(headers, body, tx=tx)
                if accepted.duplicate:
                    return 200
                event = accepted.event
                await tx.connection.execute(
                    sa.text(
                        "INSERT INTO webhook_ledger (event_id, job_id, sequence)"
                        " VALUES (:e, :j, :s)"
                    ),
                    {"e": event["event_id"], "j": event["job_id"], "s": event["sequence"]},
                )
        except WebhookRejected as exc:
            with self.lock:
                self.errors.append(f"rejected {event_id}: {exc}")
            return exc.http_status
        except DuplicateItem as exc:
            with self.lock:
                self.errors.append(f"PROCESSED TWICE {event_id}: {exc}")
            return 500
        with self.lock:
            self.processed.append((str(event["job_id"]), int(event["sequence"])))
            if event_id in self.lose_answer:
                return 503  # processed and committed, but the deliverer hears a failure
        return 200


class Fleet:
    """The deliverer processes of one test."""

    def __init__(self, url: str, report_path: Path) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.url = url
        self.report_path = report_path
        self.stop = self.ctx.Event()
        self.procs: dict[str, Any] = {}
        self.killed: set[str] = set()

    def start(self, name: str, seed: int) -> None:
        config = proc.DelivererProc(self.url, name, str(self.report_path), seed)
        p = self.ctx.Process(target=proc.run_deliverer, args=(config, self.stop), name=name)
        p.start()
        self.procs[name] = p

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.kill()  # SIGKILL: no cleanup, leases left behind
        p.join(10)
        self.killed.add(name)

    def shutdown(self) -> dict[str, int | None]:
        self.stop.set()
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
            codes[name] = p.exitcode
            p.close()
        return codes


async def event_statuses(repo: SqlRepository) -> Counter[str]:
    e = schema.job_outbox_events
    async with repo.read() as tx:
        rows = (await tx.connection.execute(sa.select(e.c.status))).all()
    return Counter(str(r[0]) for r in rows)


async def held_by(repo: SqlRepository, worker: str) -> int:
    e = schema.job_outbox_events
    async with repo.read() as tx:
        stmt = sa.select(sa.func.count()).where(e.c.status == "delivering", e.c.worker_id == worker)
        return int((await tx.connection.execute(stmt)).scalar_one())


@pytest.mark.slow
async def test_killed_deliverers_lose_nothing_and_each_event_is_processed_once(
    engine: str, database_url: str, repo: SqlRepository, tmp_path: Path
) -> None:
    async with repo.transaction() as tx:
        await tx.connection.execute(sa.text(LEDGER_DDL))
    receiver = Receiver(database_url)
    hook = await anyio.to_thread.run_sync(receiver.start)
    fleet = Fleet(database_url, tmp_path / "deliverer-reports.txt")
    started = time.monotonic()
    deadline = started + DEADLINE_SECONDS
    orphaned: dict[str, int] = {}
    try:
        made = await make_webhook_events(
            repo,
            datetime.now(UTC),
            jobs=JOBS,
            events_per_job=EVENTS_PER_JOB,
            requester_id=REQUESTER,
            url=hook,
            max_attempts=50,
        )
        total = JOBS * EVENTS_PER_JOB
        # The second event of every other job: processed, then its answer lost.
        receiver.lose_answer = {str(ids[1]) for ids in list(made.values())[::2]}
        names = [f"d{i}" for i in range(DELIVERERS)]
        for i, name in enumerate(names):
            fleet.start(name, seed=100 + i)

        async def progress() -> str:
            return (
                f"{dict(await event_statuses(repo))}; processed {len(receiver.processed)}; "
                f"wire {sum(receiver.wire.values())}; errors {receiver.errors[:3]}"
            )

        for n, victim in enumerate(names[:KILLED]):
            target = total * (n + 1) // (KILLED + 2)

            async def holding(v: str = victim, t: int = target) -> bool:
                return len(receiver.processed) >= t and await held_by(repo, v) > 0

            await wait_until(f"{victim} to hold a lease", holding, deadline, describe=progress)
            fleet.kill(victim)
            orphaned[victim] = await held_by(repo, victim)
            fleet.start(f"r{n}", seed=200 + n)

        async def all_delivered() -> bool:
            return (await event_statuses(repo))["delivered"] == total

        await wait_until("every event delivered", all_delivered, deadline, describe=progress)
    finally:
        codes = fleet.shutdown()
        await anyio.to_thread.run_sync(receiver.stop)

    reports = fleet.report_path.read_text() if fleet.report_path.exists() else ""
    survivors = {n: c for n, c in codes.items() if n not in fleet.killed}
    assert all(c == 0 for c in survivors.values()), f"exit codes {codes}\n{reports}"
    assert receiver.errors == []
    assert sum(orphaned.values()) >= 1, orphaned  # the kills left leases behind

    every = {str(i) for ids in made.values() for i in ids}
    assert set(receiver.wire) == every
    # Each event processed exactly once, though some reached the wire more than once.
    assert len(receiver.processed) == total
    assert len(set(receiver.processed)) == total
    assert any(count > 1 for count in receiver.wire.values()), receiver.wire
    for ids in (ids for ids in made.values() if str(ids[1]) in receiver.lose_answer):
        assert receiver.wire[str(ids[1])] >= 2
    # In stage order, per job.
    for job in made:
        sequences = [s for j, s in receiver.processed if j == str(job)]
        assert sequences == list(range(1, EVENTS_PER_JOB + 1)), (job, sequences)
    async with repo.read() as tx:
        ledger = (await tx.connection.execute(sa.text("SELECT event_id FROM webhook_ledger"))).all()
    assert sorted(str(uuid.UUID(r[0])) for r in ledger) == sorted(every)
