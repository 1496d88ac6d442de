"""PgQueuer idle enqueue -> pickup latency, paced like benchmarks.queue --mode latency.

Run by ``python -m benchmarks.compare`` with the peers' virtualenv, or alone:

    PEERS/bin/python benchmarks/peers/pgqueuer_latency.py --db postgresql://USER@HOST:PORT/postgres

One worker process runs a QueueManager (continuous mode, LISTEN/NOTIFY, default
batch size); the enqueuer (this process) enqueues one job every --pause seconds
with time.monotonic() at the start of the enqueue call in its payload. A sample
is the time from that stamp to the entrypoint being called (the job is picked:
the dequeue statement has committed). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
import uuid

import asyncpg

WARMUP = 10


def _dsn(server: str, db: str) -> str:
    return server.rsplit("/", 1)[0] + "/" + db


def _worker(dsn: str, ready, stop, results) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[float]:
        from pgqueuer import AsyncpgDriver, Queries, QueueManager

        conn = await asyncpg.connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        lat: list[float] = []

        @qm.entrypoint("noop")
        async def noop(job) -> None:  # type: ignore[no-untyped-def]
            now = time.monotonic()
            lat.append((now - float(job.payload.decode())) * 1000)

        async def stopper() -> None:
            await asyncio.to_thread(stop.wait)
            qm.shutdown.set()

        asyncio.get_running_loop().call_later(0.5, ready.set)
        t = asyncio.create_task(stopper())
        await qm.run()
        t.cancel()
        await conn.close()
        return lat

    results.put(asyncio.run(main()))


async def _enqueue(dsn: str, samples: int, pause: float) -> list[float]:
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(dsn)
    q = Queries(AsyncpgDriver(conn))
    create: list[float] = []
    await asyncio.sleep(1.0)
    for _ in range(samples + WARMUP):
        t0 = time.monotonic()
        await q.enqueue("noop", repr(t0).encode())
        create.append((time.monotonic() - t0) * 1000)
        await asyncio.sleep(pause)
    await asyncio.sleep(0.3)
    await conn.close()
    return create


async def _setup(server: str, name: str) -> None:
    from pgqueuer import AsyncpgDriver, Queries

    admin = await asyncpg.connect(server)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    conn = await asyncpg.connect(_dsn(server, name))
    await Queries(AsyncpgDriver(conn)).install()
    await conn.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--pause", type=float, default=0.02)
    p.add_argument("--runs", type=int, default=1)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    for run in range(a.runs):
        name = f"pgq_lat_{uuid.uuid4().hex[:8]}"
        asyncio.run(_setup(a.db, name))
        dsn = _dsn(a.db, name)
        ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_worker, args=(dsn, ready, stop, results))
        proc.start()
        ready.wait(60)
        create = asyncio.run(_enqueue(dsn, a.samples, a.pause))
        stop.set()
        lat = results.get(timeout=60)[WARMUP:]
        proc.join(30)
        lat_sorted = sorted(lat)
        print(
            json.dumps(
                {
                    "peer": "pgqueuer",
                    "run": run,
                    "samples": len(lat),
                    "median_ms": round(statistics.median(lat), 3),
                    "p99_ms": round(lat_sorted[int(0.99 * (len(lat_sorted) - 1))], 3),
                    "create_median_ms": round(statistics.median(create[WARMUP:]), 3),
                    "pause_s": a.pause,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
