"""Where the test suite's CPU goes: an opt-in per-test CPU report.

``pytest --cpu-report=PATH`` records, for every test (setup, call and
teardown together):

- ``wall``: its wall-clock seconds;
- ``cpu_self``: the CPU seconds of the pytest (worker) process itself;
- ``cpu_children``: the CPU seconds of that process's descendants, the ones
  that stay alive across tests (the Spark JVM, the throwaway Postgres server
  with its backends) and the ones a test starts and reaps (a ``trace-lite``
  subprocess, a UDF child);
- ``children``: ``cpu_children`` split by the descendants' command name
  (``java``, ``postgres`` …), to tell Spark from Postgres; the CPU of the
  subprocesses a test ran and waited for is ``exited``.

Wall time on a shared two-core machine says little; the CPU is what the
suite's wall time is made of when both cores are busy, so this is the figure
to cut. With pytest-xdist each worker appends its records to
``PATH.parts/<worker>.jsonl`` as it goes (a hung run still leaves the tests
that finished), and the controller merges them into ``PATH``, a JSON list.

Not counted: a process that left the tree, such as the JVM of a test's
subprocess that was killed or exited without waiting for it (reparented to
init, its CPU is nobody's here). Measure such a test's whole tree from
outside, e.g. under a child subreaper.

``python -m tests.cpu_report PATH`` prints the top 40 tests and the totals
per file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["CpuReportPlugin", "ProcessTreeCpu", "main", "summarize"]

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Stat:
    ppid: int
    name: str
    own: int
    """utime + stime, in clock ticks."""
    reaped: int
    """cutime + cstime: the CPU of the children this process has waited for."""


def _read_stat(pid: str) -> _Stat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode("utf-8", "replace")
    except OSError:  # gone between listing /proc and reading it
        return None
    # The command name is in parentheses and may itself hold spaces or ')'.
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state) of proc(5): ppid is 4, utime..cstime 14..17.
    return _Stat(
        ppid=int(fields[1]),
        name=name,
        own=int(fields[11]) + int(fields[12]),
        reaped=int(fields[13]) + int(fields[14]),
    )


class ProcessTreeCpu:
    """The CPU of a process's descendants, from ``/proc``, by command name.

    A descendant's figure is its own CPU plus what it has reaped of its own
    children; the root's reaped children count too. So a backend that exits
    during a test moves its CPU into its parent's ``reaped`` share and stays
    counted. Processes that escape the tree (daemonized, reparented to init)
    are not counted; the test fixtures start Spark and Postgres as children.
    """

    def __init__(self, root: int) -> None:
        self._root = root

    def snapshot(self) -> dict[int, _Stat]:
        """The ``/proc`` figures of every descendant and of the root itself."""
        stats: dict[int, _Stat] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _read_stat(entry)
                if stat is not None:
                    stats[int(entry)] = stat
        children: dict[int, list[int]] = defaultdict(list)
        for pid, stat in stats.items():
            children[stat.ppid].append(pid)
        result: dict[int, _Stat] = {}
        if self._root in stats:
            result[self._root] = stats[self._root]
        stack = list(children.get(self._root, ()))
        while stack:
            pid = stack.pop()
            result[pid] = stats[pid]
            stack.extend(children.get(pid, ()))
        return result

    def delta(self, before: dict[int, _Stat], after: dict[int, _Stat]) -> dict[str, float]:
        """CPU seconds of the descendants between two snapshots, by command name.

        A descendant's own CPU goes under its name. What its children used
        and it reaped in between (a Postgres backend that ended, reaped by the
        server) goes under its name too: the child is gone, its parent says
        what it was. What the root reaped (a subprocess a test ran) goes under
        ``exited``. A process that ended in between counted what it had used
        before the first snapshot then already: that is taken off again where
        it reappears, its parent's share.
        """
        by_name: dict[str, float] = defaultdict(float)

        def reaped_by(pid: int, stat: _Stat) -> str:
            return "exited" if pid == self._root else stat.name

        for pid, stat in after.items():
            old = before.get(pid)
            reaped = stat.reaped - (old.reaped if old is not None else 0)
            own = 0 if pid == self._root else stat.own - (old.own if old is not None else 0)
            by_name[reaped_by(pid, stat)] += reaped / _TICKS
            if own:
                by_name[stat.name] += own / _TICKS
        for pid, old in before.items():
            if pid not in after:
                parent = after.get(old.ppid)
                label = "exited" if parent is None else reaped_by(old.ppid, parent)
                by_name[label] -= (old.own + old.reaped) / _TICKS
        return {name: value for name, value in by_name.items() if abs(value) >= 0.005}


class CpuReportPlugin:
    """Records wall and CPU seconds per test and writes them out (see module doc)."""

    def __init__(self, path: Path, worker: str) -> None:
        self._path = path
        self._worker = worker
        self._parts = path.with_name(path.name + ".parts")
        self._tree = ProcessTreeCpu(os.getpid())
        self._started = False

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        """Measure setup, call and teardown of ``item`` as one."""
        wall = time.perf_counter()
        cpu = time.process_time()
        tree = self._tree.snapshot()
        if not self._started:
            # Start-up and collection (imports of every test module) happen once
            # per process before its first test: a record of their own.
            self._started = True
            self._write(
                f"<startup {self._worker}>", 0.0, cpu, self._tree.delta({}, tree), self._worker
            )
        yield
        children = self._tree.delta(tree, self._tree.snapshot())
        self._write(
            item.nodeid,
            time.perf_counter() - wall,
            time.process_time() - cpu,
            children,
            self._worker,
        )

    def _write(
        self, nodeid: str, wall: float, cpu_self: float, children: dict[str, float], part: str
    ) -> None:
        record = {
            "nodeid": nodeid,
            "wall": round(wall, 3),
            "cpu_self": round(cpu_self, 3),
            "cpu_children": round(sum(children.values()), 3),
            "children": {name: round(value, 3) for name, value in sorted(children.items())},
            "worker": self._worker,
        }
        self._parts.mkdir(parents=True, exist_ok=True)
        with open(self._parts / f"{part}.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Merge the records of every worker into ``PATH`` (controller only)."""
        if self._worker.startswith("gw"):
            return
        if not self._started:  # the xdist controller runs no test: its own CPU
            self._write("<controller>", 0.0, time.process_time(), {}, "controller")
        records: list[dict[str, Any]] = []
        if self._parts.is_dir():
            for part in sorted(self._parts.glob("*.jsonl")):
                with open(part, encoding="utf-8") as handle:
                    records.extend(json.loads(line) for line in handle if line.strip())
        self._path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--cpu-report=PATH``."""
    parser.getgroup("cpu-report").addoption(
        "--cpu-report",
        metavar="PATH",
        default=None,
        help="write the wall and CPU seconds of every test (and of its child "
        "processes: Spark, Postgres) to PATH as JSON; summarize with "
        "`python -m tests.cpu_report PATH`",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the plugin when ``--cpu-report`` is given."""
    path = config.getoption("--cpu-report")
    if not path:
        return
    target = Path(path).resolve()
    workerinput = getattr(config, "workerinput", None)
    worker = workerinput["workerid"] if workerinput else "main"
    if worker == "main":
        # A fresh run: the records of an earlier one must not be merged in.
        parts = target.with_name(target.name + ".parts")
        for old in parts.glob("*.jsonl") if parts.is_dir() else ():
            old.unlink()
    config.pluginmanager.register(CpuReportPlugin(target, worker), "cpu-report-plugin")


