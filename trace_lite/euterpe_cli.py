"""``trace-lite euterpe …``: serve Euterpe, run its workers, issue keys, rotate KEKs.

``euterpe serve``
    the HTTP API (``POST /transcode``, ``GET /transcode/status``,
    ``PUT /transcode/{id}/credentials``) with the webhook deliverer and the
    maintenance loop (reclaim, due retries, pruning after ``--retention-days``)
    beside it, and ``--workers N`` jobs at once in process if asked.
``euterpe worker``
    a worker process: claims queued jobs and runs them (ffmpeg by default)
    until SIGTERM/SIGINT, which hands the jobs in hand back to the queue.
``euterpe key create --requester R``
    issues an API key; prints it once with the requester's webhook secret
    (what the requester verifies webhooks and refresh calls with).
``euterpe credentials --read PREFIX --write PREFIX``
    mints scoped credentials for the local object store (the lite stand-in
    for the STS credentials a requester would put in its request).
``euterpe listen --requester R``
    a development webhook endpoint: verifies each delivery with the receiver
    helper (the requester's secret, derived here from the data directory's
    master) and prints each new event as one JSON line.
``euterpe rewrap --kek-id NEW --accept-kek OLD``
    KEK rotation: re-seals every stored credential under the active KEK and
    says whether anything remains under the old ids.

Secrets never come from the command line, and only ``key create`` and
``credentials`` print any (what they are for). Every key file lives in the
data directory (:mod:`trace_lite.euterpe_runtime`).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.euterpe.requests import UrlPolicy
from trace_lite.cli_commands import Command, in_event_loop, port, positive_int
from trace_lite.state_database import StateDatabase, Use

if TYPE_CHECKING:
    from trace_lite.euterpe_runtime import EuterpeOptions

__all__ = ["EUTERPE_COMMANDS", "EUTERPE_GROUPS"]

log = logging.getLogger("trace_lite.euterpe")

EUTERPE_GROUPS = {
    "euterpe": "the Euterpe transcoding service: serve, worker, keys, KEK rotation",
    "euterpe key": "Euterpe API keys",
}
_LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def _non_negative_int(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be an integer, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{option} must be >= 0, got {value}")
        return value

    return parse


def _positive_float(option: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{option} must be > 0, got {text}")
        return value

    return parse


# --- shared options -------------------------------------------------------------------


def _kek_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kek-id",
        default="kek-1",
        help="active key-encryption key id: new credentials are sealed under it "
        "(<data-dir>/keks/<id>.key, created on first use; default kek-1)",
    )
    parser.add_argument(
        "--accept-kek",
        action="append",
        default=[],
        metavar="KEK_ID",
        help="an older KEK id still opened (the rotation window); repeatable",
    )


def _url_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allowed-hosts",
        help="comma-separated webhook/refresh hosts allowed (exact or *.suffix); default any",
    )
    parser.add_argument(
        "--allow-loopback-urls",
        action="store_true",
        help="allow webhook and refresh URLs on localhost (development)",
    )
    parser.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="allow webhook and refresh URLs in private address ranges",
    )


def _processor_option(parser: argparse.ArgumentParser) -> None:
    from trace_lite.euterpe_runtime import PROCESSORS

    parser.add_argument(
        "--processor",
        choices=PROCESSORS,
        default="ffmpeg",
        help="ffmpeg: transcode (default); copy: copy the source per preset (demos)",
    )


def _options(args: argparse.Namespace, db: StateDatabase) -> EuterpeOptions:
    from trace_lite.euterpe_runtime import EuterpeOptions

    hosts = getattr(args, "allowed_hosts", None)
    allowed = None
    if hosts is not None:
        allowed = frozenset(h.strip() for h in hosts.split(",") if h.strip())
        if not allowed:
            raise ConfigurationError("--allowed-hosts: give one or more comma-separated hosts")
    return EuterpeOptions(
        database_url=db.url(),
        data_dir=Path(db.data_dir),
        active_kek=args.kek_id,
        accepted_keks=tuple(args.accept_kek),
        url_policy=UrlPolicy(
            allowed_hosts=allowed,
            allow_loopback=getattr(args, "allow_loopback_urls", False),
            allow_private=getattr(args, "allow_private_urls", False),
        ),
        retention=timedelta(days=getattr(args, "retention_days", 30.0)),
        max_attempts=getattr(args, "max_attempts", 5),
        processor=getattr(args, "processor", "ffmpeg"),
        workers=getattr(args, "workers", 0),
        concurrency=getattr(args, "concurrency", 2),
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 8080),
        log_level=getattr(args, "log_level", "info"),
    )


def _configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
        )


# --- serve ----------------------------------------------------------------------------


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8080, help="port to bind (default 8080)")
    parser.add_argument("--log-level", default="info", choices=_LOG_LEVELS)
    parser.add_argument(
        "--workers",
        type=_non_negative_int("--workers"),
        default=0,
        help="jobs run at once by an in-process worker (default 0: run `euterpe worker`)",
    )
    _processor_option(parser)
    parser.add_argument(
        "--retention-days",
        type=_positive_float("--retention-days"),
        default=30.0,
        help="finished jobs are pruned after this many days, then answered 410 (default 30)",
    )
    parser.add_argument(
        "--max-attempts",
        type=positive_int("--max-attempts"),
        default=5,
        help="execution attempts of a job (default 5)",
    )
    _kek_options(parser)
    _url_options(parser)


def _serve(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_lite.euterpe_runtime import (
        load_webhook_signer,
        make_processor,
        object_storage,
    )

    options = _options(args, db)
    # Key files and the processor's binary are checked before anything starts.
    vault = options.vault()
    signer = load_webhook_signer(options.data_dir)
    storage = object_storage(options.data_dir) if options.workers else None
    processor = make_processor(options.processor) if options.workers else None
    _configure_logging(options.log_level)

    async def main() -> None:
        from trace_core.api.transcode_serving import serve_transcode
        from trace_core.storage.engine import EngineSettings
        from trace_core.storage.sql import SqlRepository
        from trace_lite.euterpe_runtime import build_server

        repo = SqlRepository(options.database_url, EngineSettings(pool_size=8))
        try:
            server = build_server(
                options, repo, vault=vault, signer=signer, storage=storage, processor=processor
            )
            log.info("euterpe serving on http://%s:%d", options.host, options.port)
            try:
                await serve_transcode(
                    server.app,
                    host=options.host,
                    port=options.port,
                    log_level=options.log_level,
                    beside=server.services,
                )
            finally:
                await server.deliverer.aclose()
        finally:
            await repo.close()

    anyio.run(main)
    return 0


# --- worker ---------------------------------------------------------------------------


def _worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency",
        type=positive_int("--concurrency"),
        default=2,
        help="jobs run at once (default 2)",
    )
    _processor_option(parser)
    parser.add_argument("--worker-id", help="worker id (default $POD_NAME, $HOSTNAME, boot UUID)")
    parser.add_argument("--log-level", default="info", choices=_LOG_LEVELS)
    _kek_options(parser)
    _url_options(parser)


def _worker(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_lite.euterpe_runtime import (
        load_webhook_signer,
        make_processor,
        object_storage,
    )

    options = _options(args, db)
    vault = options.vault()
    signer = load_webhook_signer(options.data_dir)
    storage = object_storage(options.data_dir)
    processor = make_processor(options.processor)
    _configure_logging(options.log_level)

    async def main() -> None:
        from trace_core.storage.sql import SqlRepository
        from trace_lite.euterpe_runtime import build_worker

        repo = SqlRepository(options.database_url)
        try:
            worker = build_worker(
                options,
                repo,
                vault=vault,
                signer=signer,
                storage=storage,
                processor=processor,
                worker_id=args.worker_id,
            )
            log.info("euterpe worker %s running", worker.worker_id)
            async with anyio.create_task_group() as group:

                async def on_signal() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for signum in signals:
                            name = signal.Signals(signum).name
                            log.info("%s: handing the jobs in hand back, then stopping", name)
                            await worker.stop()
                            return

                group.start_soon(on_signal)
                await worker.run()
                group.cancel_scope.cancel()
            log.info("euterpe worker %s stopped", worker.worker_id)
        finally:
            await repo.close()

    anyio.run(main)
    return 0


# --- keys, credentials, rewrap ----------------------------------------------------------


def _key_create_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requester", required=True, help="the requester id the key is bound to")
    parser.add_argument("--label", help="a note shown when keys are listed")


async def _key_create(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_core.euterpe.api_keys import ApiKeys, check_requester_id
    from trace_core.storage.sql import SqlRepository
    from trace_lite.euterpe_runtime import load_webhook_signer

    try:
        check_requester_id(args.requester, "--requester")
    except InvalidInput as exc:
        raise ConfigurationError(str(exc)) from None
    signer = load_webhook_signer(Path(db.data_dir))
    repo = SqlRepository(db.url())
    try:
        issued = await ApiKeys(repo).issue(args.requester, label=args.label)
    finally:
        await repo.close()
    print(
        json.dumps(
            {
                "key_id": str(issued.key_id),
                "requester_id": issued.requester_id,
                "api_key": issued.secret,
                "webhook_secret": signer.requester_secret_hex(issued.requester_id),
            },
            indent=2,
        )
    )
    print(
        "The API key is shown this once (only its digest is stored). Verify webhooks "
        "and refresh calls with webhook_secret (hex).",
        file=sys.stderr,
    )
    return 0


def _credentials_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir", default=".trace", help="data directory holding credentials.key (.trace/)"
    )
    parser.add_argument("--read", required=True, help="s3:// prefix the credentials may read")
    parser.add_argument("--write", required=True, help="s3:// prefix the credentials may write")
    parser.add_argument(
        "--hours",
        type=_positive_float("--hours"),
        default=12.0,
        help="lifetime, 0.25..12 hours (default 12)",
    )


async def _credentials(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_core.clock import SystemClock
    from trace_core.security.minting import LocalCredentialMinter
    from trace_core.security.scopes import S3Prefix, Scope
    from trace_lite.serve import read_minter_key

    prefixes = []
    for option, value in (("--read", args.read), ("--write", args.write)):
        try:
            prefixes.append(S3Prefix.parse(value))
        except (InvalidInput, ValueError) as exc:
            raise ConfigurationError(f"{option}: {getattr(exc, 'reason', exc)}") from None
    seconds = int(args.hours * 3600)
    if not 900 <= seconds <= 43200:
        raise ConfigurationError("--hours must be within 0.25..12")
    minter = LocalCredentialMinter(read_minter_key(Path(args.data_dir)), clock=SystemClock())
    minted = await minter.mint(
        Scope(read=(prefixes[0],), write=(prefixes[1],)),
        session_name="euterpe-requester",
        duration_seconds=seconds,
    )
    document = {
        "access_key_id": minted.access_key_id,
        "secret_access_key": minted.secret_access_key,
        "session_token": minted.session_token,
        "expiration": minted.expiration.isoformat(),
    }
    print(json.dumps(document, indent=2))
    return 0


def _credentials_runner(args: argparse.Namespace, db: StateDatabase) -> int:
    return anyio.run(_credentials, args, db)


def _listen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requester", required=True, help="whose webhooks to verify")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=9000, help="port to bind (default 9000)")


def _listen(args: argparse.Namespace, db: StateDatabase) -> int:
    import uvicorn

    from trace_core.euterpe.api_keys import check_requester_id
    from trace_core.euterpe.receiver import WebhookReceiver, read_request_body
    from trace_core.security.webhook_signing import WebhookRejected
    from trace_core.storage.sql import SqlRepository
    from trace_lite.euterpe_runtime import load_webhook_signer

    try:
        check_requester_id(args.requester, "--requester")
    except InvalidInput as exc:
        raise ConfigurationError(str(exc)) from None
    secrets = load_webhook_signer(Path(db.data_dir)).requester_secrets(args.requester)
    url = db.url()

    async def main() -> None:
        repo = SqlRepository(url)
        receiver = WebhookReceiver(repo, secrets)

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            body = await read_request_body(receive)
            if body is None:
                return  # the client left mid-request: nothing to verify or answer
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            status = 204
            try:
                accepted = await receiver.verify_and_record(headers, body)
            except WebhookRejected as exc:
                status = exc.http_status
                print(json.dumps({"refused": exc.as_json()}), file=sys.stderr, flush=True)
            else:
                if not accepted.duplicate:
                    print(json.dumps(accepted.event, sort_keys=True), flush=True)
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off")
        )
        try:
            await server.serve()
        finally:
            await repo.close()

    anyio.run(main)
    return 0


def _rewrap_arguments(parser: argparse.ArgumentParser) -> None:
    _kek_options(parser)
    parser.add_argument(
        "--batch-size",
        type=positive_int("--batch-size"),
        default=100,
        help="credentials re-sealed per transaction (default 100)",
    )


async def _rewrap(args: argparse.Namespace, db: StateDatabase) -> int:
    from trace_core.euterpe.credentials import rewrap_credentials
    from trace_core.storage.sql import SqlRepository
    from trace_lite.kek_ring import load_credential_vault

    if not args.accept_kek:
        raise ConfigurationError(
            "--accept-kek: name the old KEK id(s) to re-wrap from (--kek-id is the new, active one)"
        )
    if args.batch_size > 10_000:
        raise ConfigurationError("--batch-size must be <= 10000")
    vault = load_credential_vault(
        Path(db.data_dir), active=args.kek_id, accepted=tuple(args.accept_kek)
    )
    repo = SqlRepository(db.url())
    try:
        report = await rewrap_credentials(repo, vault, batch_size=args.batch_size)
    finally:
        await repo.close()
    print(
        json.dumps(
            {
                "active": vault.active,
                "rewrapped": report.rewrapped,
                "superseded": report.superseded,
                "unopenable": [str(job_id) for job_id in report.unopenable],
                "remaining": report.remaining,
            },
            indent=2,
        )
    )
    if not any(report.remaining.values()):
        print(
            "Nothing remains under the old ids: drop them from --accept-kek.",
            file=sys.stderr,
        )
    return 1 if report.unopenable else 0


_START = (
    "A new SQLite state database is created and migrated; a Postgres one must be at the "
    "newest schema revision (`trace-lite db upgrade --db URL`)."
)

EUTERPE_COMMANDS: tuple[Command, ...] = (
    Command(
        ("euterpe", "serve"),
        "serve the Euterpe API with the webhook deliverer and maintenance running",
        Use.START,
        _serve,
        _serve_arguments,
        description="POST /transcode, GET /transcode/status and PUT "
        "/transcode/{job_id}/credentials, with signed webhooks delivered and finished "
        "jobs pruned after --retention-days. " + _START,
    ),
    Command(
        ("euterpe", "worker"),
        "run Euterpe jobs (ffmpeg) until SIGTERM",
        Use.READY,
        _worker,
        _worker_arguments,
        description="Claims queued transcode jobs and runs them: fetch the source from "
        "<data-dir>/objects with the job's credentials, transcode, upload the outputs. "
        "SIGTERM/SIGINT hands the jobs in hand back to the queue, then exits.",
    ),
    Command(
        ("euterpe", "key", "create"),
        "issue a requester's API key (printed once) and show its webhook secret",
        Use.START,
        in_event_loop(_key_create),
        _key_create_arguments,
    ),
    Command(
        ("euterpe", "credentials"),
        "mint storage credentials of the local object store for a transcode request",
        Use.NONE,
        _credentials_runner,
        _credentials_arguments,
    ),
    Command(
        ("euterpe", "listen"),
        "a development webhook endpoint printing each verified event",
        Use.START,
        _listen,
        _listen_arguments,
        description="Verifies deliveries like a requester would (the receiver helper: "
        "signature, timestamp window, nonce replay, event-id dedupe, recorded in the state "
        "database) and prints each new event as a JSON line. Answers 204, or the refusal's "
        "status.",
    ),
    Command(
        ("euterpe", "rewrap"),
        "re-seal stored credentials under the active KEK (rotation)",
        Use.READY,
        in_event_loop(_rewrap),
        _rewrap_arguments,
        description="Start with the new id as --kek-id and the old one(s) as --accept-kek; "
        "when nothing remains under an old id, drop it from --accept-kek and delete its "
        "file. Exits 1 if some blob does not open (listed by job id).",
    ),
)
"""The ``trace-lite euterpe`` subcommands."""
