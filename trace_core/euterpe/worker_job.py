"""One claimed inbox job, driven through its stages by a worker (euterpe-contract.md §3-§7, §11).

:meth:`JobRun.execute` takes a lease to its end:

``claimed -> fetching``
    the job's credentials are opened in memory only
    (:func:`~trace_core.euterpe.credentials.open_job_credentials`), the
    source's size is checked against the maximum before anything is
    downloaded, and the download enforces the limit while streaming;
``-> processing``
    the :class:`~trace_core.euterpe.processor.Processor` writes one output per preset;
``-> uploading``
    when the source is over the threshold, each output must be at most
    200 % of it; each is uploaded under the output prefix at a deterministic
    key (``<prefix><preset>.<ext>``), so a retry replaces the same objects;
``-> succeeded``
    with the outputs ``{key (the s3:// URI), preset, size, sha256}``.

Every write is fenced (:class:`~trace_core.euterpe.jobs.InboxJobs`); a
heartbeat runs beside the work. A lost lease (a heartbeat or a write
answering :class:`~trace_core.errors.StaleClaim`) stops the work at once:
the processor's stop signal is set and its call cancelled (ffmpeg is
killed), and nothing more is written. A worker stopping hands the job back
(``queued``, the attempt refunded). Every failure becomes a
:class:`~trace_core.euterpe.events.NormalizedError` and goes through
:meth:`InboxJobs.fail`, which classifies it with ``RetryPolicy.classify``.
On 401/403 from the store the credential refresh of §7 runs in band: count
a refresh, call the ``refresh_url``, re-read the job, and retry the storage
call with the new credentials only if ``credential_version`` advanced;
otherwise the job fails with ``credentials_not_refreshed`` (HTTP 403), which
the lifecycle turns into a backoff within the refresh budget, then
``failed -> dead_letter``. The job's temporary directory is removed in
``finally``, whatever happened.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from trace_core.errors import InvalidInput, StaleClaim, TraceError
from trace_core.euterpe.credentials import (
    CredentialsUnavailable,
    CredentialVault,
    StorageCredentials,
    open_job_credentials,
)
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.jobs import InboxJobs
from trace_core.euterpe.presets import Preset, get_preset
from trace_core.euterpe.processor import ProcessingFailed, Processor, ProducedOutput
from trace_core.euterpe.refresh import CredentialRefresher, CredentialsNotRefreshed
from trace_core.euterpe.storage_access import (
    SourceTooLarge,
    StorageAuthFailed,
    StorageHandle,
    TranscodeStorage,
    TransferFailed,
)
from trace_core.euterpe.worker_config import WorkerConfig
from trace_core.model import Lease
from trace_core.security.scopes import parse_object_uri

__all__ = ["JobOutcome", "JobRun", "WorkerParts"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_MAX_OUTPUT_KEY = 1024  # validate_outputs' bound on an output's key


@dataclass(frozen=True)
class WorkerParts:
    """What every job of a worker is run with."""

    jobs: InboxJobs
    vault: CredentialVault
    storage: TranscodeStorage
    processor: Processor
    config: WorkerConfig
    refresher: CredentialRefresher | None = None
    """Calls ``refresh_url`` on 401/403; None: a refused credential fails at once."""


@dataclass(frozen=True)
class JobOutcome:
    """How one lease ended, from this worker's side."""

    job_id: uuid.UUID
    result: str
    """``succeeded``; ``failed`` (with ``path``, the statuses the job passed);
    ``released`` (handed back: the worker stopped); ``lost`` (the lease was
    taken over: nothing was written after that)."""
    path: tuple[str, ...] = ()
    error: NormalizedError | None = None


