"""A job's storage credentials, sealed at rest (euterpe-contract.md §7, §10).

:class:`StorageCredentials` is the one neutral shape of what a requester
hands Euterpe to reach its object store: an access key id, a secret, an
optional session token and an optional expiry, the wire form
(``access_key_id``, ``secret_access_key``, ``session_token``, ``expiration``)
that both the lite object store (``LocalObjectStore.handle_for``) and S3
(``S3ObjectStore.handle_for``, STS credentials) take. Its ``repr()`` and
``str()`` never show the secret or the token.

:class:`CredentialVault` seals them with envelope encryption over a key ring
``{kek_id: KeyEncryption}`` (local KEK files in the lite profile, KMS keys in
the aws one): a fresh data key per blob, wrapped by the *active* KEK. The
associated data is the canonical JSON of ``{v, alg, kek_id, job_id,
requester_id, credential_version}``, so a blob copied to another job, another
requester or another credential version (or relabelled with another kek id)
does not open. Opening accepts the active KEK and the older ids of the
compatibility window; a blob under any other id is refused with
:class:`RetiredKek` naming it. :func:`rewrap_credentials` moves every blob
sealed under the window's older ids to the active KEK, batch by batch,
without holding a transaction while it seals, and with a guarded write that
loses to a concurrent credential refresh (:func:`refresh_credentials`), so
the newest credentials always survive.

Plaintext credentials exist only in memory: in the intake request while it
is sealed, and in the worker at execution time.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import anyio.to_thread

from trace_core.clock import Clock, SystemClock
from trace_core.errors import ConfigurationError, InvalidInput, NotFound, TraceError
from trace_core.security.envelope import Envelope, KeyEncryption
from trace_core.storage.ports.inbox_credentials import JobCredentials, SealedCredentials
from trace_core.storage.protocol import Repository

__all__ = [
    "ENCRYPTION_VERSION",
    "INITIAL_CREDENTIAL_VERSION",
    "CredentialVault",
    "CredentialVersionConflict",
    "CredentialsUnavailable",
    "RetiredKek",
    "RewrapReport",
    "SealedCredentials",
    "StorageCredentials",
    "check_kek_id",
    "open_job_credentials",
    "refresh_credentials",
    "rewrap_credentials",
]

_log = logging.getLogger(__name__)

ENCRYPTION_VERSION = 1
"""The sealing format written today: AES-256-GCM data key and value, the v1 AAD."""
INITIAL_CREDENTIAL_VERSION = 0
"""``inbox_jobs.credential_version`` of a new job; each refresh adds one."""
_ALGORITHM = "AES-256-GCM"
_KEK_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)


class CredentialsUnavailable(TraceError):
    """A job's sealed credentials do not open: tampered with, copied from
    another job, requester or credential version, or sealed under a key this
    ring does not hold."""


class RetiredKek(CredentialsUnavailable):
    """Sealed under a kek id outside the ring's compatibility window."""

    def __init__(self, kek_id: str, active: str, accepted: Collection[str]) -> None:
        window = ", ".join(sorted(accepted)) or "none"
        super().__init__(
            f"credentials sealed under kek_id {kek_id!r}, which is retired here "
            f"(active {active!r}, older ids accepted: {window}); put it back in the "
            "window and re-wrap"
        )
        self.kek_id = kek_id


class CredentialVersionConflict(TraceError):
    """A refresh named a credential version that is no longer the job's (an HTTP 409)."""


def check_kek_id(kek_id: object, field: str = "kek_id") -> str:
    """``kek_id`` if it is 1-64 letters, digits or ``._-`` starting with a
    letter or digit (a file name in the lite profile); InvalidInput otherwise."""
    if not isinstance(kek_id, str) or not _KEK_ID_RE.fullmatch(kek_id):
        raise InvalidInput(
            field, "must be 1-64 letters, digits or ._- starting with one of the first two"
        )
    return kek_id


