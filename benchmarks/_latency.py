"""Latency mode: an idle worker waiting on the wake-up channel, one task at a time.

The worker loops like a real one: claim; if nothing came back, wait on
``repo.subscribe(TASKS_CHANNEL)`` and wait on it; claim again. An enqueuer
creates one task every ``pause`` seconds through ``TaskQueue.create`` with the
moment it started stamped (``time.monotonic()``, one clock for every process
on Linux) in the task's ``input_versions``. A sample is the time from that
stamp to the worker holding the lease. Scenarios:

``in-process``
    Worker and enqueuer are coroutines of one event loop sharing one
    repository (the commit fires the in-process hub). Both engines. Run in a
    child process with a time budget, so that a hung event loop is reported
    (``"hung": true``) instead of stalling the benchmark.
``in-process-threads``
    One process, two event loops: the worker on its own thread and loop,
    each side with its own repository, sharing one ``WakeupHub``.
``cross-process``
    The worker is another OS process; the wake-up travels through Postgres
    ``LISTEN/NOTIFY``. Postgres only (SQLite has no cross-process wake-up).
``in-process-handoff``
    As ``in-process``, but the worker waits in ``TaskQueue.claim_wait``: each
    task is created already claimed for it, in the enqueue's one commit (the
    one-commit hand-off). Both engines.

A wake-up lost between the worker's empty claim and its next wait costs the
whole ``timeout``; such samples are counted in ``slow_samples``.

A ``floor`` row comes first: the same pacing applied to bare driver calls on
the same database, so the scenarios can be read against what this machine's
commits cost by themselves. Postgres: ``SELECT 1`` and a one-row ``INSERT``
committed with the server's durability, on psycopg in autocommit. SQLite: a
one-row ``INSERT`` and its commit with Trace's settings (WAL, the same
``synchronous``), run on a worker thread as an event loop must run a blocking
call. Every scenario row carries ``ratio_to_floor``: its median over the
floor's ``durable_insert_median_ms``. The SQLite hand-off itself runs on the
event loop when it can (no thread hop:
:meth:`~trace_core.storage.sqlite_direct.RawWriter.try_inline`), so the
SQLite floor row also gives the same insert run on the loop
(``inline_insert_median_ms``), and the hand-off row its median over that
(``ratio_to_inline_floor``): the floor measured as the hand-off now runs.
As the load of a shared machine moves within a run, ``in-process-handoff``
also measures its own floor, one bare insert before each enqueue (``paired_floor_median_ms``,
``ratio_to_paired_floor``). An enqueue-to-claim
sample needs two durable commits (the enqueue and the claim) and one
notification; a hand-off needs one commit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue as queue_mod
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from typing import Any

import anyio
import anyio.to_thread

from benchmarks._common import Databases, load_average, log, median, percentile, utcnow
from trace_core.standalone import ensure_standalone_job
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TASKS_CHANNEL, TaskQueue
from trace_core.wakeup import WakeupHub

__all__ = ["SCENARIOS", "LatencyParams", "run_latency"]

SCENARIOS = ("in-process", "in-process-handoff", "in-process-threads", "cross-process")
"""Every latency scenario; ``cross-process`` runs on Postgres only."""

_WARMUP = 10
_START_DELAY = 1.0
"""Seconds the enqueuer waits first, so the worker's listener is up."""


@dataclass(frozen=True)
class LatencyParams:
    samples: int = 300
    pause: float = 0.02
    wait_timeout: float = 1.0
    wakeup_outbox: bool = True
    scenarios: tuple[str, ...] | None = None
    """The scenarios run (after the floor row); None: every one the engine supports."""


# Claimed samples: (task id, stamped enqueue start, claim returned, claim started
# (after the wake-up, or after the previous claim when it was not a wake-up)).
Sample = tuple[str, float, float, float]


