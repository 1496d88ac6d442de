"""The inbox job lifecycle (euterpe-contract.md §3, §4, §5, §8), on both engines:
every allowed transition and every forbidden one, history and events written
with each in the same transaction, fences, the separate counters, reclaim and
pruning."""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from trace_core.clock import ManualClock
from trace_core.errors import (
    ConfigurationError,
    DuplicateItem,
    InvalidInput,
    InvalidTransition,
    NotFound,
    StaleClaim,
)
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.job_records import job_id_of
from trace_core.euterpe.job_status import JobPruned, JobStatus
from trace_core.euterpe.jobs import InboxJobs, JobsConfig
from trace_core.leasing import LeaseQueue
from trace_core.model import JOB_OUTBOX_EVENTS, Fence, Lease
from trace_core.retry import Backoff, RetryPolicy
from trace_core.states import INBOX_LIFECYCLE
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

LEASE = 30.0
HOOK = "https://hooks.example/req-a"
OUTPUTS = [{"key": "out/clip-360p.mp4", "size": 1234, "sha256": "ab" * 32, "preset": "p360"}]
UNAVAILABLE = NormalizedError("storage_unavailable", "object store answered 503", True)
BROKEN = NormalizedError("transcode_failed", "ffmpeg exited 1", False)
FORBIDDEN = NormalizedError("storage_forbidden", "object store answered 403", False)


class EventIds:
    """The service's event-id source, able to hand out one chosen id next."""

    def __init__(self) -> None:
        self.forced: list[uuid.UUID] = []

    def __call__(self) -> uuid.UUID:
        return self.forced.pop(0) if self.forced else uuid.uuid4()


@pytest.fixture
def ids() -> EventIds:
    return EventIds()


@pytest.fixture
def commits() -> list[list[uuid.UUID]]:
    return []


@pytest.fixture
def jobs(
    repo: SqlRepository, clock: ManualClock, ids: EventIds, commits: list[list[uuid.UUID]]
) -> InboxJobs:
    retry = RetryPolicy(
        normal=Backoff(base_seconds=10, cap_seconds=100, jitter=0.0),
        max_credential_refreshes=2,
    )
    return InboxJobs(
        repo,
        clock=clock,
        config=JobsConfig(lease_seconds=LEASE, max_attempts=3),
        retry=retry,
        rng=random.Random(7),
        on_commit=commits.append,
        new_event_id=ids,
    )


async def enqueue(jobs: InboxJobs, **kw: Any) -> uuid.UUID:
    kw.setdefault("status_webhook_url", HOOK)
    return await jobs.enqueue(requester_id="req-a", request={"source": "in/a.mov"}, **kw)


async def claimed(jobs: InboxJobs, **kw: Any) -> tuple[uuid.UUID, Lease]:
    job = await enqueue(jobs, **kw)
    lease = (await jobs.claim(job, "w1")).lease
    assert lease is not None
    return job, lease


async def to_stage(jobs: InboxJobs, lease: Lease, stage: str) -> None:
    """Walk the stages of the table up to ``stage`` (``claimed`` stays put)."""
    for s in ("fetching", "processing", "uploading"):
        if stage == "claimed":
            return
        await jobs.advance(lease.fence, s)
        if s == stage:
            return


def steps(status: JobStatus) -> list[tuple[str | None, str]]:
    return [(h.from_status, h.to_status) for h in status.history]


async def payloads(repo: SqlRepository, job: uuid.UUID) -> list[dict[str, Any]]:
    e = schema.job_outbox_events
    async with repo.read() as tx:
        rows = await tx.connection.execute(
            sa.select(e.c.payload).where(e.c.job_id == job).order_by(e.c.sequence)
        )
        return [dict(r[0]) for r in rows]


def assert_events_follow_history(status: JobStatus, bodies: list[dict[str, Any]]) -> None:
    """One event per history step, in order, numbered 1, 2, …"""
    assert [b["status"] for b in bodies] == [h.to_status for h in status.history]
    assert [b["sequence"] for b in bodies] == list(range(1, len(bodies) + 1))
    assert [e.sequence for e in status.events] == [b["sequence"] for b in bodies]
    assert [str(e.event_id) for e in status.events] == [b["event_id"] for b in bodies]


# --- the happy path, history and events -----------------------------------------


