"""``trace-aws``: the AWS profile's processes.

- ``trace-aws serve``: the Dispatcher and the control-plane HTTP API on
  Postgres, capability tokens signed by KMS (:class:`~trace_aws.kms.KmsSigner`),
  credentials minted by STS (:class:`~trace_aws.sts.StsCredentialMinter`) and
  wake-ups sent to SQS (:class:`~trace_aws.sqs.SqsWakeupQueue`); with
  ``TRACE_AWS_LAMBDA_RUNTIMES``, Lambda runtimes invoked by
  :class:`~trace_aws.lambda_invoker.LambdaTaskInvoker` (their functions'
  retries checked before serving); with ``TRACE_AWS_BUFFER_QUEUES``,
  buffered datasets published to SQS
  (:class:`~trace_aws.sqs_buffer.SqsDatasetBuffer`) and one
  :class:`~trace_aws.sqs_buffer.SqsBufferSink` per queue beside the server.
- ``trace-aws worker``: the :class:`~trace_aws.sqs_worker.SqsWorker` loop on one
  queue around a :class:`~trace_core.worker.WorkerWrapper` that talks HTTP to
  the API. SIGTERM or SIGINT stops it (:meth:`SqsWorker.stop`: an idle
  long-poll is abandoned, running tasks finish).
- ``trace-aws migrate``: bring the state database to the current schema.
- ``trace-aws rehearse [--blocks N]``: the local rehearsal of the whole
  profile on moto's server and a throwaway Postgres (:mod:`trace_aws.rehearsal`;
  ``./dev run --aws``).

Settings come from the environment and/or ``--settings FILE``
(:mod:`trace_aws.settings`); a missing or wrong one stops the command with
status 2 and a message naming it. Operators are loaded as in the lite
profile, ``--operators module:attribute``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import anyio

from trace_aws.settings import SERVE_REQUIRED, WORKER_REQUIRED, AwsSettings, load_settings
from trace_core.authoring.operators import OperatorRegistry
from trace_core.clock import SystemClock
from trace_core.errors import ConfigurationError, TraceError
from trace_core.security.jwks import KeyRing

if TYPE_CHECKING:
    from trace_aws.lambda_invoker import LambdaTaskInvoker
    from trace_aws.sqs_worker import SqsWorker, SqsWorkerSettings
    from trace_core.dispatcher.runtimes import RuntimeRegistry

__all__ = ["TOKEN_ISSUER", "main"]

log = logging.getLogger("trace_aws.cli")

TOKEN_ISSUER = "trace-aws"
"""The issuer of the AWS profile's capability tokens."""
_POOL = 16  # state-database connections: concurrent requests plus the services' loops
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trace-aws", description=__doc__.splitlines()[0])
    parser.add_argument("--settings", help="a NAME=value settings file (the environment wins)")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning"],
        help="default info (warning for rehearse, whose progress lines are its output)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="the Dispatcher and the control-plane API")
    serve.add_argument("--operators", help="module:attribute of an OperatorRegistry")
    worker = commands.add_parser("worker", help="run the wake-ups of one SQS queue")
    worker.add_argument("--operators", help="module:attribute of an OperatorRegistry")
    worker.add_argument("--concurrency", type=int, default=1, help="tasks run at once")
    worker.add_argument("--wait-seconds", type=int, default=20, help="SQS long-poll (0..20)")
    worker.add_argument("--visibility-seconds", type=int, default=60)
    worker.add_argument("--worker-id", help="default <host>-<pid>")
    commands.add_parser("migrate", help="upgrade the state database schema")
    rehearse = commands.add_parser(
        "rehearse",
        help="the chain pipeline on moto, Postgres, serve and two workers (./dev run --aws)",
    )
    rehearse.add_argument("--blocks", type=int, default=20_000, help="blocks to follow")
    rehearse.add_argument("--workers", type=int, default=2, help="trace-aws worker processes")
    rehearse.add_argument("--work-dir", help="keep logs and scratch here (default: a temp dir)")
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run a ``trace-aws`` command; the exit status."""
    args = _parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = "warning" if args.command == "rehearse" else "info"
    env = os.environ if environ is None else environ
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        if args.command == "serve":
            serve(load_settings(env, args.settings, required=SERVE_REQUIRED), args)
        elif args.command == "worker":
            return worker(load_settings(env, args.settings, required=WORKER_REQUIRED), args)
        elif args.command == "rehearse":
            return rehearse(args)
        else:
            from trace_core.storage.migrate import upgrade

            settings = load_settings(env, args.settings, required=("TRACE_DATABASE_URL",))
            assert settings.database_url is not None
            upgrade(settings.database_url)
    except ConfigurationError as exc:
        print(f"trace-aws {args.command}: {exc}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"trace-aws {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def rehearse(args: argparse.Namespace) -> int:
    """Run the local rehearsal (:mod:`trace_aws.rehearsal`); 0 once every
    dataset is current and the outputs equal the reference."""
    from pathlib import Path

    from trace_aws.rehearsal import RehearsalOptions, rehearse_main

    work_dir = Path(args.work_dir) if args.work_dir else None
    options = RehearsalOptions(blocks=args.blocks, workers=args.workers, work_dir=work_dir)
    return rehearse_main(options, sys.stdout)


def _operators(reference: str | None) -> OperatorRegistry:
    # The lite profile already resolves ``module:attribute`` registries; reuse it.
    from trace_lite.serve import load_operators

    return load_operators(reference)


def signing_ring(settings: AwsSettings) -> KeyRing:
    """The key ring of the one configured KMS signing key (blocking: KMS calls)."""
    from trace_aws.kms import KmsKey, kms_client, kms_key_ring

    assert settings.signing_key_id is not None
    client = kms_client(settings.region, settings.endpoint_url)
    # One key, signing from the start. Rotation needs recorded schedules
    # (docs/aws.md, KmsKey); they are not a setting yet.
    key = KmsKey(settings.signing_key_id, published_at=_EPOCH, activated_at=_EPOCH, bootstrap=True)
    return kms_key_ring(client, [key], SystemClock())


def serve(settings: AwsSettings, args: argparse.Namespace) -> None:
    """Check the schema, load the signing key, then serve until signalled."""
    from trace_core.storage.migrate import current_revision, head_revision

    assert settings.database_url is not None
    revision, head = current_revision(settings.database_url), head_revision()
    if revision != head:
        raise ConfigurationError(
            f"TRACE_DATABASE_URL: the database is at schema revision {revision or 'none'}, "
            f"not {head}: run `trace-aws migrate` first"
        )
    operators = _operators(args.operators)
    ring = signing_ring(settings)
    anyio.run(_serve, settings, operators, ring, args.log_level)


async def _serve(
    settings: AwsSettings, operators: OperatorRegistry, ring: KeyRing, log_level: str
) -> None:

    from trace_aws.sqs import SqsWakeupQueue, sqs_client
    from trace_aws.sqs_buffer import SqsBufferSink, SqsDatasetBuffer, SqsSinkSettings
    from trace_aws.sts import StsCredentialMinter
    from trace_core.api.serving import serve_dispatcher
    from trace_core.dispatcher.capabilities import signing_capability_issuer, task_token_verifier
    from trace_core.dispatcher.service import Dispatcher, DispatcherConfig
    from trace_core.storage.engine import EngineSettings
    from trace_core.storage.sql import SqlRepository
    from trace_lite.buffered import DataDatabase, RecordWriter
    from trace_lite.pipeline.operators import ALERT_SCHEMA

    assert settings.database_url is not None and settings.role_arn is not None
    assert settings.internal_token is not None and settings.bucket is not None
    clock = SystemClock()
    verifier = task_token_verifier(ring, clock, issuer=TOKEN_ISSUER)
    # Datasets and scratch live in the configured bucket: scopes (and so the
    # STS session policies) name its prefixes.
    config = DispatcherConfig(storage_root=f"s3://{settings.bucket}/")
    minter = StsCredentialMinter(
        settings.role_arn, region=settings.region, endpoint_url=settings.endpoint_url
    )
    sqs = sqs_client(settings.region, settings.endpoint_url)
    wakeups = SqsWakeupQueue(sqs, queue_urls=settings.queue_urls)
    runtimes, lambdas = await _lambda_runtimes(settings)
    repo = SqlRepository(settings.database_url, EngineSettings(pool_size=_POOL))
    # The buffered datasets' tables live in the state database: a separate
    # data database is not a setting of the AWS profile yet.
    data = DataDatabase(settings.database_url)
    try:
        await data.open()
        capabilities = signing_capability_issuer(
            ring, repo, clock, config.storage_root, issuer=TOKEN_ISSUER
        )
        dispatcher = Dispatcher(
            repo,
            operators=operators,
            clock=clock,
            config=config,
            wakeups=wakeups,
            capabilities=capabilities,
            runtimes=runtimes,
            lambdas=lambdas,
        )
        sinks = [
            SqsBufferSink(
                sqs,
                RecordWriter(data, repo, [ALERT_SCHEMA], clock=clock),
                SqsSinkSettings(url),
                gateway=dispatcher.gateway,
            )
            for url in sorted(set(settings.buffer_queue_urls.values()))
        ]
        buffer = SqsDatasetBuffer(sqs, settings.buffer_queue_urls) if sinks else None
        await serve_dispatcher(
            dispatcher,
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            beside=sinks,
            internal_token=settings.internal_token,
            jwks=ring.jwks,
            verifier=verifier,
            minter=minter,
            buffer=buffer,
        )
    finally:
        await data.close()
        await repo.close()


async def _lambda_runtimes(
    settings: AwsSettings,
) -> tuple[RuntimeRegistry | None, LambdaTaskInvoker | None]:
    """The runtime registry with the configured Lambda runtimes and their invoker,
    once every function's own retries were checked off; ``(None, None)`` without any."""
    from trace_aws.lambda_invoker import LambdaTaskInvoker, lambda_client
    from trace_core.dispatcher.runtimes import Runtime, RuntimeKind, RuntimeRegistry

    if not settings.lambda_runtimes:
        return None, None
    registry = RuntimeRegistry()
    for name, function in settings.lambda_runtimes.items():
        registry.register(Runtime(name, RuntimeKind.LAMBDA, function))
    invoker = LambdaTaskInvoker(
        lambda_client(settings.region, settings.endpoint_url), qualifier=settings.lambda_qualifier
    )
    # A ``{operator}`` target names a function per job's operator, known only
    # once jobs are deployed: only the fixed functions can be checked here.
    fixed = [f for f in settings.lambda_runtimes.values() if "{operator}" not in f]
    templated = sorted(set(settings.lambda_runtimes.values()) - set(fixed))
    if templated:
        log.warning("lambda functions %s are not checked at start-up (per operator)", templated)
    await invoker.check_functions(fixed)
    return registry, invoker