class _Waiter:
    """The worker side: claim, else wait for a wake-up, until told to stop.

    With ``handoff``, the worker waits in ``claim_wait`` instead, where new
    tasks of this process are handed to it already claimed; a sample's "claim
    started" is then the start of that call."""

    def __init__(self, repo: SqlRepository, wait_timeout: float, *, handoff: bool = False) -> None:
        self.repo = repo
        self.queue = TaskQueue(repo, handoff=handoff)
        self.handoff = handoff
        self.wait_timeout = wait_timeout
        self.samples: list[Sample] = []
        self.wakeups = 0
        self.timeouts = 0

    def _took(self, leases: list[Any], started: float) -> None:
        now = time.monotonic()
        for lease in leases:
            stamp = float((lease.data.get("input_versions") or {})["t0"])
            self.samples.append((str(lease.item_id), stamp, now, started))

    async def run(self, stopped: Callable[[], bool]) -> None:
        wakeups = await self.repo.subscribe(TASKS_CHANNEL)
        while not stopped():
            started = time.monotonic()
            if self.handoff:
                leases = await self.queue.claim_wait(
                    "bench-latency", 10, max_wait=self.wait_timeout, wakeups=wakeups
                )
                self._took(leases, started)
                if leases:
                    self.wakeups += 1
                    await self.queue.complete_many([lease.fence for lease in leases])
                else:
                    self.timeouts += 1
                continue
            leases = await self.queue.claim_batch("bench-latency", 10)
            if leases:
                self._took(leases, started)
                await self.queue.complete_many([lease.fence for lease in leases])
                continue
            if await wakeups.wait(self.wait_timeout):
                self.wakeups += 1
            else:
                self.timeouts += 1


async def _enqueue_paced(
    queue: TaskQueue,
    job_id: Any,
    count: int,
    pause: float,
    floor: Callable[[], Awaitable[None]] | None = None,
    floor_times: list[float] | None = None,
) -> tuple[dict[str, float], list[float]]:
    """Create ``count`` tasks one at a time; ``({task id: commit returned}, create durations)``.

    With ``floor``, each enqueue is preceded by one paced bare durable insert,
    timed into ``floor_times``: a floor measured under the same load, moment
    by moment, as the samples it is compared with."""
    committed: dict[str, float] = {}
    durations: list[float] = []
    await anyio.sleep(_START_DELAY)
    for _ in range(count):
        if floor is not None and floor_times is not None:
            t0 = time.monotonic()
            await floor()
            floor_times.append((time.monotonic() - t0) * 1000)
            await anyio.sleep(pause)
        t0 = time.monotonic()
        created = await queue.create([NewTask(job_id, input_versions={"t0": t0})])
        t1 = time.monotonic()
        committed[str(created[0].task_id)] = t1
        durations.append((t1 - t0) * 1000)
        await anyio.sleep(pause)
    return committed, durations


@contextmanager
def _sqlite_floor_insert(url: str) -> Iterator[Callable[[], None]]:
    """SQLite's bare durable insert (a blocking call): a one-row INSERT and
    its commit on a connection of its own, with Trace's journal mode and
    ``synchronous``."""
    from trace_core.storage.engine import EngineSettings
    from trace_core.storage.url import parse_database_url

    path = parse_database_url(url).sync_url.database
    assert path is not None
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={EngineSettings().sqlite_synchronous.upper()}")
    conn.execute("CREATE TABLE trace_floor (x int)")

    def insert() -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO trace_floor VALUES (1)")
        conn.execute("COMMIT")

    try:
        yield insert
    finally:
        conn.close()