async def test_a_job_walks_every_stage_with_history_and_events(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock, commits: list[list[uuid.UUID]]
) -> None:
    job, lease = await claimed(jobs)
    assert lease.attempt == 1 and lease.claim_version == 1
    await to_stage(jobs, lease, "uploading")
    await jobs.heartbeat(lease.fence)
    await jobs.succeed(lease.fence, OUTPUTS)
    status = await jobs.status(job)
    assert status.status == "succeeded" and status.outputs == OUTPUTS and status.error is None
    assert status.attempt_count == 1 and status.finished_at == clock.now()
    assert steps(status) == [
        (None, "queued"),
        ("queued", "claimed"),
        ("claimed", "fetching"),
        ("fetching", "processing"),
        ("processing", "uploading"),
        ("uploading", "succeeded"),
    ]
    bodies = await payloads(repo, job)
    assert_events_follow_history(status, bodies)
    assert [b["event_type"] for b in bodies][-1] == "transcode.succeeded"
    assert bodies[-1]["outputs"] == OUTPUTS
    assert all("outputs" not in b for b in bodies[:-1])
    assert bodies[1]["metadata"]["claim_version"] == 1
    assert "w1" not in str(bodies)  # the worker's identity stays inside
    # one wake-up per commit that wrote events (the heartbeat wrote none)
    assert [len(c) for c in commits] == [1] * 6
    assert [eid for c in commits for eid in c] == [e.event_id for e in status.events]
    body = status.as_json()
    assert body["status"] == "succeeded" and body["outputs"] == OUTPUTS
    assert len(body["history"]) == 6 and len(body["webhooks"]) == 6


async def test_a_job_without_webhook_url_has_history_but_no_events(
    repo: SqlRepository, jobs: InboxJobs, commits: list[list[uuid.UUID]]
) -> None:
    job, lease = await claimed(jobs, status_webhook_url=None)
    await jobs.advance(lease.fence, "fetching")
    status = await jobs.status(job)
    assert steps(status) == [(None, "queued"), ("queued", "claimed"), ("claimed", "fetching")]
    assert status.events == [] and commits == []


async def test_claim_batch_writes_a_claimed_event_per_job(
    repo: SqlRepository, jobs: InboxJobs
) -> None:
    made = {await enqueue(jobs) for _ in range(3)}
    leases = await jobs.claim_batch("w1", 2)
    assert len(leases) == 2
    for lease in leases:
        assert isinstance(lease.item_id, uuid.UUID)
        status = await jobs.status(lease.item_id)
        assert steps(status)[-1] == ("queued", "claimed")
        assert (await payloads(repo, lease.item_id))[-1]["status"] == "claimed"
    [left] = made - {lease.item_id for lease in leases}
    assert steps(await jobs.status(left)) == [(None, "queued")]


async def test_enqueue_joins_the_callers_transaction(repo: SqlRepository, jobs: InboxJobs) -> None:
    job_id = uuid.uuid4()
    with pytest.raises(RuntimeError):
        async with repo.transaction() as tx:
            await jobs.enqueue(tx, requester_id="req-a", request={}, job_id=job_id)
            raise RuntimeError("the caller's request fails after the insert")
    with pytest.raises(NotFound):
        await jobs.status(job_id)
    async with repo.transaction() as tx:
        assert await jobs.enqueue(tx, requester_id="req-a", request={}, job_id=job_id) == job_id
    assert (await jobs.status(job_id)).status == "queued"


async def test_bad_input_names_the_field(jobs: InboxJobs) -> None:
    with pytest.raises(InvalidInput, match="requester_id"):
        await jobs.enqueue(requester_id="", request={})
    with pytest.raises(InvalidInput, match="max_attempts"):
        await jobs.enqueue(requester_id="r", request={}, max_attempts=0)
    job, lease = await claimed(jobs)
    with pytest.raises(InvalidInput, match="stage"):
        await jobs.advance(lease.fence, "succeeded")
    await to_stage(jobs, lease, "uploading")
    bad = [{**OUTPUTS[0], "sha256": "xyz"}]
    with pytest.raises(InvalidInput, match=r"outputs\[0\]\.sha256"):
        await jobs.succeed(lease.fence, bad)
    with pytest.raises(InvalidInput, match=r"outputs\[0\]\.size"):
        await jobs.succeed(lease.fence, [{**OUTPUTS[0], "size": -1}])
    with pytest.raises(InvalidInput, match="outputs"):
        await jobs.succeed(lease.fence, [])
    assert (await jobs.status(job)).status == "uploading"


# --- the table of §3: every allowed edge, every forbidden one -----------------------