def worker(settings: AwsSettings, args: argparse.Namespace) -> int:
    """Run the SQS worker loop until SIGTERM/SIGINT; the exit status."""
    from trace_aws.sqs_worker import SqsWorkerSettings

    assert settings.worker_queue_url is not None
    try:
        loop = SqsWorkerSettings(
            settings.worker_queue_url,
            wait_seconds=args.wait_seconds,
            concurrency=args.concurrency,
            visibility_seconds=args.visibility_seconds,
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"worker options: {exc}") from None
    operators = _operators(args.operators)
    try:
        anyio.run(_work, settings, loop, operators, args.worker_id)
    except* TraceError as failed:
        # Raised inside the worker's task group, so it arrives wrapped in a group.
        raise failed.exceptions[0] from None
    return 0


async def _work(
    settings: AwsSettings,
    loop: SqsWorkerSettings,
    operators: OperatorRegistry,
    worker_id: str | None,
) -> None:
    import httpx

    from trace_aws.sqs import sqs_client
    from trace_aws.sqs_worker import SqsWorker
    from trace_core.worker import HttpControlPlaneClient, RetryingClient, WorkerWrapper
    from trace_core.worker.http_credentials import HttpCredentialSource
    from trace_lite.worker_cli import default_worker_id

    assert settings.api_url is not None and settings.internal_token is not None
    client = sqs_client(settings.region, settings.endpoint_url)
    ident = worker_id or default_worker_id()
    async with httpx.AsyncClient(timeout=30.0) as http, anyio.create_task_group() as group:
        control = RetryingClient(
            HttpControlPlaneClient(settings.api_url, settings.internal_token, http=http)
        )
        # Operators that touch S3 get STS credentials for their attempt's
        # scope, exchanged for the capability token at /v1/task/credentials.
        credentials = HttpCredentialSource(settings.api_url, http)
        wrapper = WorkerWrapper(control, operators, worker_id=ident, credentials=credentials)
        sqs_worker = SqsWorker(client, wrapper, loop)
        group.start_soon(_stop_on_signal, sqs_worker)
        log.info("worker %s polling %s", ident, loop.queue_url)
        await sqs_worker.run()
        group.cancel_scope.cancel()
    log.info("worker %s stopped", ident)


async def _stop_on_signal(sqs_worker: SqsWorker) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: stopping after the running tasks", signal.Signals(signum).name)
            sqs_worker.stop()
            return


if __name__ == "__main__":
    sys.exit(main())