@asynccontextmanager
async def _floor_probe(url: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """One bare durable one-row insert, as the ``floor`` row makes it (Postgres:
    psycopg in autocommit; SQLite: Trace's settings, on a worker thread)."""
    if url.startswith("sqlite"):
        with _sqlite_floor_insert(url) as insert:

            async def sqlite_probe() -> None:
                await anyio.to_thread.run_sync(insert)

            yield sqlite_probe
        return
    import psycopg

    from trace_core.storage.url import parse_database_url

    conninfo = parse_database_url(url).conninfo()
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as pg:
        await pg.execute("CREATE TABLE trace_floor (x int)")

        async def pg_probe() -> None:
            await pg.execute("INSERT INTO trace_floor VALUES (1)")

        yield pg_probe


# --- cross-process worker ------------------------------------------------------------


def _worker_main(url: str, wait_timeout: float, ready: Event, stop: Event, results: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format="[latency worker] %(message)s")
    try:
        out = anyio.run(_worker, url, wait_timeout, ready, stop, backend="asyncio")
    except BaseException as exc:
        results.put({"error": repr(exc)})
        raise
    results.put(out)


async def _worker(url: str, wait_timeout: float, ready: Event, stop: Event) -> dict[str, Any]:
    repo = SqlRepository(url)
    waiter = _Waiter(repo, wait_timeout)
    # Start the LISTEN connection before the enqueuer begins.
    await repo.listen(TASKS_CHANNEL)
    ready.set()
    try:
        await waiter.run(stop.is_set)
    finally:
        await repo.close()
    return {"samples": waiter.samples, "wakeups": waiter.wakeups, "timeouts": waiter.timeouts}


# --- scenarios ----------------------------------------------------------------------------


async def _floor(url: str, params: LatencyParams) -> dict[str, Any]:
    """Paced bare round trips on the driver: what the machine costs by itself."""
    if url.startswith("sqlite"):
        return await _sqlite_floor(url, params)
    import psycopg

    from trace_core.storage.url import parse_database_url

    conninfo = parse_database_url(url).conninfo()
    probes = {"select_ms": "SELECT 1", "durable_insert_ms": "INSERT INTO trace_floor VALUES (1)"}
    out: dict[str, Any] = {}
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        # A regular table: a temporary one writes no WAL, so its commit flushes nothing.
        await conn.execute("CREATE TABLE trace_floor (x int)")
        for key, sql in probes.items():
            times: list[float] = []
            for _ in range(params.samples + _WARMUP):
                t0 = time.monotonic()
                await conn.execute(sql)
                times.append((time.monotonic() - t0) * 1000)
                await anyio.sleep(params.pause)
            out[f"{key[:-3]}_median_ms"] = round(median(times[_WARMUP:]), 3)
    return out


async def _sqlite_floor(url: str, params: LatencyParams) -> dict[str, Any]:
    """SQLite: one-row INSERT + COMMIT with Trace's settings on a worker thread
    (what an event loop pays for a blocking call: run inline, a commit waiting
    for the write lock can deadlock the loop against a writer of its own), and
    the same run on the loop, as the hand-off runs when it can never wait."""
    times: list[float] = []
    inline: list[float] = []
    with _sqlite_floor_insert(url) as insert:
        for _ in range(params.samples + _WARMUP):
            t0 = time.monotonic()
            await anyio.to_thread.run_sync(insert)
            times.append((time.monotonic() - t0) * 1000)
            await anyio.sleep(params.pause)
            t0 = time.monotonic()
            insert()
            inline.append((time.monotonic() - t0) * 1000)
            await anyio.sleep(params.pause)
    return {
        "durable_insert_median_ms": round(median(times[_WARMUP:]), 3),
        "inline_insert_median_ms": round(median(inline[_WARMUP:]), 3),
    }


async def _in_process(url: str, params: LatencyParams, handoff: bool = False) -> dict[str, Any]:
    repo = SqlRepository(url)
    try:
        job_id = await ensure_standalone_job(repo, "bench", now=utcnow())
        queue = TaskQueue(repo, wakeup_outbox=params.wakeup_outbox, handoff=handoff)
        waiter = _Waiter(repo, params.wait_timeout, handoff=handoff)
        done = False
        result: dict[str, Any] = {}
        floor_times: list[float] = []

        async def enqueuer() -> None:
            nonlocal done
            async with AsyncExitStack() as stack:
                # The hand-off's own floor, interleaved with its enqueues.
                probe = await stack.enter_async_context(_floor_probe(url)) if handoff else None
                result["committed"], result["durations"] = await _enqueue_paced(
                    queue, job_id, params.samples + _WARMUP, params.pause, probe, floor_times
                )
            await anyio.sleep(0.2)
            done = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter.run, lambda: done)
            tg.start_soon(enqueuer)
        if floor_times:
            result["floor_durations"] = floor_times
        return {
            "samples": waiter.samples,
            "wakeups": waiter.wakeups,
            "timeouts": waiter.timeouts,
            **result,
        }
    finally:
        await repo.close()


