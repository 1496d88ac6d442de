"""Parity of the webhook delivery area (``tx.webhook_delivery``) on both engines."""

from __future__ import annotations

import uuid

import pytest

from tests.factories import make_webhook_events, run_on_separate_repos
from trace_core.clock import ManualClock
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import JOB_OUTBOX_EVENTS, Lease
from trace_core.retry import RetryClass
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio


async def claim(
    repo: SqlRepository, clock: ManualClock, worker: str, limit: int = 25
) -> list[Lease]:
    async with repo.statement() as tx:
        return await tx.webhook_delivery.claim_in_stage_order(
            worker_id=worker, lease_seconds=30, now=clock.now(), limit=limit
        )


def queue(repo: SqlRepository, clock: ManualClock) -> LeaseQueue:
    return LeaseQueue(repo, JOB_OUTBOX_EVENTS, clock=clock, config=LeaseConfig(lease_seconds=30))


async def test_claim_takes_one_event_per_job_in_sequence_order(
    repo: SqlRepository, clock: ManualClock
) -> None:
    made = await make_webhook_events(repo, clock.now(), jobs=3, events_per_job=3)
    q = queue(repo, clock)
    for position in range(3):
        leases = await claim(repo, clock, "w1")
        # Exactly the next event of every job, nothing behind it.
        assert {lease.item_id for lease in leases} == {ids[position] for ids in made.values()}
        lease = leases[0]
        assert lease.worker_id == "w1" and lease.attempt == 1 and lease.claim_version == 1
        assert lease.data["job_id"] in made
        assert lease.data["payload"]["event_id"] == str(lease.item_id)
        assert await claim(repo, clock, "w2") == []  # their successors wait
        for lease in leases:
            await q.complete(lease.fence)
    assert await claim(repo, clock, "w1") == []


async def test_an_event_waiting_for_a_retry_holds_back_its_successors_until_dead_lettered(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [ids] = (await make_webhook_events(repo, clock.now(), events_per_job=2)).values()
    q = queue(repo, clock)
    [first] = await claim(repo, clock, "w1")
    outcome = await q.fail(first.fence, "HTTP 503")
    assert outcome.retrying
    # Pending again, but not yet available: nothing is claimable, not even event 2.
    assert await claim(repo, clock, "w1") == []
    clock.advance(3600)
    [again] = await claim(repo, clock, "w1")
    assert again.item_id == ids[0] and again.attempt == 2
    outcome = await q.fail(again.fence, "HTTP 410", retry_class=RetryClass.FATAL)
    assert outcome.status == "dead_letter"
    [second] = await claim(repo, clock, "w1")
    assert second.item_id == ids[1]


async def test_a_leased_event_is_not_claimed_again_and_expiry_hands_it_over(
    repo: SqlRepository, clock: ManualClock
) -> None:
    await make_webhook_events(repo, clock.now(), events_per_job=1)
    [lease] = await claim(repo, clock, "w1")
    assert await claim(repo, clock, "w2") == []
    clock.advance(31)
    q = queue(repo, clock)
    report = await q.reclaim_expired()
    assert report.retried == [lease.item_id]
    clock.advance(3600)
    [taken] = await claim(repo, clock, "w2")
    assert taken.item_id == lease.item_id and taken.claim_version > lease.claim_version


async def test_concurrent_claimers_never_share_an_event(
    database_url: str, repo: SqlRepository, clock: ManualClock
) -> None:
    made = await make_webhook_events(repo, clock.now(), jobs=12, events_per_job=2)
    taken: list[uuid.UUID] = []

    async def claimer(r: SqlRepository, n: int) -> None:
        for _ in range(3):
            async with r.statement() as tx:
                leases = await tx.webhook_delivery.claim_in_stage_order(
                    worker_id=f"w{n}", lease_seconds=30, now=clock.now(), limit=3
                )
            taken.extend(lease.item_id for lease in leases)  # type: ignore[misc]

    await run_on_separate_repos(database_url, 4, claimer)
    assert len(taken) == len(set(taken)) == 12
    assert set(taken) == {ids[0] for ids in made.values()}


async def test_targets_read_the_jobs_url_and_requester(
    repo: SqlRepository, clock: ManualClock
) -> None:
    hooked = await make_webhook_events(
        repo, clock.now(), events_per_job=2, requester_id="acme", url="https://acme.test/hook"
    )
    polled = await make_webhook_events(repo, clock.now(), events_per_job=1, url=None)
    [(job, ids)] = hooked.items()
    [(polled_job, [polled_event])] = polled.items()
    unknown = uuid.uuid4()
    async with repo.read() as tx:
        targets = await tx.webhook_delivery.targets([*ids, polled_event, unknown])
        assert await tx.webhook_delivery.targets([]) == {}
    assert set(targets) == {*ids, polled_event}
    t = targets[ids[1]]
    assert (t.event_id, t.job_id, t.requester_id, t.url) == (
        ids[1],
        job,
        "acme",
        "https://acme.test/hook",
    )
    assert targets[polled_event].url is None and targets[polled_event].job_id == polled_job