class _Failure(TraceError):
    """A job-level failure raised inside the stages, with the requester's error."""

    def __init__(self, error: NormalizedError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


@dataclass(frozen=True)
class _Plan:
    source: str
    output_prefix: str
    presets: list[Preset]
    refresh_url: str | None
    requester_id: str


class JobRun:
    """Runs one lease to its end (see the module docstring)."""

    def __init__(self, parts: WorkerParts, lease: Lease, *, slots: anyio.CapacityLimiter) -> None:
        self.parts = parts
        self.lease = lease
        self.fence = lease.fence
        self.job_id = uuid.UUID(str(lease.item_id))
        self.slots = slots
        self.stop = anyio.Event()
        """Set when the work must end now; the processor watches it."""
        self.lost = False
        self.interrupted = False
        self._work: anyio.CancelScope | None = None
        self._handle: StorageHandle | None = None
        self._version = 0

    def interrupt(self) -> None:
        """The worker is stopping: end the work now and hand the job back."""
        self.interrupted = True
        self._halt()

    def _halt(self) -> None:
        self.stop.set()
        if self._work is not None:
            self._work.cancel()

    async def execute(self) -> JobOutcome:
        """Work the job to its end; the temporary directory is always removed."""
        base = self.parts.config.temp_dir
        work_dir = Path(tempfile.mkdtemp(prefix=f"euterpe-{self.job_id}-", dir=base))
        try:
            outcome: JobOutcome | None = None
            async with anyio.create_task_group() as group:
                group.start_soon(self._heartbeat)
                try:
                    outcome = await self._supervised(work_dir)
                finally:
                    group.cancel_scope.cancel()
            assert outcome is not None  # the group only ends the heartbeat
            return outcome
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_remove_tree, work_dir)

    async def _supervised(self, work_dir: Path) -> JobOutcome:
        error: NormalizedError | None = None
        outputs: list[dict[str, Any]] | None = None
        with anyio.CancelScope() as self._work:
            try:
                async with self.slots:
                    outputs = await self._stages(work_dir)
            except StaleClaim:
                self.lost = True
            except _Failure as exc:
                error = exc.error
            except (TransferFailed, ProcessingFailed) as exc:
                error = exc.error
            except Exception as exc:  # an unexpected crash: retried while attempts remain
                _log.exception("euterpe: job %s crashed in the worker", self.job_id)
                error = NormalizedError(
                    "worker_error", f"the worker failed unexpectedly ({type(exc).__name__})", True
                )
        self._work = None
        if self.lost:
            return JobOutcome(self.job_id, "lost")
        try:
            if self.interrupted:
                await self.parts.jobs.release(self.fence, reason="worker stopping")
                return JobOutcome(self.job_id, "released")
            if error is not None:
                outcome = await self.parts.jobs.fail(self.fence, error)
                _log.info("euterpe: job %s failed (%s): %s", self.job_id, error.code, outcome.path)
                return JobOutcome(self.job_id, "failed", outcome.path, error)
            assert outputs is not None
            await self.parts.jobs.succeed(self.fence, outputs)
        except StaleClaim:
            self.lost = True
            return JobOutcome(self.job_id, "lost")
        return JobOutcome(self.job_id, "succeeded")

    async def _heartbeat(self) -> None:
        """Extend the lease until cancelled; a stale answer stops the work."""
        while True:
            await anyio.sleep(self.parts.config.heartbeat_seconds)
            try:
                await self.parts.jobs.heartbeat(self.fence)
            except StaleClaim:
                _log.warning("euterpe: lease of job %s lost; stopping its work", self.job_id)
                self.lost = True
                self._halt()
                return
            except Exception:
                # The database may be back before the lease ends; if not, the
                # reclaim fences this claim out and the next write says so.
                _log.warning("euterpe: heartbeat of job %s failed", self.job_id, exc_info=True)

    # --- the stages ----------------------------------------------------------

    async def _stages(self, work_dir: Path) -> list[dict[str, Any]]:
        jobs, config = self.parts.jobs, self.parts.config
        plan = _plan(self.lease.data)
        await jobs.advance(self.fence, "fetching")
        await self._open_credentials()
        size = await self._storage(lambda h: h.size(plan.source), plan)
        if size > config.max_source_bytes:
            raise SourceTooLarge(plan.source, size, config.max_source_bytes)
        source = work_dir / "source"
        received = await self._storage(
            lambda h: h.download(plan.source, source, config.max_source_bytes), plan
        )
        await jobs.advance(self.fence, "processing")
        output_dir = work_dir / "outputs"
        output_dir.mkdir()
        produced = await self.parts.processor.process(source, plan.presets, output_dir, self.stop)
        _check_produced(produced, plan.presets, output_dir)
        await jobs.advance(self.fence, "uploading")
        limit = config.output_limit(received)
        for out in produced:
            if limit is not None and out.size > limit:
                raise _Failure(
                    NormalizedError(
                        "output_too_large",
                        f"output {out.preset} is {out.size} bytes, over "
                        f"{config.max_output_ratio:g} times the source ({received} bytes)",
                        False,
                    )
                )
        outputs = []
        for out in produced:
            uri = plan.output_prefix + out.path.name
            await self._storage(_uploader(out.path, uri), plan)
            outputs.append(
                {"key": uri, "preset": out.preset, "size": out.size, "sha256": out.sha256}
            )
        return outputs

    async def _open_credentials(self) -> StorageCredentials:
        try:
            version, credentials = await open_job_credentials(
                self.parts.jobs.repo, self.parts.vault, self.job_id
            )
        except CredentialsUnavailable as exc:
            raise _Failure(NormalizedError("credentials_unavailable", str(exc), False)) from None
        self._version = version
        self._handle = self.parts.storage.open(credentials)
        return credentials

    async def _storage(self, call: Callable[[StorageHandle], Awaitable[_T]], plan: _Plan) -> _T:
        """``call`` on the current handle; on 401/403 the refresh of §7, then
        ``call`` again with the newer credentials, within the refresh budget."""
        while True:
            assert self._handle is not None
            try:
                return await call(self._handle)
            except StorageAuthFailed as exc:
                await self._refresh(plan, exc)

    async def _refresh(self, plan: _Plan, refused: StorageAuthFailed) -> None:
        """Get credentials newer than the current ones, or raise
        :class:`CredentialsNotRefreshed`."""
        refresher = self.parts.refresher
        if plan.refresh_url is None or refresher is None:
            raise CredentialsNotRefreshed(
                f"the object store refused the credentials ({refused.error.message}) "
                "and the job has no refresh_url"
            )
        allowance = await self.parts.jobs.record_credential_refresh(self.fence)
        if not allowance.allowed:
            raise CredentialsNotRefreshed(
                f"the object store refused the credentials; the refresh budget "
                f"({allowance.budget}) is spent"
            )
        held = self._version
        answer = await refresher.request(
            plan.refresh_url,
            requester_id=plan.requester_id,
            job_id=self.job_id,
            credential_version=held,
        )
        await self._open_credentials()
        if self._version <= held:
            raise CredentialsNotRefreshed(
                f"the object store refused the credentials and credential_version did "
                f"not advance past {held} (refresh_url {answer.detail})"
            )
        _log.info(
            "euterpe: job %s continues with credential version %d", self.job_id, self._version
        )