@dataclass(frozen=True, repr=False)
class StorageCredentials:
    """Scoped object-store credentials of a job (see the module docstring)."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None
    expiration: datetime | None = None

    def __repr__(self) -> str:
        # The access key id is an identifier (it shows in audit logs), not a secret.
        expiry = self.expiration.isoformat() if self.expiration else None
        token = "'<redacted>'" if self.session_token else None
        return (
            f"StorageCredentials(access_key_id={self.access_key_id!r}, "
            f"secret_access_key='<redacted>', session_token={token}, expiration={expiry!r})"
        )

    __str__ = __repr__

    def as_wire(self) -> dict[str, str]:
        """The wire form the object stores' ``handle_for`` take."""
        wire = {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        if self.session_token is not None:
            wire["session_token"] = self.session_token
        if self.expiration is not None:
            wire["expiration"] = self.expiration.isoformat()
        return wire

    def to_bytes(self) -> bytes:
        """The plaintext that is sealed: canonical JSON of :meth:`as_wire`."""
        return json.dumps(self.as_wire(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StorageCredentials:
        """The inverse of :meth:`to_bytes` (of an authenticated plaintext)."""
        wire = json.loads(data)
        expiration = wire.get("expiration")
        return cls(
            str(wire["access_key_id"]),
            str(wire["secret_access_key"]),
            wire.get("session_token"),
            datetime.fromisoformat(expiration) if expiration else None,
        )


def _context(*, kek_id: str, job_id: uuid.UUID, requester_id: str, credential_version: int) -> str:
    """The associated data of one blob (SECURITY-NOTES "Envelope encryption")."""
    return json.dumps(
        {
            "v": ENCRYPTION_VERSION,
            "alg": _ALGORITHM,
            "kek_id": kek_id,
            "job_id": str(job_id),
            "requester_id": requester_id,
            "credential_version": credential_version,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


class CredentialVault:
    """Seals, opens and re-wraps credentials over a key ring (module docstring).

    ``ring`` maps kek ids to their :class:`KeyEncryption`; ``active`` seals
    every new blob; ``accepted`` are the older ids still opened (the
    compatibility window). Ids in the ring but outside the window are retired.
    ``seal``/``open``/``rewrap`` may block (KMS); async code uses the
    ``a``-prefixed twins, which run them off the event loop.
    """

    def __init__(
        self, ring: Mapping[str, KeyEncryption], *, active: str, accepted: Iterable[str] = ()
    ) -> None:
        check_kek_id(active, "active kek_id")
        window = {active, *accepted}
        for kek_id in sorted(window):
            check_kek_id(kek_id, "accepted kek_id")
            if kek_id not in ring:
                raise ConfigurationError(
                    f"kek_id {kek_id!r} is in the window but not in the key ring"
                )
        self._ring = dict(ring)
        self.active = active
        self.accepted = frozenset(window - {active})
        """The older kek ids still opened (not the active one)."""

    def __repr__(self) -> str:
        return f"CredentialVault(active={self.active!r}, accepted={sorted(self.accepted)!r})"

    def require_accepted(self, kek_id: str) -> None:
        """Nothing if ``kek_id`` is active or in the window; :class:`RetiredKek` otherwise."""
        if kek_id != self.active and kek_id not in self.accepted:
            raise RetiredKek(kek_id, self.active, self.accepted)

    def _key(self, kek_id: str) -> KeyEncryption:
        self.require_accepted(kek_id)
        return self._ring[kek_id]

    def seal(
        self,
        credentials: StorageCredentials,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        credential_version: int,
    ) -> SealedCredentials:
        """``credentials`` sealed under the active KEK for exactly this job,
        requester and credential version."""
        context = _context(
            kek_id=self.active,
            job_id=job_id,
            requester_id=requester_id,
            credential_version=credential_version,
        )
        envelope = self._ring[self.active].seal(credentials.to_bytes(), context)
        return SealedCredentials(
            envelope.ciphertext, envelope.wrapped_key, self.active, ENCRYPTION_VERSION
        )

    def open(
        self,
        sealed: SealedCredentials,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        credential_version: int,
    ) -> StorageCredentials:
        """The credentials of ``sealed``; :class:`RetiredKek` for a kek id
        outside the window, :class:`CredentialsUnavailable` when they do not
        open for this job, requester and version."""
        if sealed.encryption_version != ENCRYPTION_VERSION:
            raise CredentialsUnavailable(
                f"credentials of job {job_id} use encryption version "
                f"{sealed.encryption_version}, this build reads {ENCRYPTION_VERSION}"
            )
        key = self._key(sealed.kek_id)
        context = _context(
            kek_id=sealed.kek_id,
            job_id=job_id,
            requester_id=requester_id,
            credential_version=credential_version,
        )
        try:
            plaintext = key.open(Envelope(sealed.dek_wrapped, sealed.encrypted), context)
        except InvalidInput:
            raise CredentialsUnavailable(
                f"credentials of job {job_id} do not open (kek_id {sealed.kek_id!r}): tampered "
                "with, or sealed for another job, requester or credential version"
            ) from None
        return StorageCredentials.from_bytes(plaintext)

    def rewrap(
        self,
        sealed: SealedCredentials,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        credential_version: int,
    ) -> SealedCredentials:
        """``sealed`` moved to the active KEK (returned as is when it already is)."""
        if sealed.kek_id == self.active and sealed.encryption_version == ENCRYPTION_VERSION:
            return sealed
        opened = self.open(
            sealed, job_id=job_id, requester_id=requester_id, credential_version=credential_version
        )
        return self.seal(
            opened, job_id=job_id, requester_id=requester_id, credential_version=credential_version
        )

    async def aseal(
        self,
        credentials: StorageCredentials,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        credential_version: int,
    ) -> SealedCredentials:
        """:meth:`seal` off the event loop."""
        return await anyio.to_thread.run_sync(
            lambda: self.seal(
                credentials,
                job_id=job_id,
                requester_id=requester_id,
                credential_version=credential_version,
            )
        )

    async def aopen(
        self,
        sealed: SealedCredentials,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        credential_version: int,
    ) -> StorageCredentials:
        """:meth:`open` off the event loop."""
        return await anyio.to_thread.run_sync(
            lambda: self.open(
                sealed,
                job_id=job_id,
                requester_id=requester_id,
                credential_version=credential_version,
            )
        )

    async def arewrap(
        self,
        sealed: SealedCredentials,
        *,
        job_id: uuid.UUID,
        requester_id: str,
        credential_version: int,
    ) -> SealedCredentials:
        """:meth:`rewrap` off the event loop."""
        return await anyio.to_thread.run_sync(
            lambda: self.rewrap(
                sealed,
                job_id=job_id,
                requester_id=requester_id,
                credential_version=credential_version,
            )
        )


async def open_job_credentials(
    repo: Repository, vault: CredentialVault, job_id: uuid.UUID
) -> tuple[int, StorageCredentials]:
    """The worker's read at execution time: the job's credential version and
    its opened credentials (in memory only). :class:`NotFound` for an unknown
    job, :class:`CredentialsUnavailable` when it has none or they do not open."""
    async with repo.read() as tx:
        stored = await tx.inbox_credentials.read(job_id)
    if stored is None:
        raise NotFound(f"inbox job {job_id} not found")
    if stored.sealed is None:
        raise CredentialsUnavailable(f"inbox job {job_id} has no stored credentials")
    opened = await vault.aopen(
        stored.sealed,
        job_id=job_id,
        requester_id=stored.requester_id,
        credential_version=stored.credential_version,
    )
    return stored.credential_version, opened


async def refresh_credentials(
    repo: Repository,
    vault: CredentialVault,
    *,
    job_id: uuid.UUID,
    requester_id: str,
    expected_version: int,
    credentials: StorageCredentials,
    clock: Clock | None = None,
) -> int:
    """The requester's credential refresh (§7 step 2): seal ``credentials``
    for ``expected_version + 1`` under the active KEK and store them if the
    job is still at ``expected_version``; the new version.

    :class:`NotFound` for an unknown job or another requester's (the same
    answer, so a job id tells nothing about other requesters);
    :class:`CredentialVersionConflict` if the version moved meanwhile.
    """
    new_version = expected_version + 1
    sealed = await vault.aseal(
        credentials, job_id=job_id, requester_id=requester_id, credential_version=new_version
    )
    now = (clock or SystemClock()).now()
    async with repo.transaction() as tx:
        replaced = await tx.inbox_credentials.replace_if_version(
            job_id,
            requester_id=requester_id,
            expected_version=expected_version,
            sealed=sealed,
            now=now,
        )
        if not replaced:
            current = await tx.inbox_credentials.read(job_id)
    if replaced:
        _log.info("refreshed credentials of inbox job %s to version %d", job_id, new_version)
        return new_version
    if current is None or current.requester_id != requester_id:
        raise NotFound(f"inbox job {job_id} not found")
    raise CredentialVersionConflict(
        f"inbox job {job_id} is at credential version {current.credential_version}, "
        f"not {expected_version}"
    )


@dataclass
class RewrapReport:
    """What one :func:`rewrap_credentials` run did (job ids, never secrets)."""

    rewrapped: int = 0
    """Blobs moved to the active KEK."""
    superseded: int = 0
    """Blobs changed meanwhile (a refresh or another re-wrap got there first)."""
    unopenable: list[uuid.UUID] = field(default_factory=list)
    """Jobs whose blob does not open (tampered or mis-bound): left as they are."""
    remaining: dict[str, bool] = field(default_factory=dict)
    """Per retired kek id: whether any blob is still sealed under it."""


async def rewrap_credentials(
    repo: Repository,
    vault: CredentialVault,
    *,
    kek_ids: Iterable[str] | None = None,
    batch_size: int = 100,
    clock: Clock | None = None,
) -> RewrapReport:
    """KEK rotation: re-wrap every blob sealed under ``kek_ids`` (default: the
    window's older ids) under the active KEK.

    Batches of ``batch_size`` jobs: each batch is read, re-sealed outside any
    transaction (KMS round trips never hold a row or the SQLite writer), then
    written in one transaction with
    :meth:`~trace_core.storage.ports.inbox_credentials.InboxCredentialOps.rewrap_if_unchanged`,
    so a refresh that happened in between wins. Running it again does
    nothing new (idempotent). A kek id outside the window is refused up front
    with :class:`RetiredKek`.
    """
    if not 1 <= batch_size <= 10_000:
        raise InvalidInput("batch_size", "must be 1..10000")
    clock = clock or SystemClock()
    targets = sorted(vault.accepted if kek_ids is None else set(kek_ids) - {vault.active})
    for kek_id in targets:
        vault.require_accepted(kek_id)  # refuse a retired id before any work
    report = RewrapReport()
    for kek_id in targets:
        after: uuid.UUID | None = None
        while True:
            async with repo.read() as tx:
                batch = await tx.inbox_credentials.sealed_under(
                    kek_id, limit=batch_size, after=after
                )
            if not batch:
                break
            after = batch[-1].job_id
            moved = [m for m in [await _rewrap_one(vault, job, report) for job in batch] if m]
            if moved:
                async with repo.transaction() as tx:
                    for job, sealed in moved:
                        wrote = await tx.inbox_credentials.rewrap_if_unchanged(
                            job.job_id,
                            credential_version=job.credential_version,
                            kek_id=kek_id,
                            sealed=sealed,
                            now=clock.now(),
                        )
                        if wrote:
                            report.rewrapped += 1
                        else:
                            report.superseded += 1
            if len(batch) < batch_size:
                break
        async with repo.read() as tx:
            report.remaining[kek_id] = bool(
                await tx.inbox_credentials.sealed_under(kek_id, limit=1)
            )
    _log.info(
        "credential re-wrap to kek_id %s: %d re-wrapped, %d superseded, %d unopenable",
        vault.active,
        report.rewrapped,
        report.superseded,
        len(report.unopenable),
    )
    return report


async def _rewrap_one(
    vault: CredentialVault, job: JobCredentials, report: RewrapReport
) -> tuple[JobCredentials, SealedCredentials] | None:
    if job.sealed is None:
        return None
    try:
        sealed = await vault.arewrap(
            job.sealed,
            job_id=job.job_id,
            requester_id=job.requester_id,
            credential_version=job.credential_version,
        )
    except CredentialsUnavailable:
        report.unopenable.append(job.job_id)
        return None
    return job, sealed
