"""Signed webhooks: the signature against a vector computed here by hand, the
verifier's refusals, the receiver helper's replay and dedupe records, and the
deliverer's order, retries, dead letters and fencing (both engines).

The deliverer posts through its ``WebhookPoster`` port into an in-process
poster that hands every delivery to the real receiver helper (so every post
is verified as a requester would) and answers a scripted status; real HTTP
and real processes are ``tests/test_euterpe_webhooks_processes.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.factories import make_webhook_events, wait_until
from trace_core.clock import ManualClock
from trace_core.errors import ConfigurationError
from trace_core.euterpe.deliverer import DeliveryOutcome, WebhookDeliverer
from trace_core.euterpe.deliverer_config import DelivererConfig
from trace_core.euterpe.job_records import EVENTS_CHANNEL
from trace_core.euterpe.receiver import (
    ReceiverConfig,
    ReplayedWebhook,
    WebhookReceiver,
    read_request_body,
)
from trace_core.euterpe.webhook_body import webhook_body_bytes
from trace_core.euterpe.webhook_poster import PostResult
from trace_core.leasing import LeaseConfig, LeaseQueue
from trace_core.model import JOB_OUTBOX_EVENTS
from trace_core.retry import Backoff
from trace_core.security.webhook_signing import (
    BadWebhookSignature,
    MalformedWebhook,
    MasterSecret,
    StaleWebhookTimestamp,
    WebhookSigner,
    WebhookVerifier,
    derive_requester_secret,
    signature_v1,
)
from trace_core.storage.sql import SqlRepository

MASTER = MasterSecret("2026-11", b"M" * 32)
NEXT_MASTER = MasterSecret("2027-01", b"N" * 32)
EVENT = uuid.UUID("0b6e7a52-4c2f-4d8e-9a55-3f1c1c1d2e3f")
NONCE = "abcdefghijklmnop0123456789_-ABCD"
BODY = b'{"event_id":"0b6e7a52-4c2f-4d8e-9a55-3f1c1c1d2e3f","status":"queued"}'


def acme_secret_by_hand() -> bytes:
    return hmac.new(b"M" * 32, b"euterpe-webhook-v1:acme", hashlib.sha256).digest()


def signed(
    clock: ManualClock,
    *,
    body: bytes = BODY,
    nonce: str = NONCE,
    signer: WebhookSigner | None = None,
    requester: str = "acme",
    offset: int = 0,
) -> dict[str, str]:
    return (signer or WebhookSigner([MASTER])).headers(
        requester, EVENT, body, timestamp=int(clock.now().timestamp()) + offset, nonce=nonce
    )


# --- signing and verification (no database) -----------------------------------


def test_signature_matches_the_vector_computed_by_hand() -> None:
    secret = acme_secret_by_hand()
    assert derive_requester_secret(b"M" * 32, "acme") == secret
    expected = hmac.new(secret, b"1700000000." + NONCE.encode() + b"." + BODY, hashlib.sha256)
    assert signature_v1(secret, 1700000000, NONCE, BODY) == expected.hexdigest()
    headers = WebhookSigner([MASTER]).headers(
        "acme", EVENT, BODY, timestamp=1700000000, nonce=NONCE
    )
    assert headers == {
        "x-euterpe-signature": "v1=" + expected.hexdigest(),
        "x-euterpe-timestamp": "1700000000",
        "x-euterpe-nonce": NONCE,
        "x-euterpe-event-id": str(EVENT),
    }
    # Pinned, so that a change of the derivation or the signed string shows.
    assert expected.hexdigest() == signature_v1(
        bytes.fromhex(WebhookSigner([MASTER]).requester_secret_hex("acme")),
        1700000000,
        NONCE,
        BODY,
    )


def test_each_requester_has_its_own_secret_and_cannot_forge_for_another(
    clock: ManualClock,
) -> None:
    signer = WebhookSigner([MASTER])
    beta_secret = bytes.fromhex(signer.requester_secret_hex("beta"))
    assert beta_secret != acme_secret_by_hand()
    # Requester beta signs a delivery with its own secret, pretending to be the service.
    forged_entry = "v1=" + signature_v1(beta_secret, int(clock.now().timestamp()), NONCE, BODY)
    forged = signed(clock) | {"x-euterpe-signature": forged_entry}
    with pytest.raises(BadWebhookSignature) as err:
        WebhookVerifier([acme_secret_by_hand()], clock=clock).verify(forged, BODY)
    assert err.value.field == "x-euterpe-signature" and err.value.http_status == 401


def test_a_fresh_signed_delivery_verifies_and_nonces_are_random(clock: ManualClock) -> None:
    verifier = WebhookVerifier([acme_secret_by_hand()], clock=clock)
    verified = verifier.verify(signed(clock), BODY)
    assert (verified.event_id, verified.nonce) == (EVENT, NONCE)
    a = WebhookSigner([MASTER]).headers("acme", EVENT, BODY, timestamp=1)
    b = WebhookSigner([MASTER]).headers("acme", EVENT, BODY, timestamp=1)
    assert a["x-euterpe-nonce"] != b["x-euterpe-nonce"]
    assert len(a["x-euterpe-nonce"]) == 32  # 24 random bytes, URL-safe: 192 bits


@pytest.mark.parametrize("offset", [-301, 301, -10_000])
def test_a_timestamp_outside_five_minutes_is_refused(clock: ManualClock, offset: int) -> None:
    verifier = WebhookVerifier([acme_secret_by_hand()], clock=clock)
    with pytest.raises(StaleWebhookTimestamp) as err:
        verifier.verify(signed(clock, offset=offset), BODY)
    assert err.value.field == "x-euterpe-timestamp"


@pytest.mark.parametrize("offset", [-300, 300])
def test_a_timestamp_at_the_edge_of_the_window_is_accepted(clock: ManualClock, offset: int) -> None:
    verifier = WebhookVerifier([acme_secret_by_hand()], clock=clock)
    assert verifier.verify(signed(clock, offset=offset), BODY).event_id == EVENT


def test_tampering_with_body_timestamp_or_nonce_is_refused(clock: ManualClock) -> None:
    verifier = WebhookVerifier([acme_secret_by_hand()], clock=clock)
    headers = signed(clock)
    with pytest.raises(BadWebhookSignature):
        verifier.verify(headers, BODY.replace(b"queued", b"succeeded"))
    moved = headers | {"x-euterpe-timestamp": str(int(headers["x-euterpe-timestamp"]) - 1)}
    with pytest.raises(BadWebhookSignature):
        verifier.verify(moved, BODY)
    with pytest.raises(BadWebhookSignature):
        verifier.verify(headers | {"x-euterpe-nonce": NONCE[::-1]}, BODY)
    with pytest.raises(BadWebhookSignature):
        WebhookVerifier([b"w" * 32], clock=clock).verify(headers, BODY)  # wrong secret


@pytest.mark.parametrize(
    "header",
    ["x-euterpe-signature", "x-euterpe-timestamp", "x-euterpe-nonce", "x-euterpe-event-id"],
)
def test_a_missing_header_is_refused_by_name(clock: ManualClock, header: str) -> None:
    headers = {k: v for k, v in signed(clock).items() if k != header}
    with pytest.raises(MalformedWebhook) as err:
        WebhookVerifier([acme_secret_by_hand()], clock=clock).verify(headers, BODY)
    assert err.value.field == header and "missing" in str(err.value)
    assert err.value.as_json() == {"error": "malformed", "field": header, "reason": "missing"}


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-euterpe-timestamp", "-1700000000"),
        ("x-euterpe-timestamp", "17e8"),
        ("x-euterpe-nonce", "short"),
        ("x-euterpe-nonce", "has.a.dot.in.it.0123456789"),
        ("x-euterpe-event-id", "not-a-uuid"),
        ("x-euterpe-signature", "v1=" + "A" * 64),
        ("x-euterpe-signature", "v1=abc"),
        ("x-euterpe-signature", "v2=" + "a" * 64),
        ("x-euterpe-signature", "nosep"),
        ("x-euterpe-signature", " ".join(["v1=" + "a" * 64] * 9)),
    ],
)
def test_a_malformed_header_is_refused_by_name(clock: ManualClock, header: str, value: str) -> None:
    with pytest.raises(MalformedWebhook) as err:
        WebhookVerifier([acme_secret_by_hand()], clock=clock).verify(
            signed(clock) | {header: value}, BODY
        )
    assert err.value.field == header and err.value.http_status == 400


def test_rotation_signs_with_both_masters_and_either_secret_verifies(clock: ManualClock) -> None:
    signer = WebhookSigner([NEXT_MASTER, MASTER])
    headers = signed(clock, signer=signer)
    entries = headers["x-euterpe-signature"].split(" ")
    assert len(entries) == 2 and all(e.startswith("v1=") for e in entries)
    old, new = acme_secret_by_hand(), derive_requester_secret(NEXT_MASTER.secret, "acme")
    for secrets in ([old], [new], [b"x" * 32, new]):
        assert WebhookVerifier(secrets, clock=clock).verify(headers, BODY).event_id == EVENT
    # A scheme version this verifier does not know is skipped, not an error.
    later = headers | {"x-euterpe-signature": "v9=zzz " + entries[1]}
    assert WebhookVerifier([old], clock=clock).verify(later, BODY).nonce == NONCE


def test_secrets_are_validated_and_never_printed() -> None:
    assert "MMMM" not in repr(MASTER)
    with pytest.raises(ConfigurationError, match="at least 32 bytes"):
        MasterSecret("v", b"short")
    with pytest.raises(ConfigurationError, match="duplicate"):
        WebhookSigner([MASTER, MASTER])
    with pytest.raises(ConfigurationError, match="requester_id"):
        derive_requester_secret(MASTER.secret, "")


def test_deliverer_config_defaults_and_bounds() -> None:
    c = DelivererConfig()
    assert (c.batch_size, c.concurrency, c.poll_min_seconds, c.poll_max_seconds) == (
        10,
        5,
        0.5,
        1.5,
    )
    assert DelivererConfig(batch_size=25).batch_size == 25
    with pytest.raises(ConfigurationError, match=r"batch_size must be within 1\.\.25, got 26"):
        DelivererConfig(batch_size=26)
    with pytest.raises(ConfigurationError, match="heartbeat_seconds"):
        DelivererConfig(lease_seconds=5, heartbeat_seconds=5)
    with pytest.raises(ConfigurationError, match="poll_min_seconds"):
        DelivererConfig(poll_min_seconds=2, poll_max_seconds=1)


# --- the receiver helper (both engines) ------------------------------------------


def receiver(repo: SqlRepository, clock: ManualClock) -> WebhookReceiver:
    return WebhookReceiver(repo, [acme_secret_by_hand()], clock=clock)


@pytest.mark.anyio
async def test_receiver_accepts_then_dedupes_a_redelivery_and_refuses_a_replay(
    repo: SqlRepository, clock: ManualClock
) -> None:
    r = receiver(repo, clock)
    first = await r.verify_and_record(signed(clock), BODY)
    assert not first.duplicate and first.event_id == EVENT and first.event["status"] == "queued"
    with pytest.raises(ReplayedWebhook) as err:
        await r.verify_and_record(signed(clock), BODY)  # the same nonce again
    assert err.value.field == "x-euterpe-nonce" and err.value.http_status == 409
    # A deliverer's next attempt: new nonce and timestamp, same event: a duplicate.
    clock.advance(30)
    again = await r.verify_and_record(signed(clock, nonce="Z" * 32), BODY)
    assert again.duplicate and again.event_id == EVENT


@pytest.mark.anyio
async def test_receiver_keeps_the_nonce_for_the_whole_window(
    repo: SqlRepository, clock: ManualClock
) -> None:
    # The shortest window allowed (300 s); a sender clock 250 s ahead stretches
    # it to the end of the timestamp's tolerance: 250 + 300 s.
    r = WebhookReceiver(
        repo, [acme_secret_by_hand()], clock=clock, config=ReceiverConfig(nonce_ttl_seconds=300)
    )
    headers = signed(clock, offset=250)
    await r.verify_and_record(headers, BODY)
    clock.advance(540)  # still within the timestamp tolerance: the nonce must still be known
    assert await r.prune() == (0, 0)
    with pytest.raises(ReplayedWebhook):
        await r.verify_and_record(headers, BODY)
    clock.advance(20)  # now the timestamp itself is out of tolerance
    with pytest.raises(StaleWebhookTimestamp):
        await r.verify_and_record(headers, BODY)
    assert (await r.prune())[0] == 1


@pytest.mark.anyio
async def test_a_refused_delivery_consumes_no_nonce(
    repo: SqlRepository, clock: ManualClock
) -> None:
    r = receiver(repo, clock)
    bad = signed(clock) | {"x-euterpe-signature": "v1=" + "0" * 64}
    with pytest.raises(BadWebhookSignature):
        await r.verify_and_record(bad, BODY)
    mismatched = BODY.replace(b"0b6e7a52", b"1b6e7a52")
    with pytest.raises(MalformedWebhook) as err:
        await r.verify_and_record(signed(clock, body=mismatched), mismatched)
    assert err.value.field == "body.event_id"
    assert not (await r.verify_and_record(signed(clock), BODY)).duplicate


@pytest.mark.anyio
async def test_receiver_inside_the_callers_transaction_rolls_back_with_it(
    repo: SqlRepository, clock: ManualClock
) -> None:
    r = receiver(repo, clock)
    with pytest.raises(RuntimeError):
        async with repo.transaction() as tx:
            accepted = await r.verify_and_record(signed(clock), BODY, tx=tx)
            assert not accepted.duplicate
            raise RuntimeError("the requester's processing failed")
    # Nothing was recorded: the same delivery (nonce too) is processed when retried.
    async with repo.transaction() as tx:
        assert not (await r.verify_and_record(signed(clock), BODY, tx=tx)).duplicate
    clock.advance(1)
    assert (await r.verify_and_record(signed(clock, nonce="Q" * 40), BODY)).duplicate


def test_receiver_config_refuses_a_short_replay_window() -> None:
    with pytest.raises(ConfigurationError, match="nonce_ttl_seconds must be >= 300"):
        ReceiverConfig(nonce_ttl_seconds=299)


def _receive_from(messages: list[dict[str, Any]]) -> Callable[[], Awaitable[dict[str, Any]]]:
    queue = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(queue)

    return receive


@pytest.mark.anyio
async def test_read_request_body_joins_chunks_and_drops_a_body_cut_by_a_disconnect() -> None:
    whole = _receive_from(
        [
            {"type": "http.request", "body": BODY[:10], "more_body": True},
            {"type": "http.request", "body": BODY[10:], "more_body": False},
        ]
    )
    assert await read_request_body(whole) == BODY
    # A deliverer killed between its headers and the end of its body: the
    # prefix is not the delivery and must not reach the verifier.
    cut = _receive_from(
        [
            {"type": "http.request", "body": BODY[:10], "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    assert await read_request_body(cut) is None


# --- the deliverer (both engines) ------------------------------------------------

Answer = Callable[[Mapping[str, Any]], Awaitable[PostResult]]


class ReceivingPoster:
    """A ``WebhookPoster`` that hands each post to the real receiver helper (as
    the requester's endpoint would), records it, then answers through ``answer``."""

    def __init__(self, r: WebhookReceiver, answer: Answer | None = None) -> None:
        self.receiver = r
        self.answer = answer
        self.posts: list[tuple[str, bytes, dict[str, str]]] = []
        self.processed: list[Mapping[str, Any]] = []

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> PostResult:
        self.posts.append((url, body, dict(headers)))
        accepted = await self.receiver.verify_and_record(headers, body)
        if not accepted.duplicate:
            self.processed.append(accepted.event)
        return await self.answer(accepted.event) if self.answer else PostResult(200)

    async def aclose(self) -> None:
        return None


def deliverer(
    repo: SqlRepository, clock: ManualClock, poster: ReceivingPoster, **config: Any
) -> WebhookDeliverer:
    from trace_core.euterpe.deliverer_config import webhook_retry_policy

    return WebhookDeliverer(
        repo,
        WebhookSigner([MASTER]),
        poster,
        clock=clock,
        config=DelivererConfig(**config),
        retry=webhook_retry_policy(normal=Backoff(base_seconds=10, cap_seconds=60, jitter=0.5)),
        worker_id="d1",
    )


async def event_state(repo: SqlRepository, clock: ManualClock, event_id: uuid.UUID) -> Any:
    return await LeaseQueue(repo, JOB_OUTBOX_EVENTS, clock=clock).inspect(event_id)


@pytest.mark.anyio
async def test_deliverer_posts_each_jobs_events_in_order_signed_byte_for_byte(
    repo: SqlRepository, clock: ManualClock
) -> None:
    made = await make_webhook_events(
        repo, clock.now(), jobs=3, events_per_job=3, requester_id="acme", url="http://r.test/h"
    )
    poster = ReceivingPoster(receiver(repo, clock))
    d = deliverer(repo, clock, poster)
    rounds = [await d.run_once() for _ in range(4)]
    assert rounds == [[DeliveryOutcome.DELIVERED] * 3] * 3 + [[]]
    for job, ids in made.items():
        seen = [e["event_id"] for e in poster.processed if e["job_id"] == str(job)]
        assert seen == [str(i) for i in ids]  # stage order
        for event_id in ids:
            assert (await event_state(repo, clock, event_id)).status == "delivered"
    url, body, headers = poster.posts[0]
    assert url == "http://r.test/h" and headers["content-type"] == "application/json"
    event = json.loads(body)
    assert body == webhook_body_bytes(event)  # canonical: sorted keys, compact, UTF-8
    assert "é".encode() in body
    assert headers["x-euterpe-event-id"] == event["event_id"]


@pytest.mark.anyio
async def test_deliverer_retries_with_backoff_then_dead_letters_and_moves_on(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [ids] = (
        await make_webhook_events(
            repo, clock.now(), events_per_job=2, requester_id="acme", max_attempts=3
        )
    ).values()

    async def answer(event: Mapping[str, Any]) -> PostResult:
        return PostResult(503 if event["sequence"] == 1 else 200)

    poster = ReceivingPoster(receiver(repo, clock), answer)
    d = deliverer(repo, clock, poster)
    assert await d.run_once() == [DeliveryOutcome.RETRYING]
    state = await event_state(repo, clock, ids[0])
    assert state.status == "pending" and state.attempt == 1 and "HTTP 503" in state.last_error
    # Backoff 5..10 s (base 10, jitter 0.5): not before, and the next event waits too.
    assert clock.now() + timedelta(seconds=5) <= state.retry_at <= clock.now() + timedelta(10)
    assert await d.run_once() == []
    clock.advance(10)
    assert await d.run_once() == [DeliveryOutcome.RETRYING]
    clock.advance(20)
    assert await d.run_once() == [DeliveryOutcome.DEAD_LETTERED]
    state = await event_state(repo, clock, ids[0])
    assert state.status == "dead_letter" and state.attempt == 3
    # The dead letter no longer holds back the job's next event.
    assert await d.run_once() == [DeliveryOutcome.DELIVERED]
    assert [e["sequence"] for e in poster.processed] == [1, 2]  # 1 processed once, 3 posts
    assert len(poster.posts) == 4


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "outcome", "min_delay"),
    [
        (PostResult(400), DeliveryOutcome.DEAD_LETTERED, None),
        (PostResult(410), DeliveryOutcome.DEAD_LETTERED, None),
        (PostResult(429), DeliveryOutcome.RETRYING, 15.0),  # the throttled bucket (30 s)
        (PostResult(401), DeliveryOutcome.RETRYING, 5.0),
        (PostResult(423), DeliveryOutcome.RETRYING, 5.0),
        (PostResult(507), DeliveryOutcome.RETRYING, 5.0),
        (PostResult(None, "timeout (ReadTimeout)"), DeliveryOutcome.RETRYING, 5.0),
    ],
)
async def test_deliverer_classifies_each_answer(
    repo: SqlRepository,
    clock: ManualClock,
    answer: PostResult,
    outcome: str,
    min_delay: float | None,
) -> None:
    [[event_id]] = (
        await make_webhook_events(repo, clock.now(), events_per_job=1, requester_id="acme")
    ).values()

    async def reply(_: Mapping[str, Any]) -> PostResult:
        return answer

    d = deliverer(repo, clock, ReceivingPoster(receiver(repo, clock), reply))
    assert await d.run_once() == [outcome]
    state = await event_state(repo, clock, event_id)
    assert state.status == ("pending" if min_delay is not None else "dead_letter")
    if min_delay is not None:
        assert state.retry_at >= clock.now() + timedelta(seconds=min_delay)


