"""The chain pipeline's operators on the AWS profile (``./dev run --aws``).

The operators of :mod:`trace_lite.pipeline.operators` run unchanged: they
ask their store for a handle on the attempt's credentials and, as Spark and
pyarrow do their own file I/O, for ``local_path(uri, "read" | "write")``.
:class:`S3FileStore` gives them that on S3 (:mod:`trace_aws.s3`):

- a ``read`` path is the object downloaded into the attempt's scratch
  directory (:meth:`~trace_aws.s3.S3ScopedStore.get_file`);
- a ``write`` path is a file in that directory, uploaded with one
  :meth:`~trace_aws.s3.S3ScopedStore.put_file` under its deterministic key
  before the attempt announces it: before each ``ctx.emit_blocking`` and
  before the operator's result (with its events) goes back to the wrapper.
  This is the S3 counterpart of the lite commit's rename, so a reader never
  sees a half-written object and a retry replaces the same object. An
  attempt that fails uploads nothing.

Records of buffered outputs go to ``POST /v1/task/buffer-publish`` with the
attempt's capability token (:class:`HttpDatasetBuffer`); the API hands them
to the SQS dataset buffer. The pipeline's own ``operator_state`` (the
follower's position, the aggregator's ranges) goes to ``/v1/task/state``
with the same token (:class:`~trace_core.worker.http_state.HttpOperatorState`),
so the rehearsal's workers are database-free: they hold no database URL.

``OPERATORS`` (for ``--operators trace_aws.rehearsal_operators:OPERATORS``)
is built on first access from the environment: ``TRACE_AWS_REGION``,
``TRACE_AWS_ENDPOINT_URL``, ``TRACE_API_URL``,
``TRACE_REHEARSAL_WORK_DIR`` (scratch, default the temp dir) and
``TRACE_REHEARSAL_SPARK_MEMORY`` (the driver's heap, default ``1g``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from trace_aws.s3 import S3ObjectStore, S3ScopedStore
from trace_core.authoring.context import OperatorError, OperatorResult, TaskContext
from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.authoring.operators import OperatorRegistry, OperatorSpec
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.minting import StoreAction
from trace_core.worker.http_credentials import CAPABILITY_HEADER

__all__ = [
    "HttpDatasetBuffer",
    "RehearsalRuntime",
    "S3FileHandle",
    "S3FileStore",
    "committing_operator",
    "rehearsal_operators",
]

_BUFFER_PATH = "/v1/task/buffer-publish"


class _Attempt:
    """The running attempt of one operator thread: its scratch directory and
    the files it wrote that are not uploaded yet."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.pending: dict[str, tuple[S3ScopedStore, Path]] = {}

    def commit(self) -> None:
        """Upload every written file under its key (one request each)."""
        for uri, (handle, path) in list(self.pending.items()):
            if not path.is_file():
                raise OperatorError(f"{uri}: the operator wrote no file", retryable=False)
            handle.put_file(uri, path)
            del self.pending[uri]
            path.unlink()  # committed: a long-running source's scratch stays small


_local = threading.local()
_running: dict[uuid.UUID, TaskContext] = {}
"""The contexts of the attempts running in this process, by task id (the
buffer finds the producer's capability token here)."""


def _attempt() -> _Attempt:
    attempt = getattr(_local, "attempt", None)
    if attempt is None:
        raise OperatorError("the S3 file store is used outside a rehearsal operator")
    return cast(_Attempt, attempt)


class S3FileHandle:
    """A task's S3 handle with local files for tools that do their own I/O."""

    def __init__(self, handle: S3ScopedStore, attempt: _Attempt) -> None:
        self._handle = handle
        self._attempt = attempt

    def get(self, uri: str) -> bytes:
        """The object at ``uri`` (see :meth:`S3ScopedStore.get`)."""
        return self._handle.get(uri)

    def put(self, uri: str, data: bytes) -> None:
        """Write the object at ``uri`` in one commit (see :meth:`S3ScopedStore.put`)."""
        self._handle.put(uri, data)

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (see :meth:`S3ScopedStore.list`)."""
        return self._handle.list(prefix)

    def local_path(self, uri: str, action: StoreAction) -> Path:
        """A local file for ``uri``: the downloaded object (``read``), or where
        to write it (``write``; uploaded before the attempt announces it)."""
        digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
        name = uri.rsplit("/", 1)[-1] or "object"
        if action == "read":
            path = self._attempt.scratch / "in" / digest / name
            if not path.is_file():
                self._handle.get_file(uri, path)
            return path
        if action == "write":
            path = self._attempt.scratch / "out" / digest / name
            path.parent.mkdir(parents=True, exist_ok=True)
            self._attempt.pending[uri] = (self._handle, path)
            return path
        raise InvalidInput("action", f"must be read or write, not {action!r}")


class S3FileStore:
    """What the pipeline operators take as their store, on S3."""

    def __init__(self, store: S3ObjectStore) -> None:
        self._store = store

    def handle_for(self, values: Mapping[str, str]) -> S3FileHandle:
        """A handle on the attempt's credentials (wire form, e.g. from STS)."""
        return S3FileHandle(self._store.handle_for(values), _attempt())