def _plan(data: Mapping[str, Any]) -> _Plan:
    """What the job asks for, from the claimed row; a stored request that
    does not read (written by hand, an older format) fails the job for good."""
    try:
        request = data["request"]
        source = str(request["source"])
        prefix = str(request["output_prefix"])
        parse_object_uri(source, field="source")
        parse_object_uri(prefix, field="output_prefix", allow_empty=True)
        names = request["presets"]
        presets = [get_preset(name, f"presets[{i}]") for i, name in enumerate(names)]
        if not presets or not prefix.endswith("/"):
            raise InvalidInput("request", "needs presets and an output prefix ending in /")
        longest = max(len(prefix + f"{p.name}.{p.extension}") for p in presets)
        if longest > _MAX_OUTPUT_KEY:
            raise InvalidInput("output_prefix", "too long for the output keys")
        refresh = request.get("refresh_url")
        return _Plan(source, prefix, presets, refresh, str(data["requester_id"]))
    except InvalidInput as exc:
        raise _Failure(NormalizedError("invalid_request", str(exc), False)) from None
    except (KeyError, TypeError, ValueError):
        raise _Failure(
            NormalizedError("invalid_request", "the stored request cannot be read", False)
        ) from None


def _check_produced(
    produced: Sequence[ProducedOutput], presets: Sequence[Preset], output_dir: Path
) -> None:
    """A processor returns exactly one output per preset, inside ``output_dir``."""
    wanted = sorted(p.name for p in presets)
    if sorted(o.preset for o in produced) != wanted or any(
        o.path.parent != output_dir or not o.path.is_file() for o in produced
    ):
        raise _Failure(
            NormalizedError(
                "transcode_failed", "the processor did not produce one output per preset", True
            )
        )


def _uploader(path: Path, uri: str) -> Callable[[StorageHandle], Awaitable[None]]:
    return lambda handle: handle.upload(path, uri)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
