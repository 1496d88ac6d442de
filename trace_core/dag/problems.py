"""Problems found in a DAG file, and the error that carries them.

Validation collects every problem instead of stopping at the first, so one
run of ``trace-lite dag validate`` shows everything to fix. Each problem
names the file, the line of the YAML node, the field path and the rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from trace_core.errors import ConfigurationError

__all__ = ["DagValidationError", "FieldPath", "LineMap", "Problem", "Severity", "format_field"]

Severity = Literal["error", "warning"]

FieldPath = tuple[str | int, ...]


def format_field(path: Iterable[str | int]) -> str:
    """Render a field path the way a reader writes it: ``jobs[2].inputs[0].from``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


@dataclass(frozen=True, order=True)
class Problem:
    """One problem: where it is (file, line, field) and which rule it breaks.

    ``line`` is 1-based, or ``None`` when the problem is about the whole file
    (unreadable, empty). ``field`` is the rendered path (``jobs[0].name``) or
    ``""`` for the document itself.
    """

    file: str
    line: int | None
    field: str
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        kind = "warning: " if self.severity == "warning" else ""
        field = f"{self.field}: " if self.field else ""
        return f"{where}: {kind}{field}{self.message}"


class DagValidationError(ConfigurationError):
    """A DAG file breaks one or more rules; ``problems`` lists every one.

    ``str()`` renders one problem per line, errors first in file order.
    """

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(
            sorted(problems, key=lambda p: (p.severity != "error", p.file, p.line or 0, p.field))
        )
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def errors(self) -> tuple[Problem, ...]:
        """The problems that make the file invalid (not the warnings)."""
        return tuple(p for p in self.problems if p.severity == "error")


class LineMap:
    """Field path -> 1-based line of its YAML node (the key's line for a mapping entry).

    A path that is not in the file (a missing field, or a location inside a
    value) answers with the line of its nearest ancestor that is.
    """

    def __init__(self, lines: dict[FieldPath, int] | None = None) -> None:
        self._lines: dict[FieldPath, int] = dict(lines or {})

    def line(self, path: Sequence[str | int]) -> int | None:
        """The line of ``path`` or of its nearest ancestor; ``None`` if none is known."""
        key = tuple(path)
        while True:
            found = self._lines.get(key)
            if found is not None:
                return found
            if not key:
                return None
            key = key[:-1]
