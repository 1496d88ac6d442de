"""The storage seam holds: the modules moved behind the port stay behind it.

Until ``import-linter`` enforces the layers for the whole core, this lists the
modules that already reach the database only through the area ports
(docs/architecture.md, "The storage seam"); a module joins the list when it
is moved, and never leaves it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DISPATCHER = ROOT / "trace_core" / "dispatcher"
MOVED_DISPATCHER_MODULES = (
    # control: job states, backpressure, concurrency, scale, capabilities
    "backpressure",
    "capabilities",
    "concurrency",
    "job_states",
    "scale",
    # sources: source runs, cron, manual triggers, backfill, task starts
    "backfill",
    "cron",
    "launcher",
    "manual",
    "source_runs",
    "sources",
    # explain: operator state, payloads, metrics, control, reaper
    "control",
    "metrics",
    "operator_state",
    "payload",
    "reaper",
    # events: events, routing, coverage, redeliveries, the journal, topology
    "coverage",
    "events",
    "journal",
    "promoter",
    "redeliveries",
    "routing",
    "routing_sql",
    "topology",
)
BEHIND_THE_SEAM = sorted(
    [
        *(ROOT / "trace_core" / "dag").glob("*.py"),
        ROOT / "trace_core" / "api" / "streams.py",
        *(DISPATCHER / f"{name}.py" for name in MOVED_DISPATCHER_MODULES),
        ROOT / "trace_core" / "standalone.py",
        ROOT / "trace_lite" / "run_command.py",
    ]
)
PORT_MODULES = sorted((ROOT / "trace_core" / "storage" / "ports").glob("*.py"))

# What only trace_core/storage/ may touch: the driver layer, the SQL
# implementation and the tables.
FORBIDDEN_IMPORTS = ("sqlalchemy", "trace_core.storage.sql", "trace_core.storage.schema")
FORBIDDEN_NAMES = {"as_sql", "connection", "engine_name"}


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [
        f"imports {name}"
        for name in sorted(_imports(tree))
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IMPORTS)
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            bad.append(f"line {node.lineno}: uses .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            bad.append(f"line {node.lineno}: uses {node.id}")
    return bad


@pytest.mark.parametrize("path", BEHIND_THE_SEAM, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_reaches_storage_only_through_the_port(path: Path) -> None:
    assert _violations(path) == []


@pytest.mark.parametrize("path", PORT_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_port_modules_do_not_import_sqlalchemy(path: Path) -> None:
    imports = _imports(ast.parse(path.read_text()))
    assert not [name for name in imports if name.split(".")[0] == "sqlalchemy"]


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sqlalchemy as sa\n"
        "from trace_core.storage import schema\n"
        "async def f(tx):\n"
        "    return tx.connection, tx.engine_name\n"
    )
    assert _violations(bad) == [
        "imports sqlalchemy",
        "imports trace_core.storage.schema",
        "line 4: uses .connection",
        "line 4: uses .engine_name",
    ]