class HttpDatasetBuffer:
    """A :class:`~trace_core.dispatcher.buffer.DatasetBuffer` over
    ``POST /v1/task/buffer-publish``, authorized by the producing attempt's
    capability token (of a task running in this process)."""

    def __init__(self, api_url: str, *, timeout_seconds: float = 30.0) -> None:
        self.api_url = api_url.rstrip("/")
        self._timeout = timeout_seconds

    async def publish(
        self,
        dataset_uuid: uuid.UUID,
        records: Sequence[Mapping[str, Any]],
        *,
        producer_task_id: uuid.UUID,
        attempt: int,
        schema_hash: str,
    ) -> None:
        """Hand ``records`` to the API; an error the producer may retry is retryable."""
        import httpx

        ctx = _running.get(producer_task_id)
        token = ctx.capability_token if ctx is not None else None
        if token is None:
            raise OperatorError(
                "buffer-publish: the attempt has no capability token", retryable=False
            )
        body = {
            "task_id": str(producer_task_id),
            "attempt": attempt,
            "dataset_uuid": str(dataset_uuid),
            "schema_hash": schema_hash,
            "records": [dict(r) for r in records],
        }
        try:
            async with httpx.AsyncClient(timeout=self._timeout) as http:
                answer = await http.post(
                    self.api_url + _BUFFER_PATH, json=body, headers={CAPABILITY_HEADER: token}
                )
        except httpx.TransportError as exc:
            raise OperatorError(f"buffer-publish: {type(exc).__name__}") from None
        if answer.status_code >= 300:
            try:
                detail = answer.json()
            except ValueError:
                detail = {}
            error = detail.get("error", "error") if isinstance(detail, dict) else "error"
            retry = answer.status_code >= 500 or answer.status_code == 429
            raise OperatorError(
                f"buffer-publish: HTTP {answer.status_code} {error}", retryable=retry
            )


class _CommittingContext:
    """The task context an operator sees: the wrapper's, except that
    :meth:`emit_blocking` first uploads what the attempt wrote."""

    def __init__(self, ctx: TaskContext, attempt: _Attempt) -> None:
        self._ctx = ctx
        self._attempt = attempt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def emit_blocking(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        """Commit the written files, then emit the events that announce them."""
        self._ctx.check()
        self._attempt.commit()
        return self._ctx.emit_blocking(events)


def committing_operator(spec: OperatorSpec, work_dir: Path) -> OperatorSpec:
    """``spec`` run with an attempt scratch directory and the uploads above."""
    run: Callable[[TaskContext], OperatorResult] = spec.run

    def operator(ctx: TaskContext) -> OperatorResult:
        attempt = _Attempt(Path(tempfile.mkdtemp(prefix=f"{ctx.task_id}-", dir=work_dir)))
        _local.attempt, _running[ctx.task_id] = attempt, ctx
        try:
            result = run(cast(TaskContext, _CommittingContext(ctx, attempt)))
            ctx.check()  # a lost lease uploads nothing
            attempt.commit()
            return result
        finally:
            _local.attempt = None
            _running.pop(ctx.task_id, None)
            shutil.rmtree(attempt.scratch, ignore_errors=True)

    operator.__name__ = operator.__qualname__ = getattr(run, "__name__", spec.name)
    return replace(spec, run=operator)


@dataclass(frozen=True)
class RehearsalRuntime:
    """Where the rehearsal's operators reach AWS and the API."""

    region: str
    endpoint_url: str | None
    api_url: str
    work_dir: Path
    spark_memory: str = "1g"

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> RehearsalRuntime:
        """Read the variables of the module docstring; a missing one is named."""
        missing = [n for n in ("TRACE_AWS_REGION", "TRACE_API_URL") if not env.get(n)]
        if missing:
            raise ConfigurationError(f"{missing[0]}: missing (rehearsal operators)")
        return cls(
            region=env["TRACE_AWS_REGION"],
            endpoint_url=env.get("TRACE_AWS_ENDPOINT_URL") or None,
            api_url=env["TRACE_API_URL"],
            work_dir=Path(env.get("TRACE_REHEARSAL_WORK_DIR") or tempfile.gettempdir()),
            spark_memory=env.get("TRACE_REHEARSAL_SPARK_MEMORY") or "1g",
        )


def rehearsal_operators(runtime: RehearsalRuntime) -> OperatorRegistry:
    """The pipeline's three operators on S3, the API's buffer and Spark ``local[*]``.

    Nothing connects here: Spark starts, and the API is called, on the first
    task (so ``serve``, which only needs the names, pays nothing).
    """
    from trace_core.worker.http_state import HttpOperatorState
    from trace_lite.object_store import LocalObjectStore
    from trace_lite.pipeline.operators import PipelineRuntime, pipeline_operators
    from trace_lite.spark import DEFAULT_SPARK_CONF, SparkConfig, SparkSessionProvider

    runtime.work_dir.mkdir(parents=True, exist_ok=True)
    spark = SparkSessionProvider(
        SparkConfig(
            app_name="trace-aws-worker",
            conf={**DEFAULT_SPARK_CONF, "spark.driver.memory": runtime.spark_memory},
        )
    )
    s3 = S3ObjectStore(region=runtime.region, endpoint_url=runtime.endpoint_url)
    pipeline = PipelineRuntime(
        # The operators only call handle_for(...).local_path/get/put/list,
        # which S3FileStore provides on S3.
        store=cast(LocalObjectStore, S3FileStore(s3)),
        spark=spark,
        buffer=HttpDatasetBuffer(runtime.api_url),
        state=HttpOperatorState(runtime.api_url),
    )
    return OperatorRegistry(
        committing_operator(spec, runtime.work_dir) for spec in pipeline_operators(pipeline)
    )


_built: OperatorRegistry | None = None
_build_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    # ``OPERATORS`` is built on first access so that importing this module
    # needs no environment (``--operators module:OPERATORS`` reads it).
    global _built
    if name != "OPERATORS":
        raise AttributeError(name)
    with _build_lock:
        if _built is None:
            _built = rehearsal_operators(RehearsalRuntime.from_environment(os.environ))
        return _built
