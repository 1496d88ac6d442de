"""Lazy package exports (PEP 562): a package names its public API without loading it.

A package ``__init__`` lists its exports as the imports of an
``if TYPE_CHECKING:`` block (what type checkers and readers see) plus the
literal ``__all__``, and hands its module attributes to :func:`attach`. At run
time nothing is imported until a name is first used: ``import trace_core`` or
``import trace_core.authoring`` then loads neither SQLAlchemy, Alembic,
FastAPI nor PySpark, which the UDF child pays for at every start. The import
block stays the one place that says where each name comes from.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["attach"]


def _origins(init_file: str) -> dict[str, str]:
    """Exported name -> defining module, read from the ``if TYPE_CHECKING:`` imports."""
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"), init_file)
    origins: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                for alias in stmt.names:
                    origins[alias.asname or alias.name] = stmt.module
    return origins


def attach(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (call with ``__name__, __file__``).

    A first access imports the defining module and caches the value on the
    package, so later lookups are plain attribute reads. An unknown name is
    the usual :class:`AttributeError`. An export named like a submodule of the
    package (``trace_core.dag.deploy``) is resolved at once.
    """
    origins = _origins(init_file)
    folder = Path(init_file).parent
    for name in origins:
        if (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists():
            # Importing the submodule of that name would set the package
            # attribute to the module, hiding the export for good: resolve it now.
            value = getattr(importlib.import_module(origins[name]), name)
            setattr(sys.modules[package], name, value)

    def __getattr__(name: str) -> Any:
        try:
            origin = origins[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(origin), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(origins))

    return __getattr__, __dir__
