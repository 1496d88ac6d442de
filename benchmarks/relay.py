"""Outbox relay benchmark: rows drained per second, the service loop against batches.

    python -m benchmarks.relay --engine postgres --rows 3000 --handler-ms 0 --runs 3

Each run writes ``--rows`` outbox rows (one transaction) on a fresh database
and drains them twice, timing each drain until every row is ``Done``:

- ``service``: ``OutboxRelay.start()``, the loop a Dispatcher runs: it tops
  its batch up as rows finish, handling ``--concurrency`` at once;
- ``batches``: ``OutboxRelay.run_once()`` back to back, each claiming a batch,
  handling it and marking it done before the next claim (what the service
  loop did before it refilled as rows finish).

The handler sleeps ``--handler-ms`` per row (0: no work; a few ms stands for
a webhook or a queue send). Half the rows are drained each way, on the same
database, in alternating order from run to run; ``ratio`` = service / batches.
One JSON object per run, then a summary with medians.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import sqlalchemy as sa

from benchmarks._common import (
    Databases,
    benchmark_parser,
    configure_logging,
    emit,
    load_average,
    log,
    summarize,
    utcnow,
)
from trace_core.outbox import OutboxRelay, RelayConfig, write_outbox
from trace_core.storage import schema
from trace_core.storage.protocol import NewOutboxRow
from trace_core.storage.sql import SqlRepository

__all__ = ["main"]

_KEYS = ("service_rows_per_s", "batches_rows_per_s", "ratio")


class _Handler:
    """Sleeps ``ms`` per row; ``all_seen`` is set once ``expected`` rows were handled."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.seen = 0
        self.expected = 0
        self.all_seen = anyio.Event()

    def expect(self, rows: int) -> None:
        self.seen, self.expected, self.all_seen = 0, rows, anyio.Event()

    async def __call__(self, payload: Mapping[str, Any]) -> None:
        if self.ms:
            await anyio.sleep(self.ms / 1000)
        self.seen += 1
        if self.seen == self.expected:
            self.all_seen.set()


async def _drain(relay: OutboxRelay, handler: _Handler, service: bool) -> float:
    """Seconds until every row is handled and marked done."""
    started = time.perf_counter()
    if service:
        async with anyio.create_task_group() as tg:
            await relay.start(tg)
            await handler.all_seen.wait()
            await relay.stop()  # marks the last rows done before it returns
    else:
        while await relay.run_once():
            pass
    return time.perf_counter() - started


async def _undone(repo: SqlRepository) -> int:
    o = schema.outbox
    async with repo.read() as tx:
        query = sa.select(sa.func.count()).where(o.c.status != "Done")
        return int((await tx.connection.execute(query)).scalar_one())


async def _run(
    url: str, rows: int, handler_ms: float, concurrency: int, run: int
) -> dict[str, Any]:
    repo = SqlRepository(url)
    try:
        handler = _Handler(handler_ms)
        relay = OutboxRelay(repo, {"k": handler}, config=RelayConfig(concurrency=concurrency))
        half = rows // 2
        out: dict[str, Any] = {}
        # Alternate which way drains first, so neither always meets a warmer cache.
        order = (True, False) if run % 2 == 0 else (False, True)
        for service in order:
            async with repo.transaction() as tx:
                await write_outbox(tx, [NewOutboxRow("k", {"n": i}) for i in range(half)], utcnow())
            handler.expect(half)
            seconds = await _drain(relay, handler, service)
            if await _undone(repo):
                raise RuntimeError("rows left undone after the drain")
            out["service_rows_per_s" if service else "batches_rows_per_s"] = round(half / seconds)
        out["ratio"] = round(out["service_rows_per_s"] / out["batches_rows_per_s"], 2)
        return out
    finally:
        await repo.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; one JSON object per run, then a summary."""
    p = benchmark_parser("python -m benchmarks.relay", __doc__)
    p.add_argument("--rows", type=int, default=3000, help="rows per run (half drained each way)")
    p.add_argument("--handler-ms", type=float, default=0.0, help="handler sleep per row")
    p.add_argument("--concurrency", type=int, default=RelayConfig.concurrency)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    for name in ("rows", "concurrency", "runs"):
        if getattr(args, name) < (2 if name == "rows" else 1):
            p.error(f"--{name} is too small")
    if args.handler_ms < 0:
        p.error("--handler-ms must be >= 0")
    configure_logging(False)
    results: list[dict[str, Any]] = []
    with Databases(args.engine, args.db) as dbs:
        for run in range(args.runs):
            url = dbs.fresh(f"relay{run}")
            load = load_average()
            log.info("run %d: %d rows, handler %.1f ms", run, args.rows, args.handler_ms)
            got = anyio.run(
                _run, url, args.rows, args.handler_ms, args.concurrency, run, backend="asyncio"
            )
            dbs.drop(url)
            row = {
                "bench": "relay",
                "engine": args.engine,
                "run": run,
                "rows": args.rows,
                "handler_ms": args.handler_ms,
                "concurrency": args.concurrency,
                "batch_size": RelayConfig.batch_size,
                **got,
                "load_avg_1m": load,
            }
            emit(row)
            results.append(row)
    emit({"bench": "relay", "engine": args.engine, "summary": True, **summarize(results, _KEYS)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
