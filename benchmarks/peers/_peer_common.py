"""What the peers' scripts share: /proc CPU accounting, the run loop, the summary
line, and (for the PgQueuer scripts) dropping a run's database.

Imported by the scripts as a sibling module (they run as files in the peers'
virtualenv, without Trace installed), so it needs the standard library only
(asyncpg is imported where it is used: the Huey script does not need it).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def proc_stat(pid: int | str) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds incl. reaped children)`` of a live process, else None."""
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = st[st.rindex(")") + 2 :].split()
    return int(f[1]), sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def family_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children."""
    total = 0.0
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(name)
            if st and (st[0] == pid or int(name) == pid):
                total += st[1]
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not in iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def print_summary(peer: str, rows: Sequence[dict[str, Any]], **fields: Any) -> None:
    """The summary line after the per-run lines: medians and whether all verified."""
    summary = {"peer": peer, "summary": True, "runs": len(rows), **fields}
    summary["median_jobs_per_s"] = statistics.median(r["jobs_per_s"] for r in rows)
    summary["jobs_per_s_all"] = [r["jobs_per_s"] for r in rows]
    summary["all_verified"] = all(r["verified"] for r in rows)
    print(json.dumps(summary), flush=True)


def print_runs(runs: int, run_once: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``run_once(0..runs-1)``, printing each row as a JSON line as it comes;
    the rows."""
    rows = []
    for run in range(runs):
        row = run_once(run)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


async def drop_database(server: str, name: str) -> None:
    """Drop a run's database on the Postgres ``server`` (connected to with asyncpg)."""
    import asyncpg

    admin = await asyncpg.connect(server)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()