def _file_of(nodeid: str) -> str:
    if nodeid.startswith("<"):  # start-up, controller: one line for all processes
        return nodeid.split()[0].rstrip(">") + ">"
    return nodeid.split("::", 1)[0]


def summarize(records: Iterable[dict[str, Any]], top: int = 40) -> str:
    """The top ``top`` tests by total CPU, then the totals per file, as text."""
    rows = list(records)

    def total(row: dict[str, Any]) -> float:
        return float(row["cpu_self"]) + float(row["cpu_children"])

    lines = [f"{'total':>8} {'self':>8} {'child':>8} {'wall':>8}  test (top {top} by CPU)"]
    for row in sorted(rows, key=total, reverse=True)[:top]:
        lines.append(
            f"{total(row):8.2f} {row['cpu_self']:8.2f} {row['cpu_children']:8.2f}"
            f" {row['wall']:8.2f}  {row['nodeid']}"
        )
    per_file: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    names: set[str] = set()
    for row in rows:
        acc = per_file[_file_of(row["nodeid"])]
        acc["tests"] += 1
        acc["total"] += total(row)
        acc["self"] += row["cpu_self"]
        acc["wall"] += row["wall"]
        for name, value in row.get("children", {}).items():
            label = _category(name)
            names.add(label)
            acc[label] += value
    columns = sorted(names)
    lines.append("")
    header = f"{'total':>8} {'self':>8} " + " ".join(f"{c:>9}" for c in columns)
    lines.append(header + f" {'wall':>8} {'tests':>5}  file")
    grand: dict[str, float] = defaultdict(float)
    for name, acc in sorted(per_file.items(), key=lambda item: item[1]["total"], reverse=True):
        for key, value in acc.items():
            grand[key] += value
        lines.append(_file_line(acc, columns, name))
    lines.append(_file_line(grand, columns, "ALL"))
    return "\n".join(lines)


def _category(name: str) -> str:
    # Postgres backends rename themselves ("postgres: user db …" is truncated
    # to 15 characters in /proc/<pid>/stat): group them under one name.
    if name.startswith("postgres") or name.startswith("postmaster"):
        return "postgres"
    return name[:9]


def _file_line(acc: dict[str, float], columns: list[str], name: str) -> str:
    cells = " ".join(f"{acc.get(c, 0.0):9.2f}" for c in columns)
    return (
        f"{acc['total']:8.2f} {acc['self']:8.2f} {cells}"
        f" {acc['wall']:8.2f} {int(acc['tests']):5d}  {name}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.cpu_report PATH [--top N]``."""
    parser = argparse.ArgumentParser(prog="python -m tests.cpu_report", description=__doc__)
    parser.add_argument("path", type=Path, help="the JSON written by --cpu-report")
    parser.add_argument("--top", type=int, default=40, help="how many tests to list (40)")
    args = parser.parse_args(argv)
    records = json.loads(args.path.read_text(encoding="utf-8"))
    print(summarize(records, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