@pytest.mark.anyio
async def test_a_stale_deliverer_writes_nothing_after_its_lease_was_reclaimed(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [[event_id]] = (
        await make_webhook_events(repo, clock.now(), events_per_job=1, requester_id="acme")
    ).values()
    other = LeaseQueue(repo, JOB_OUTBOX_EVENTS, clock=clock, config=LeaseConfig(lease_seconds=30))

    async def slow(_: Mapping[str, Any]) -> PostResult:
        clock.advance(31)  # the post outlived the lease; another deliverer reclaims it
        assert (await other.reclaim_expired()).retried == [event_id]
        return PostResult(200)

    d = deliverer(repo, clock, ReceivingPoster(receiver(repo, clock), slow))
    assert await d.run_once() == [DeliveryOutcome.LOST_LEASE]
    state = await event_state(repo, clock, event_id)
    assert state.status == "pending" and state.claim_version == 2
    assert "lease expired" in state.last_error


@pytest.mark.anyio
async def test_the_lease_is_heartbeated_while_a_slow_post_runs(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [[event_id]] = (
        await make_webhook_events(repo, clock.now(), events_per_job=1, requester_id="acme")
    ).values()

    async def slow(_: Mapping[str, Any]) -> PostResult:
        clock.advance(25)  # most of the 30 s lease is gone

        async def extended() -> bool:
            state = await event_state(repo, clock, event_id)
            return bool(state.lease_expires_at == clock.now() + timedelta(seconds=30))

        await wait_until(
            "a heartbeat", extended, time.monotonic() + 10, describe=lambda: "no heartbeat"
        )
        return PostResult(200)

    d = deliverer(repo, clock, ReceivingPoster(receiver(repo, clock), slow), heartbeat_seconds=0.02)
    assert await d.run_once() == [DeliveryOutcome.DELIVERED]


@pytest.mark.anyio
async def test_a_post_is_abandoned_when_the_heartbeat_finds_the_lease_lost(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [[event_id]] = (
        await make_webhook_events(repo, clock.now(), events_per_job=1, requester_id="acme")
    ).values()
    other = LeaseQueue(repo, JOB_OUTBOX_EVENTS, clock=clock, config=LeaseConfig(lease_seconds=30))

    async def hangs(_: Mapping[str, Any]) -> PostResult:
        clock.advance(31)
        await other.reclaim_expired()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    d = deliverer(
        repo, clock, ReceivingPoster(receiver(repo, clock), hangs), heartbeat_seconds=0.02
    )
    with anyio.fail_after(10):
        assert await d.run_once() == [DeliveryOutcome.LOST_LEASE]
    assert (await event_state(repo, clock, event_id)).status == "pending"


@pytest.mark.anyio
async def test_events_of_a_job_without_webhook_are_closed_unsent(
    repo: SqlRepository, clock: ManualClock
) -> None:
    [ids] = (await make_webhook_events(repo, clock.now(), events_per_job=2, url=None)).values()
    poster = ReceivingPoster(receiver(repo, clock))
    d = deliverer(repo, clock, poster)
    assert await d.run_once() == [DeliveryOutcome.NO_WEBHOOK]
    assert await d.run_once() == [DeliveryOutcome.NO_WEBHOOK]
    assert poster.posts == []
    assert {(await event_state(repo, clock, i)).status for i in ids} == {"delivered"}


@pytest.mark.anyio
async def test_wake_makes_a_waiting_deliverer_poll_at_once(
    repo: SqlRepository, clock: ManualClock
) -> None:
    poster = ReceivingPoster(receiver(repo, clock))
    # Polls far apart: only wake() can make it deliver within the bound below.
    d = deliverer(repo, clock, poster, poll_min_seconds=60, poll_max_seconds=60)
    async with anyio.create_task_group() as tg:
        await d.start(tg)
        await wait_until("a first round", lambda: d.rounds >= 1, time.monotonic() + 5, describe=str)
        await make_webhook_events(repo, clock.now(), events_per_job=1, requester_id="acme")
        d.wake([uuid.uuid4()])  # as the job lifecycle's on_commit hook calls it
        await wait_until(
            "the woken deliverer to deliver",
            lambda: len(poster.processed) == 1,
            time.monotonic() + 5,
            describe=lambda: f"{len(poster.posts)} posts",
        )
        # A commit notifying the channel (what the job lifecycle's writes do) wakes it too.
        await make_webhook_events(repo, clock.now(), events_per_job=1, requester_id="acme")
        async with repo.transaction() as tx:
            tx.notify(EVENTS_CHANNEL)
        await wait_until(
            "the notified deliverer to deliver",
            lambda: len(poster.processed) == 2,
            time.monotonic() + 5,
            describe=lambda: f"{len(poster.posts)} posts",
        )
        with anyio.fail_after(5):
            await d.stop()
    assert not d.health.running


@pytest.mark.anyio
async def test_httpx_poster_reports_timeouts_and_refusals_as_failed_attempts() -> None:
    from trace_core.euterpe.webhook_poster import HttpxPoster

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def never_answers(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    poster = HttpxPoster(timeout_seconds=0.3, connect_timeout_seconds=0.3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, never_answers)
        with anyio.fail_after(10):
            result = await poster.post(f"http://127.0.0.1:{port}/hook", b"{}", {})
        tg.cancel_scope.cancel()
    assert result == PostResult(None, "timeout (ReadTimeout)") and not result.delivered
    await listener.aclose()
    with anyio.fail_after(10):
        refused = await poster.post(f"http://127.0.0.1:{port}/hook", b"{}", {})
    await poster.aclose()
    assert refused.status is None and refused.error and "ConnectError" in refused.error


@pytest.mark.anyio
async def test_httpx_poster_never_connects_where_the_url_policy_refuses_the_address() -> None:
    from trace_core.euterpe.requests import UrlPolicy
    from trace_core.euterpe.webhook_poster import HttpxPoster

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    connections: list[int] = []

    async def record(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        await stream.aclose()

    url = f"http://127.0.0.1:{port}/hook"
    refusing = HttpxPoster(url_policy=UrlPolicy(allow_loopback=False))
    allowing = HttpxPoster(url_policy=UrlPolicy(allow_loopback=True), timeout_seconds=2.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, record)
        with anyio.fail_after(10):
            refused = await refusing.post(url, b"{}", {})
            reached = await allowing.post(url, b"{}", {})
        tg.cancel_scope.cancel()
    await listener.aclose()
    await refusing.aclose()
    await allowing.aclose()
    assert refused.status is None and not refused.delivered
    assert refused.error is not None and "not allowed" in refused.error
    # The allowed poster did connect (its answer is a dropped connection).
    assert connections == [1] and reached.status is None
