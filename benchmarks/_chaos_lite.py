"""Chaos scenario ``lite-kill``: ``trace-lite run`` SIGKILLed and started again.

The chain pipeline (``examples/chain_pipeline.yaml``, ``--blocks`` scaled by
``--scale``) runs as a ``trace-lite run`` process on a fresh state database
and data directory. Once tasks run, the process is SIGKILLed at a random
moment (seeded; the seed is in the row) and started again on the same data
directory and database; the second process finishes the run.

Units of work are blocks: the progress lines the command prints ("blocks
N/M") are the timeline. The fault lasts from the kill to the restart's spawn;
``recover_s`` counts from there to blocks flowing again at speed, and
``resume_s`` from the restart's spawn to its first task completed, and
``source_resume_s`` to the always-on source running again (the figure the data
directory lock shortened: a restart used to wait out the dead run's leases,
60 s for the chain's source; the JVM's start is in ``resume_s`` alone, as the
source claims before Spark starts). ``lost`` counts datasets not current, partitions
missing or unequal to the pyarrow reference, and alert rows missing or
duplicated.

:class:`LiteRun` (one ``trace-lite run`` process, its progress and its
kill) is shared with ``tests/test_chaos_lite.py``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio

from benchmarks._chaos import ChaosScenario, Timeline
from benchmarks._common import Databases, Engine
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import table_name_of
from trace_lite.pipeline.cryo import partition_ranges
from trace_lite.pipeline.transforms import STAGING_PREFIX
from trace_lite.status import DatasetStatus
from trace_testing.lite_reference import (
    PARQUET_DATASETS,
    chain_statuses,
    example_chain,
    expected_alerts,
    read_partition,
    reference_partition,
    small_dag,
    stored_alerts,
)

__all__ = ["SCENARIO", "LiteRun", "staging_left"]

ROOT = Path(__file__).resolve().parent.parent
_PROGRESS = re.compile(r"^\[\s*([\d.]+)s\] tasks: (.*) \| blocks ([\d,]+)/([\d,]+)")


class LiteRun:
    """One ``trace-lite run`` process; its progress lines are read as they come.

    ``progress`` holds ``(monotonic time, blocks done, tasks text)`` per
    progress line; ``lines`` every stdout line. stderr goes to ``log_file``.
    """

    def __init__(
        self,
        dag: Path,
        data_dir: Path,
        database_url: str | None,
        log_file: Path,
        *,
        workers: int = 3,
        timeout_s: int = 600,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        """Start the process (``--spark-master local[1]``: one core per process);
        ``database_url`` ``None``: the data directory's own SQLite file."""
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.progress: list[tuple[float, int, str]] = []
        self._changed = threading.Condition()
        self._stderr: IO[bytes] = log_file.open("ab")
        argv = [
            sys.executable,
            *("-m", "trace_lite.cli", "run", str(dag)),
            *("--data-dir", str(data_dir)),
            *(("--db", database_url) if database_url else ()),
            *("--workers", str(workers), "--spark-master", "local[1]"),
            *("--timeout", str(timeout_s)),
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        self.log_file = log_file
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                found = _PROGRESS.match(line)
                if found:
                    self.progress.append((now, int(found[3].replace(",", "")), found[2]))
                self._changed.notify_all()
        self.proc.stdout.close()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, what: str, condition: Callable[[LiteRun], bool], timeout: float) -> None:
        """Block until ``condition(self)`` holds (checked at every line); raise
        :class:`TimeoutError` naming ``what`` (and the output so far) after
        ``timeout`` seconds, :class:`RuntimeError` if the process ended first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition(self):
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"trace-lite run exited before {what}: {self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {what} within {timeout:.0f} s: {self.tail()}")
                self._changed.wait(min(remaining, 1.0))

    def running(self) -> int:
        """Tasks ``Running`` at the last progress line (the always-on source among them)."""
        return self._count("Running")

    def _count(self, state: str) -> int:
        found = re.search(rf"{state} (\d+)", self.progress[-1][2]) if self.progress else None
        return int(found[1]) if found else 0

    def completed(self) -> int:
        """Tasks ``Completed`` at the last progress line (0 before the first)."""
        return self._count("Completed")

    def blocks_done(self) -> int:
        """Blocks done at the last progress line (0 before the first)."""
        return self.progress[-1][1] if self.progress else 0

    def kill(self) -> float:
        """SIGKILL the process and reap it; the monotonic time of the kill."""
        at = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)
        self._stderr.close()
        return at

    def finish(self, timeout: float) -> int:
        """Wait for the process to exit by itself; its exit code."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"trace-lite run did not finish in {timeout:.0f} s: {self.tail()}"
            ) from None
        self._reader.join(30)
        self._stderr.close()
        return code

    def tail(self, lines: int = 15) -> str:
        """The last stdout lines and the end of stderr, for messages."""
        err = self.log_file.read_text(errors="replace")[-3000:] if self.log_file.exists() else ""
        return "\n".join(self.lines[-lines:]) + "\n--- stderr ---\n" + err


def staging_left(data_dir: Path) -> list[Path]:
    """Every ``._staging-*`` directory under the data directory's object store."""
    return sorted(p for p in (data_dir / "objects").rglob(f"{STAGING_PREFIX}*") if p.is_dir())


# --- the scenario ------------------------------------------------------------------


async def _source_attempt(repo: SqlRepository) -> tuple[int, str]:
    """The always-on source run's attempt and status (``(0, "")`` before it exists)."""
    async with repo.read() as tx:
        found = await tx.status.recent_tasks("default", "chain", limit=1, job_name="follow")
    return (found[0].attempt, found[0].status) if found else (0, "")