def _in_process_main(url: str, params: LatencyParams, handoff: bool, results: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format="[latency in-process] %(message)s")
    try:
        results.put(anyio.run(_in_process, url, params, handoff, backend="asyncio"))
    except BaseException as exc:
        results.put({"error": repr(exc)})
        raise


def _in_process_guarded(
    url: str, params: LatencyParams, *, handoff: bool = False
) -> dict[str, Any]:
    """Run the one-loop scenario in a child process, so that a hang is reported, not waited on."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(
        target=_in_process_main, args=(url, params, handoff, results), name="trace-bench-latency"
    )
    proc.start()
    budget = 30 + (params.samples + _WARMUP) * (params.pause + 0.05)
    try:
        got: dict[str, Any] = results.get(timeout=budget)
    except queue_mod.Empty:
        got = {"error": f"no result within {budget:.0f}s: the event loop hung", "hung": True}
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    return got


async def _threads(url: str, params: LatencyParams) -> dict[str, Any]:
    """Waiter on its own event loop in a thread; both repositories share one hub."""
    hub = WakeupHub()
    stop = threading.Event()
    box: dict[str, Any] = {}

    def waiter_thread() -> None:
        async def run() -> None:
            repo = SqlRepository(url, hub=hub)
            waiter = _Waiter(repo, params.wait_timeout)
            try:
                await waiter.run(stop.is_set)
            finally:
                await repo.close()
            box.update(samples=waiter.samples, wakeups=waiter.wakeups, timeouts=waiter.timeouts)

        anyio.run(run, backend="asyncio")

    thread = threading.Thread(target=waiter_thread, name="trace-bench-waiter")
    thread.start()
    try:
        sent = await _enqueue_only(url, params, hub=hub)
        await anyio.sleep(0.2)
    finally:
        stop.set()
        await anyio.to_thread.run_sync(thread.join)
    return {**box, **sent}


async def _enqueue_only(
    url: str, params: LatencyParams, *, hub: WakeupHub | None = None
) -> dict[str, Any]:
    repo = SqlRepository(url, hub=hub)
    try:
        job_id = await ensure_standalone_job(repo, "bench", now=utcnow())
        queue = TaskQueue(repo, wakeup_outbox=params.wakeup_outbox)
        committed, durations = await _enqueue_paced(
            queue, job_id, params.samples + _WARMUP, params.pause
        )
        return {"committed": committed, "durations": durations}
    finally:
        await repo.close()


def _cross_process(url: str, params: LatencyParams) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    stop = ctx.Event()
    results = ctx.Queue()
    proc = ctx.Process(
        target=_worker_main,
        args=(url, params.wait_timeout, ready, stop, results),
        name="trace-bench-latency-worker",
    )
    proc.start()
    try:
        if not ready.wait(timeout=60):
            raise RuntimeError("latency worker did not start")
        sent = anyio.run(_enqueue_only, url, params, backend="asyncio")
        time.sleep(0.2)
        stop.set()
        got = results.get(timeout=60)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    if "error" in got:
        raise RuntimeError(f"latency worker failed: {got['error']}")
    return {**got, **sent}


def _report(
    engine: str, scenario: str, params: LatencyParams, raw: dict[str, Any]
) -> dict[str, Any]:
    samples: list[Sample] = sorted(raw["samples"], key=lambda s: s[1])[_WARMUP:]
    committed: dict[str, float] = raw["committed"]
    lat = [(claimed - stamp) * 1000 for _, stamp, claimed, _ in samples]
    after_commit = [
        (claimed - committed[task_id]) * 1000
        for task_id, _, claimed, _ in samples
        if task_id in committed
    ]
    # The wake-up's share: commit returned -> claim started (negative when the
    # waiter woke before the enqueuer's commit call returned), and the claim's own.
    to_wake = [
        (begun - committed[task_id]) * 1000
        for task_id, _, _, begun in samples
        if task_id in committed
    ]
    claim_ms = [(claimed - begun) * 1000 for _, _, claimed, begun in samples]
    create_ms = raw["durations"][_WARMUP:]
    return {
        "engine": engine,
        "mode": "latency",
        "scenario": scenario,
        "samples": len(lat),
        "median_ms": round(median(lat), 3),
        "p90_ms": round(percentile(lat, 90), 3),
        "p99_ms": round(percentile(lat, 99), 3),
        "max_ms": round(max(lat, default=0.0), 3),
        "commit_to_claim_median_ms": round(median(after_commit), 3),
        "commit_to_claim_p99_ms": round(percentile(after_commit, 99), 3),
        "commit_to_wake_median_ms": round(median(to_wake), 3),
        "commit_to_wake_p99_ms": round(percentile(to_wake, 99), 3),
        "claim_call_median_ms": round(median(claim_ms), 3),
        "claim_call_p99_ms": round(percentile(claim_ms, 99), 3),
        "create_median_ms": round(median(create_ms), 3),
        "create_p99_ms": round(percentile(create_ms, 99), 3),
        "slow_samples": sum(1 for x in lat if x >= params.wait_timeout * 500),
        "wakeups": raw["wakeups"],
        "wait_timeouts": raw["timeouts"],
        "pause_s": params.pause,
        "wait_timeout_s": params.wait_timeout,
        "wakeup_outbox": params.wakeup_outbox,
        **_paired_floor(raw, median(lat)),
    }


def _paired_floor(raw: dict[str, Any], median_ms: float) -> dict[str, Any]:
    """The floor measured between this scenario's own enqueues, if it has one."""
    times = raw.get("floor_durations")
    if not times:
        return {}
    floor = median(times[_WARMUP:])
    return {
        "paired_floor_median_ms": round(floor, 3),
        "ratio_to_paired_floor": round(median_ms / floor, 3),
    }


