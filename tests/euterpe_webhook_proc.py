"""A webhook deliverer run as an OS process by ``tests/test_euterpe_webhooks_processes.py``.

Importable (the ``multiprocessing`` spawn context pickles the entry point by
name). It runs the real :class:`~trace_core.euterpe.deliverer.WebhookDeliverer`
on its own repository, posting over real HTTP (``HttpxPoster``) with a short
lease, until the parent sets ``stop`` (or SIGKILLs it). A crash is written to
the report file, so the parent can show it.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass
from typing import Any

import anyio

from trace_core.euterpe.deliverer import WebhookDeliverer
from trace_core.euterpe.deliverer_config import DelivererConfig, webhook_retry_policy
from trace_core.euterpe.webhook_poster import HttpxPoster
from trace_core.retry import Backoff
from trace_core.security.webhook_signing import MasterSecret, WebhookSigner
from trace_core.storage.sql import SqlRepository

__all__ = ["MASTER", "DelivererProc", "run_deliverer"]

MASTER = MasterSecret("test-1", b"process-test-master-secret-0123456789")


@dataclass(frozen=True)
class DelivererProc:
    """What one deliverer process needs."""

    url: str
    name: str
    report_path: str
    seed: int
    lease_seconds: float = 1.5


def run_deliverer(config: DelivererProc, stop: Any) -> None:
    """The process's entry point: deliver until ``stop`` is set."""
    try:
        anyio.run(_deliver, config, stop)
    except BaseException:
        with open(config.report_path, "a") as f:
            f.write(f"CRASH {config.name}\n{traceback.format_exc()}\n")
        raise


async def _deliver(config: DelivererProc, stop: Any) -> None:
    repo = SqlRepository(config.url)
    poster = HttpxPoster(timeout_seconds=5.0, connect_timeout_seconds=2.0)
    deliverer = WebhookDeliverer(
        repo,
        WebhookSigner([MASTER]),
        poster,
        config=DelivererConfig(
            batch_size=5,
            concurrency=3,
            poll_min_seconds=0.05,
            poll_max_seconds=0.15,
            lease_seconds=config.lease_seconds,
            heartbeat_seconds=config.lease_seconds / 3,
        ),
        retry=webhook_retry_policy(normal=Backoff(base_seconds=0.05, cap_seconds=0.3)),
        worker_id=config.name,
        rng=random.Random(config.seed),
    )
    try:
        async with anyio.create_task_group() as tg:
            await deliverer.start(tg)
            # Polled, never waited on: a process SIGKILLed inside Event.wait()
            # would leave the parent's Event.set() waiting for it forever.
            while not stop.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.05)
            await deliverer.stop()
    finally:
        await deliverer.aclose()
        await repo.close()
