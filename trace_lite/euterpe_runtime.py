"""The lite profile's Euterpe, put together: what ``trace-lite euterpe …`` runs.

Everything lives under the data directory, beside the control plane's files:

=============================  ===============================================
``keks/<kek_id>.key``          the key-encryption keys of stored credentials
                               (:mod:`trace_lite.kek_ring`)
``euterpe-webhook.key``        the master webhook secret; each requester's
                               secret is derived from it
                               (:class:`~trace_core.security.webhook_signing.WebhookSigner`)
``credentials.key``            the local credential minter's key (shared with
                               ``trace-lite serve``): storage credentials of
                               the local object store are minted with it
``objects/``                   the local object store (sources and outputs)
=============================  ===============================================

Key files are read before the event loop starts (:meth:`EuterpeOptions.vault`,
:func:`load_webhook_signer`, :func:`object_storage`); inside it,
:func:`build_server` makes the API, the webhook deliverer (woken by the
lifecycle's commits), the maintenance loop and optionally an in-process
worker, and :func:`build_worker` what a worker process runs. The worker's
refresh calls (§7) are signed like webhooks, with the requester's derived
secret (:func:`signed_refresh`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from fastapi import FastAPI

from trace_core.api.transcode import TranscodeApi, create_transcode_app
from trace_core.api.transcode_serving import BesideService
from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError
from trace_core.euterpe.api_keys import ApiKeys
from trace_core.euterpe.copy_processor import CopyProcessor
from trace_core.euterpe.credentials import CredentialVault
from trace_core.euterpe.deliverer import WebhookDeliverer
from trace_core.euterpe.intake import Intake
from trace_core.euterpe.job_maintenance import InboxMaintenance
from trace_core.euterpe.jobs import InboxJobs, JobsConfig
from trace_core.euterpe.processor import Processor
from trace_core.euterpe.pruner import EuterpeMaintenance, MaintenanceConfig
from trace_core.euterpe.refresh import CredentialRefresher, RefreshSigner
from trace_core.euterpe.requests import UrlPolicy
from trace_core.euterpe.storage_access import TranscodeStorage
from trace_core.euterpe.webhook_poster import HttpxPoster, WebhookPoster
from trace_core.euterpe.worker import EuterpeWorker
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.euterpe.worker_job import WorkerParts
from trace_core.idempotency import IdempotencyStore
from trace_core.security.minting import LocalCredentialMinter
from trace_core.security.webhook_signing import MasterSecret, WebhookSigner
from trace_core.storage.protocol import Repository
from trace_lite.euterpe_storage import LiteTranscodeStorage
from trace_lite.kek_ring import DEFAULT_KEK_ID, load_credential_vault
from trace_lite.object_store import LocalObjectStore
from trace_lite.secret_files import read_or_create_secret
from trace_lite.serve import read_minter_key

__all__ = [
    "PROCESSORS",
    "WEBHOOK_KEY_FILE",
    "EuterpeOptions",
    "EuterpeServer",
    "build_server",
    "build_worker",
    "load_webhook_signer",
    "make_processor",
    "object_storage",
    "refresher",
    "signed_refresh",
]

WEBHOOK_KEY_FILE = "euterpe-webhook.key"
MASTER_VERSION = "1"
PROCESSORS = ("ffmpeg", "copy")
"""``ffmpeg`` transcodes for real; ``copy`` copies the source per preset (demos, tests)."""


@dataclass(frozen=True)
class EuterpeOptions:
    """What the ``euterpe`` commands were asked for (validated by their parsers)."""

    database_url: str
    data_dir: Path
    active_kek: str = DEFAULT_KEK_ID
    accepted_keks: tuple[str, ...] = ()
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)
    """Which hosts webhook and refresh URLs may name."""
    retention: timedelta = timedelta(days=30)
    max_attempts: int = 5
    processor: str = "ffmpeg"
    workers: int = 0
    """Jobs run at once by in-process workers (``serve``; 0: none)."""
    concurrency: int = 2
    """Jobs run at once by a worker process (``worker``)."""
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"

    def vault(self) -> CredentialVault:
        """The key ring of ``keks/`` (the active KEK created on first use)."""
        return load_credential_vault(
            self.data_dir, active=self.active_kek, accepted=self.accepted_keks
        )

    def worker_config(self, concurrency: int) -> WorkerConfig:
        """The worker settings, ``concurrency`` jobs at once."""
        return WorkerConfig(concurrency=concurrency, batch_size=min(concurrency, 25))


def load_webhook_signer(data_dir: Path) -> WebhookSigner:
    """The signer over ``<data_dir>/euterpe-webhook.key`` (created, owner-only, on first use)."""
    secret = read_or_create_secret(data_dir / WEBHOOK_KEY_FILE, "Euterpe webhook master secret")
    return WebhookSigner([MasterSecret(MASTER_VERSION, secret)])


def signed_refresh(signer: WebhookSigner, clock: Clock | None = None) -> RefreshSigner:
    """``sign(requester_id, body) -> headers`` for the worker's refresh calls:
    the four ``x-euterpe-*`` headers of a webhook, under the requester's
    derived secret, so a requester checks both with the same code and secret.
    A refresh call is not an event; its ``x-euterpe-event-id`` is a fresh id
    per call (the signed body names the job and version)."""
    now = clock or SystemClock()

    def sign(requester_id: str, body: bytes) -> Mapping[str, str]:
        return signer.headers(
            requester_id, uuid.uuid4(), body, timestamp=int(now.now().timestamp())
        )

    return sign


def object_storage(data_dir: Path, clock: Clock | None = None) -> LiteTranscodeStorage:
    """The local object store of ``<data_dir>/objects``, checked with the
    credential minter of ``<data_dir>/credentials.key``."""
    minter = LocalCredentialMinter(read_minter_key(data_dir), clock=clock or SystemClock())
    return LiteTranscodeStorage(LocalObjectStore(data_dir / "objects", minter))


def make_processor(name: str) -> Processor:
    """The processor called ``name`` (:data:`PROCESSORS`)."""
    if name == "copy":
        return CopyProcessor()
    if name == "ffmpeg":
        from trace_lite.euterpe_ffmpeg import FfmpegProcessor

        return FfmpegProcessor()
    raise ConfigurationError(f"--processor must be one of {', '.join(PROCESSORS)}, got {name!r}")


def refresher(options: EuterpeOptions, signer: WebhookSigner, clock: Clock) -> CredentialRefresher:
    """The worker's refresh caller, signing with ``signer`` and checking
    resolved addresses against the same URL policy as the intake."""
    return CredentialRefresher(signed_refresh(signer, clock), url_policy=options.url_policy)


@dataclass
class EuterpeServer:
    """What ``euterpe serve`` runs, built in the event loop by :func:`build_server`."""

    app: FastAPI
    jobs: InboxJobs
    intake: Intake
    deliverer: WebhookDeliverer
    maintenance: EuterpeMaintenance
    workers: list[EuterpeWorker]

    @property
    def services(self) -> list[BesideService]:
        """Started before the server, stopped after it (workers last started, first stopped)."""
        return [self.deliverer, self.maintenance, *self.workers]


def build_server(
    options: EuterpeOptions,
    repo: Repository,
    *,
    vault: CredentialVault,
    signer: WebhookSigner,
    storage: TranscodeStorage | None = None,
    processor: Processor | None = None,
    clock: Clock | None = None,
    poster: WebhookPoster | None = None,
) -> EuterpeServer:
    """The API, the deliverer (woken by every local commit that wrote events),
    the maintenance loop and, when ``options.workers``, an in-process worker
    running that many jobs at once (``storage`` and ``processor`` then
    required). Call inside the event loop."""
    clock = clock or SystemClock()
    jobs = InboxJobs(repo, clock=clock, config=JobsConfig(max_attempts=options.max_attempts))
    idempotency = IdempotencyStore(repo, clock=clock)
    intake = Intake(
        repo,
        keys=ApiKeys(repo, clock=clock),
        vault=vault,
        enqueuer=jobs,
        idempotency=idempotency,
        url_policy=options.url_policy,
        max_attempts=options.max_attempts,
        clock=clock,
    )
    deliverer = WebhookDeliverer(
        repo, signer, poster or HttpxPoster(url_policy=options.url_policy), clock=clock
    )
    jobs.on_commit = deliverer.wake
    maintenance = EuterpeMaintenance(
        InboxMaintenance(jobs),
        config=MaintenanceConfig(retention=options.retention),
        idempotency=idempotency,
    )
    workers: list[EuterpeWorker] = []
    if options.workers:
        if storage is None or processor is None:
            raise ConfigurationError("in-process workers need an object storage and a processor")
        parts = WorkerParts(
            jobs,
            vault,
            storage,
            processor,
            options.worker_config(options.workers),
            refresher=refresher(options, signer, clock),
        )
        workers.append(EuterpeWorker(parts))
    app = create_transcode_app(TranscodeApi(intake, jobs, vault))
    return EuterpeServer(app, jobs, intake, deliverer, maintenance, workers)


def build_worker(
    options: EuterpeOptions,
    repo: Repository,
    *,
    vault: CredentialVault,
    signer: WebhookSigner,
    storage: TranscodeStorage,
    processor: Processor,
    clock: Clock | None = None,
    worker_id: str | None = None,
) -> EuterpeWorker:
    """A worker process's :class:`EuterpeWorker` (``options.concurrency`` jobs at once)."""
    clock = clock or SystemClock()
    jobs = InboxJobs(repo, clock=clock, config=JobsConfig(max_attempts=options.max_attempts))
    parts = WorkerParts(
        jobs,
        vault,
        storage,
        processor,
        options.worker_config(options.concurrency),
        refresher=refresher(options, signer, clock),
    )
    return EuterpeWorker(parts, worker_id=worker_id)