def source_attempt(database_url: str) -> int:
    """The attempt of the always-on source's run."""

    async def read() -> int:
        repo = SqlRepository(database_url)
        try:
            return (await _source_attempt(repo))[0]
        finally:
            await repo.close()

    return anyio.run(read)


def wait_source_reclaimed(
    database_url: str, attempt: int, timeout: float, running: Callable[[], bool]
) -> float | None:
    """Block until the source's run is ``Running`` in an attempt after
    ``attempt`` (the restart claimed it again); the monotonic time it was seen.
    ``None`` if the restart exits first: the killed run had finished every
    task, so the restart had nothing to claim. Polled every 0.1 s: the
    precision of ``source_resume_s``."""

    async def poll() -> float | None:
        repo = SqlRepository(database_url)
        try:
            with anyio.fail_after(timeout):
                while running():
                    now, status = await _source_attempt(repo)
                    if now > attempt and status == "Running":
                        return time.monotonic()
                    await anyio.sleep(0.1)
                return None
        finally:
            await repo.close()

    return anyio.run(poll)


def _lost(
    data_dir: Path, statuses: Sequence[DatasetStatus], blocks: int, size: int
) -> dict[str, int]:
    """What the run is missing against the pyarrow reference (0 everywhere: nothing lost)."""
    chain = example_chain()
    current = {s.name: s for s in statuses if s.dag_version_status == "current"}
    not_current = len({s.name for s in statuses} - set(current))
    ranges = partition_ranges(0, blocks - 1, size)
    partitions = 0
    for name in PARQUET_DATASETS:
        status = current.get(name)
        for start, end in ranges:
            got = None if status is None else read_partition(data_dir, status, start, end)
            if got is None or not got.equals(reference_partition(chain, name, start, end)):
                partitions += 1
    wanted = {alert[0] for alert in expected_alerts(blocks, size)}
    stored: list[str] = []
    if "alerts" in current:
        table = table_name_of(current["alerts"].location)
        stored = [alert[0] for alert in stored_alerts(data_dir / "data.db", table)]
    alerts = len(wanted - set(stored)) + (len(stored) - len(set(stored)))
    return {"datasets_not_current": not_current, "partitions": partitions, "alerts": alerts}


def _run(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    scale = float(options.get("scale", 1.0))
    size = max(50, int(400 * scale))
    blocks = 3 * size
    seed = int(options.get("seed", random.randrange(2**32)))
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="trace-chaos-lite-"))
    try:
        with Databases(engine, None) as databases:
            url = databases.fresh("chaoslite")
            dag = work / "chain.yaml"
            dag.write_text(small_dag(blocks, size))
            data_dir = work / "data"
            timeline = Timeline()
            first = LiteRun(dag, data_dir, url, work / "run-1.log")
            # A partition done first: the rate before the fault is then measured.
            first.wait_for(
                "a partition done and a task running",
                lambda r: r.blocks_done() > 0 and r.running() >= 2,
                600,
            )
            # The fault's random moment, not a wait for state; the window shrinks
            # with the workload so that a small run is still killed mid-work.
            delay = rng.uniform(0.0, 5.0 * min(scale, 1.0))
            time.sleep(delay)
            done_before = first.blocks_done()
            _blocks_to_timeline(timeline, first.progress, 0)
            timeline.fault_started()
            first.kill()
            attempt = source_attempt(url)
            second = LiteRun(dag, data_dir, url, work / "run-2.log")
            spawned = time.monotonic()
            timeline.fault_ended()
            source_back = wait_source_reclaimed(
                url, attempt, 600, lambda: second.proc.poll() is None
            )
            second.wait_for("the restart's first progress line", lambda r: bool(r.progress), 600)
            at_start = second.completed()
            second.wait_for(
                "a task done after the restart",
                lambda r: r.completed() > at_start or r.proc.poll() is not None,
                600,
            )
            resumed = time.monotonic()
            code = second.finish(600)
            timeline.finished()
            _blocks_to_timeline(timeline, second.progress, done_before)
            takeover = next((line for line in second.lines if "restart after" in line), "")
            lost = _lost(data_dir, chain_statuses(url), blocks, size)
            return {
                **timeline.phases(),
                "lost": sum(lost.values()),
                "lost_detail": lost,
                "resume_s": round(resumed - spawned, 3),
                "source_resume_s": None if source_back is None else round(source_back - spawned, 3),
                "finished": code == 0,
                "blocks": blocks,
                "seed": seed,
                "kill_delay_s": round(delay, 3),
                "blocks_at_kill": done_before,
                "staging_left": len(staging_left(data_dir)),
                "takeover": takeover.strip(),
                # What the restart said last, when it did not finish: with the
                # seed, what a failed run needs to be looked into.
                "restart_tail": None if code == 0 else second.tail(),
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _blocks_to_timeline(
    timeline: Timeline, progress: Sequence[tuple[float, int, str]], before: int
) -> None:
    """Blocks done, as completions at the progress line that first showed them."""
    seen = before
    for at, done, _ in progress:
        if done > seen:
            timeline.completions.extend([at] * (done - seen))
            seen = done
    timeline.completions.sort()


SCENARIO = ChaosScenario(
    name="lite-kill",
    summary="trace-lite run SIGKILLed at a random moment and started again on its data directory",
    engines=("sqlite", "postgres"),
    run=_run,
)