def run_latency(
    dbs: Databases, params: LatencyParams, emit: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """Run the scenarios this engine supports; emits one object per scenario."""
    rows: list[dict[str, Any]] = []
    scenarios = [s for s in SCENARIOS if dbs.engine == "postgres" or s != "cross-process"]
    if params.scenarios is not None:
        unsupported = sorted(set(params.scenarios) - set(scenarios))
        if unsupported:
            raise ValueError(f"scenarios: {', '.join(unsupported)} not run on {dbs.engine}")
        scenarios = [s for s in scenarios if s in params.scenarios]
    url = dbs.fresh("latfloor")
    floor: dict[str, Any] = {"engine": dbs.engine, "mode": "latency", "scenario": "floor"}
    floor |= {"load_average_before": load_average(), "pause_s": params.pause}
    floor |= anyio.run(_floor, url, params, backend="asyncio")
    emit(floor)
    dbs.drop(url)
    for scenario in scenarios:
        url = dbs.fresh(f"lat{len(rows)}")
        log.info("latency: %s, %d samples", scenario, params.samples)
        load = load_average()
        if scenario in ("in-process", "in-process-handoff"):
            raw = _in_process_guarded(url, params, handoff=scenario == "in-process-handoff")
        elif scenario == "in-process-threads":
            raw = anyio.run(_threads, url, params, backend="asyncio")
        else:
            raw = _cross_process(url, params)
        if "error" in raw:
            row = {"engine": dbs.engine, "mode": "latency", "scenario": scenario, **raw}
            log.error("latency %s failed: %s", scenario, raw["error"])
        else:
            row = _report(dbs.engine, scenario, params, raw)
            row["ratio_to_floor"] = round(row["median_ms"] / floor["durable_insert_median_ms"], 3)
            if scenario == "in-process-handoff" and "inline_insert_median_ms" in floor:
                row["ratio_to_inline_floor"] = round(
                    row["median_ms"] / floor["inline_insert_median_ms"], 3
                )
        row["load_average_before"] = load
        emit(row)
        rows.append(row)
        dbs.drop(url)
    return rows