async def test_every_allowed_transition_is_taken_and_recorded(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    seen: set[tuple[str, str]] = set()

    async def collect(job: uuid.UUID) -> None:
        status = await jobs.status(job)
        seen.update((s, t) for s, t in steps(status) if s is not None)
        assert_events_follow_history(status, await payloads(repo, job))

    job, lease = await claimed(jobs)
    await to_stage(jobs, lease, "uploading")
    await jobs.succeed(lease.fence, OUTPUTS)
    await collect(job)
    for stage in ("claimed", "fetching", "processing", "uploading"):
        job, lease = await claimed(jobs)
        await to_stage(jobs, lease, stage)
        await jobs.release(lease.fence, reason="draining")  # stage -> queued
        await collect(job)
        job, lease = await claimed(jobs)
        await to_stage(jobs, lease, stage)
        outcome = await jobs.fail(lease.fence, UNAVAILABLE)  # stage -> failed
        assert outcome.path == ("failed",) and outcome.retrying
        await collect(job)
    clock.advance(1000)
    assert len(await InboxMaintenance(jobs).requeue_due()) == 4  # failed -> queued
    job, lease = await claimed(jobs)
    outcome = await jobs.fail(lease.fence, BROKEN)  # failed -> dead_letter
    assert outcome.path == ("failed", "dead_letter") and not outcome.retrying
    for j in {*(await _all_jobs(repo))}:
        await collect(j)
    assert seen == set(INBOX_LIFECYCLE.edges)


async def _all_jobs(repo: SqlRepository) -> list[uuid.UUID]:
    async with repo.read() as tx:
        return list((await tx.connection.execute(sa.select(schema.inbox_jobs.c.id))).scalars())


async def in_status(jobs: InboxJobs, clock: ManualClock, status: str) -> tuple[uuid.UUID, Lease]:
    """A job brought to ``status`` by the service, with the last lease it had."""
    job, lease = await claimed(jobs)
    if status in ("claimed", "fetching", "processing", "uploading"):
        await to_stage(jobs, lease, status)
    elif status == "succeeded":
        await to_stage(jobs, lease, "uploading")
        await jobs.succeed(lease.fence, OUTPUTS)
    elif status == "failed":
        await jobs.fail(lease.fence, UNAVAILABLE)
    elif status == "dead_letter":
        await jobs.fail(lease.fence, BROKEN)
    elif status == "queued":
        await jobs.release(lease.fence, reason="back")
    return job, lease


def attempts_of(jobs: InboxJobs, job: uuid.UUID, fence: Fence) -> dict[str, Callable[[], Any]]:
    """The service's way into each status."""
    return {
        "claimed": lambda: jobs.claim(job, "w9"),
        "fetching": lambda: jobs.advance(fence, "fetching"),
        "processing": lambda: jobs.advance(fence, "processing"),
        "uploading": lambda: jobs.advance(fence, "uploading"),
        "succeeded": lambda: jobs.succeed(fence, OUTPUTS),
        "failed": lambda: jobs.fail(fence, UNAVAILABLE),
        "queued": lambda: jobs.release(fence, reason="again"),
        "dead_letter": lambda: InboxMaintenance(jobs).dead_letter_failed([job], error=BROKEN),
    }


@pytest.mark.parametrize("source", sorted(INBOX_LIFECYCLE.statuses))
async def test_every_forbidden_transition_is_refused(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock, source: str
) -> None:
    job, lease = await in_status(jobs, clock, source)
    before = await jobs.status(job)
    assert before.status == source
    for target, attempt in attempts_of(jobs, job, lease.fence).items():
        if INBOX_LIFECYCLE.allows(source, target):
            continue
        try:
            answer = await attempt()
        except InvalidTransition:
            pass
        except StaleClaim:
            # only where no fence is current any more: a job handed back
            # (its attempt refunded) or reclaimed
            assert source == "queued", (source, target)
        else:
            # a claim says why not; an operator's dead letter moves nothing
            refused = getattr(answer, "claimed", None) is False or answer == set()
            assert refused, (source, target, answer)
        after = await jobs.status(job)
        assert after.status == source, (source, target)
        assert after.history == before.history and after.events == before.events


@pytest.mark.parametrize("seed", range(3))
async def test_random_walks_stay_inside_the_table(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock, seed: int
) -> None:
    """Random operations on one job: each either moves it along an edge of the
    table (recorded once) or is refused without a trace."""
    rng = random.Random(seed)
    job, lease = await claimed(jobs, max_attempts=4)
    fence = lease.fence
    for _ in range(14):
        clock.advance(LEASE / 4)
        before = await jobs.status(job)
        ops: dict[str, Callable[[], Any]] = {
            **attempts_of(jobs, job, fence),
            "requeue_due": lambda: InboxMaintenance(jobs).requeue_due(),
            "reclaim": lambda: InboxMaintenance(jobs).reclaim_expired(),
        }
        name = rng.choice(sorted(ops))
        try:
            answer = await ops[name]()
        except (InvalidTransition, StaleClaim):
            answer = None
        if name == "claimed" and answer is not None and answer.lease is not None:
            fence = answer.lease.fence
        after = await jobs.status(job)
        new = steps(after)[len(before.history) :]
        assert steps(after)[: len(before.history)] == steps(before)
        walked = [before.status] + [t for _, t in new]
        assert new == [] or new[0][0] == before.status
        for s, t in itertools.pairwise(walked):
            assert INBOX_LIFECYCLE.allows(s, t), (name, s, t)
        assert walked[-1] == after.status
        assert_events_follow_history(after, await payloads(repo, job))


# --- the same transaction -----------------------------------------------------------


async def test_a_failing_event_insert_rolls_back_the_transition(
    repo: SqlRepository, jobs: InboxJobs, ids: EventIds
) -> None:
    job, lease = await claimed(jobs)
    taken = (await jobs.status(job)).events[-1].event_id
    ids.forced.append(taken)  # the next event collides with an existing one
    with pytest.raises(DuplicateItem):
        await jobs.advance(lease.fence, "fetching")
    status = await jobs.status(job)
    assert status.status == "claimed"
    assert steps(status) == [(None, "queued"), ("queued", "claimed")]
    # a claim rolls back the same way: the job stays queued, no attempt spent
    other = await enqueue(jobs)
    ids.forced.append(taken)
    with pytest.raises(DuplicateItem):
        await jobs.claim(other, "w2")
    again = await jobs.status(other)
    assert (again.status, again.attempt_count, steps(again)) == ("queued", 0, [(None, "queued")])
    await jobs.advance(lease.fence, "fetching")  # and the first job carries on
    assert (await jobs.status(job)).status == "fetching"


# --- fences -----------------------------------------------------------------------


async def test_a_stale_fence_changes_nothing_anywhere(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    job, old = await claimed(jobs)
    await jobs.advance(old.fence, "fetching")
    clock.advance(LEASE + 1)
    report = await InboxMaintenance(jobs).reclaim_expired()
    assert report.retried == [job]
    clock.advance(1000)
    assert await InboxMaintenance(jobs).requeue_due() == [job]
    new = (await jobs.claim(job, "w2")).lease
    assert new is not None and new.claim_version > old.claim_version
    before = await jobs.status(job)
    writes: list[Callable[[], Any]] = [
        lambda: jobs.heartbeat(old.fence),
        lambda: jobs.advance(old.fence, "fetching"),
        lambda: jobs.succeed(old.fence, OUTPUTS),
        lambda: jobs.fail(old.fence, UNAVAILABLE),
        lambda: jobs.release(old.fence, reason="late"),
        lambda: jobs.record_credential_refresh(old.fence),
    ]
    forged = [
        Fence(job, new.attempt, new.lease_token, new.claim_version + 1),
        Fence(job, new.attempt, uuid.uuid4(), new.claim_version),
    ]
    writes += [lambda f=f: jobs.advance(f, "fetching") for f in forged]
    for write in writes:
        with pytest.raises(StaleClaim):
            await write()
    after = await jobs.status(job)
    assert after.history == before.history and after.events == before.events
    assert (after.status, after.credential_refresh_count) == ("claimed", 0)
    with pytest.raises(ConfigurationError, match="claim_version"):
        await jobs.advance(Fence(job, new.attempt, new.lease_token, None), "fetching")
    await jobs.advance(new.fence, "fetching")  # the current holder is unaffected


# --- counters (§5) ------------------------------------------------------------------


async def test_a_worker_that_never_records_a_refresh_still_stops(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    job, lease = await claimed(jobs)
    paths = []
    for _ in range(4):
        paths.append((await jobs.fail(lease.fence, FORBIDDEN, http_status=401)).path)
        if paths[-1][-1] == "dead_letter":
            break
        clock.advance(1000)
        lease = (await jobs.claim(job, "w1")).lease
        assert lease is not None
    assert paths == [("queued",), ("queued",), ("failed", "dead_letter")]
    status = await jobs.status(job)
    assert (status.attempt_count, status.credential_refresh_count) == (1, 2)


async def test_credential_refreshes_never_spend_an_execution_attempt(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    job, lease = await claimed(jobs)
    await jobs.advance(lease.fence, "fetching")
    first = await jobs.record_credential_refresh(lease.fence)
    assert (first.allowed, first.count, first.budget) == (True, 1, 2)
    # the new credentials did not arrive: back off without spending the attempt
    outcome = await jobs.fail(lease.fence, FORBIDDEN, http_status=403)
    assert outcome.path == ("queued",) and outcome.retrying
    status = await jobs.status(job)
    # the backoff is a refresh try of its own; the execution attempt is handed back
    counters = (status.status, status.attempt_count, status.credential_refresh_count)
    assert counters == ("queued", 0, 2)
    assert status.next_attempt_at is not None and status.next_attempt_at > clock.now()
    assert steps(status)[-1] == ("fetching", "queued")
    assert (await payloads(repo, job))[-1]["metadata"]["reason"] == "storage_forbidden"
    assert not (await jobs.claim(job, "w1")).claimed  # not before the backoff
    clock.advance(1000)
    lease = (await jobs.claim(job, "w1")).lease
    assert lease is not None and lease.attempt == 1  # the same execution attempt
    spent = await jobs.record_credential_refresh(lease.fence)
    assert (spent.allowed, spent.count) == (False, 2)
    outcome = await jobs.fail(lease.fence, FORBIDDEN, http_status=403)
    assert outcome.path == ("failed", "dead_letter")
    status = await jobs.status(job)
    assert status.status == "dead_letter" and status.attempt_count == 1
    assert status.error == FORBIDDEN
    bodies = await payloads(repo, job)
    assert [b["status"] for b in bodies[-2:]] == ["failed", "dead_letter"]
    assert all(b["error"]["code"] == "storage_forbidden" for b in bodies[-2:])


async def test_exhausted_attempts_dead_letter_through_failed(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    job, lease = await claimed(jobs, max_attempts=2)
    first = await jobs.fail(lease.fence, UNAVAILABLE, http_status=503)
    assert first.path == ("failed",) and first.retrying
    status = await jobs.status(job)
    assert status.status == "failed" and status.error == UNAVAILABLE
    assert status.next_attempt_at == clock.now() + timedelta(seconds=10)  # no jitter here
    clock.advance(10)
    assert await InboxMaintenance(jobs).requeue_due() == [job]
    lease = (await jobs.claim(job, "w1")).lease
    assert lease is not None and lease.attempt == 2
    last = await jobs.fail(lease.fence, UNAVAILABLE, http_status=502)
    assert last.path == ("failed", "dead_letter") and not last.retrying
    status = await jobs.status(job)
    assert status.status == "dead_letter" and status.attempt_count == 2
    assert steps(status) == [
        (None, "queued"),
        ("queued", "claimed"),
        ("claimed", "failed"),
        ("failed", "queued"),
        ("queued", "claimed"),
        ("claimed", "failed"),
        ("failed", "dead_letter"),
    ]
    assert_events_follow_history(status, await payloads(repo, job))
    assert status.as_json()["error"]["code"] == "storage_unavailable"


async def test_a_fatal_error_dead_letters_at_once(repo: SqlRepository, jobs: InboxJobs) -> None:
    job, lease = await claimed(jobs)
    await jobs.advance(lease.fence, "fetching")
    outcome = await jobs.fail(lease.fence, BROKEN)
    assert outcome.path == ("failed", "dead_letter")
    status = await jobs.status(job)
    assert steps(status)[-2:] == [("fetching", "failed"), ("failed", "dead_letter")]
    assert status.attempt_count == 1 and status.error == BROKEN


# --- reclaim ------------------------------------------------------------------------


async def test_reclaim_writes_the_same_history_and_events(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock, commits: list[list[uuid.UUID]]
) -> None:
    retried, lease_r = await claimed(jobs)
    await to_stage(jobs, lease_r, "processing")
    exhausted, _ = await claimed(jobs, max_attempts=1)
    commits.clear()
    clock.advance(LEASE + 1)
    report = await InboxMaintenance(jobs).reclaim_expired()
    assert report.retried == [retried] and report.dead_lettered == [exhausted]
    r = await jobs.status(retried)
    assert steps(r)[-1] == ("processing", "failed") and r.status == "failed"
    assert r.error is not None and r.error.code == "lease_expired"
    x = await jobs.status(exhausted)
    assert steps(x)[-2:] == [("claimed", "failed"), ("failed", "dead_letter")]
    for status, job in ((r, retried), (x, exhausted)):
        assert_events_follow_history(status, await payloads(repo, job))
    assert len(commits) == 1 and len(commits[0]) == 3  # one commit, three events
    with pytest.raises(StaleClaim):
        await jobs.advance(lease_r.fence, "uploading")


# --- status and pruning -------------------------------------------------------------


async def test_status_hides_other_requesters_jobs(jobs: InboxJobs) -> None:
    job = await enqueue(jobs)
    assert (await jobs.status(job, requester_id="req-a")).status == "queued"
    with pytest.raises(NotFound) as caught:
        await jobs.status(job, requester_id="req-b")
    assert not isinstance(caught.value, JobPruned)
    with pytest.raises(NotFound):
        await jobs.status(uuid.uuid4())


async def deliver_all(repo: SqlRepository, clock: ManualClock) -> None:
    """Settle every pending event through the outbox protocol (as a deliverer would)."""
    q = LeaseQueue(repo, JOB_OUTBOX_EVENTS, clock=clock)
    while leases := await q.claim_batch("deliverer", 25):
        await q.complete_many([lease.fence for lease in leases])


async def test_prune_leaves_a_tombstone_after_retention(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    done, lease = await claimed(jobs)
    await to_stage(jobs, lease, "uploading")
    await jobs.succeed(lease.fence, OUTPUTS)
    running, _ = await claimed(jobs)
    clock.advance(hours=2)
    assert (
        await InboxMaintenance(jobs).prune(timedelta(hours=1)) == []
    )  # its webhooks are not out yet
    await deliver_all(repo, clock)
    assert await InboxMaintenance(jobs).prune(timedelta(hours=3)) == []  # not old enough
    assert await InboxMaintenance(jobs).prune(timedelta(hours=1)) == [done]
    with pytest.raises(JobPruned) as gone:
        await jobs.status(done, requester_id="req-a")
    assert gone.value.tombstone.final_status == "succeeded"
    with pytest.raises(NotFound) as hidden:
        await jobs.status(done, requester_id="req-b")
    assert not isinstance(hidden.value, JobPruned)
    assert (await jobs.status(running)).status == "claimed"
    with pytest.raises(InvalidInput):
        await InboxMaintenance(jobs).prune(timedelta(seconds=-1))


async def test_a_failing_on_commit_hook_does_not_undo_the_write(
    jobs: InboxJobs, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: Any) -> None:
        raise RuntimeError("deliverer gone")

    jobs.on_commit = broken
    job = await enqueue(jobs)
    assert (await jobs.status(job)).status == "queued"
    assert "on_commit hook failed" in caplog.text


# --- concurrency (§13, in one process: the engines' locks, not the processes) -------


async def test_concurrent_claimers_take_each_job_once(repo: SqlRepository, jobs: InboxJobs) -> None:
    made = [await enqueue(jobs) for _ in range(12)]
    taken: list[uuid.UUID] = []

    async def claimer(name: str) -> None:
        while leases := await jobs.claim_batch(name, 5):
            taken.extend(job_id_of(lease) for lease in leases)

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(claimer, f"w{n}")
    assert sorted(taken) == sorted(made)  # every job once, none twice
    for job in made:
        status = await jobs.status(job)
        assert steps(status) == [(None, "queued"), ("queued", "claimed")]
        assert_events_follow_history(status, await payloads(repo, job))


async def test_a_late_failure_racing_the_reclaim_is_recorded_once(
    repo: SqlRepository, jobs: InboxJobs, clock: ManualClock
) -> None:
    job, lease = await claimed(jobs)
    await jobs.advance(lease.fence, "fetching")
    clock.advance(LEASE + 1)
    answers: list[Any] = []

    async def worker() -> None:
        try:
            answers.append(await jobs.fail(lease.fence, UNAVAILABLE))
        except StaleClaim as stale:
            answers.append(stale)

    async def supervisor() -> None:
        answers.append(await InboxMaintenance(jobs).reclaim_expired())

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        tg.start_soon(supervisor)
    status = await jobs.status(job)
    assert status.status == "failed"
    assert steps(status)[2:] == [("claimed", "fetching"), ("fetching", "failed")]
    assert_events_follow_history(status, await payloads(repo, job))
