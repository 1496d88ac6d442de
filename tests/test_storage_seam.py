"""The storage seam holds: outside ``trace_core/storage/`` no module of the
core reaches the database except through the area ports
(docs/architecture.md, "The storage seam").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CORE = ROOT / "trace_core"
BEHIND_THE_SEAM = sorted(
    [
        # Every module of the core outside storage/ (which holds the migrations).
        *(p for p in CORE.rglob("*.py") if (CORE / "storage") not in p.parents),
    ]
)
LITE_MODULES = sorted((ROOT / "trace_lite").rglob("*.py"))
"""trace_lite composes a SqlRepository and keeps SQLAlchemy for its own
buffered-dataset tables, but reads the core tables through the port too."""
PORT_MODULES = sorted((ROOT / "trace_core" / "storage" / "ports").glob("*.py"))

# What only trace_core/storage/ may touch: the driver layer, the SQL
# implementation and the tables.
FORBIDDEN_IMPORTS = ("sqlalchemy", "trace_core.storage.sql", "trace_core.storage.schema")
FORBIDDEN_NAMES = frozenset({"as_sql", "connection", "engine_name"})


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _violations(
    path: Path,
    imports: tuple[str, ...] = FORBIDDEN_IMPORTS,
    names: frozenset[str] = FORBIDDEN_NAMES,
) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [
        f"imports {name}"
        for name in sorted(_imports(tree))
        if any(name == f or name.startswith(f + ".") for f in imports)
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            bad.append(f"line {node.lineno}: uses .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in names:
            bad.append(f"line {node.lineno}: uses {node.id}")
    return bad


@pytest.mark.parametrize("path", BEHIND_THE_SEAM, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_reaches_storage_only_through_the_port(path: Path) -> None:
    assert _violations(path) == []


@pytest.mark.parametrize("path", LITE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_trace_lite_reads_core_tables_only_through_the_port(path: Path) -> None:
    assert _violations(path, ("trace_core.storage.schema",), frozenset({"as_sql"})) == []


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
